"""Regression tests for the connector defects of issue 13, on real vLLM engines and real pool servers.

Each test names the defect it pins down. Engines are their own processes
(``engine_run.py``); ``cold`` is an engine without the connector.
"""

from __future__ import annotations

import pytest

from kvfabric import Client
from kvfabric.testing.servers import start_pool

from conftest import BUSY_LOADABLE, CHUNK, PARTS, PROMPT_TOKENS

SAVED = PROMPT_TOKENS // CHUNK     # whole chunks of a 1500-token prompt


def pool_objects(addresses: list[str]) -> int:
    with Client(addresses) as c:
        return sum(s["objects"] for s in c.stats()["servers"].values())


def delta(after: dict, before: dict, name: str) -> int:
    return after[name] - before[name]


def test_cache_salt_isolation_no_resend_of_local_hits_and_logs_in_vllm_output(run_engine, cold):
    """One engine with vLLM's local prefix cache on, the same prompt three times:
    1. unsalted, cold: saves its whole chunks;
    2. unsalted again: vLLM's local prefix cache covers every loadable chunk. Defect: the
       connector returned before any lookup, so it gathered and re-sent all of them
       (answered "exists"). Now the lookup tells it the pool holds them: nothing is sent;
    3. salted ``tenant-b``: defect: it loaded the 1280 tokens saved unsalted. Now the salt
       is bound into the keys: no hit, output identical to cold, its own chunks saved.
    And the connector's INFO lines reach vLLM's own log output (defect: they never did)."""
    with start_pool(1, capacity="64MiB") as pool:
        r = run_engine(["salt", "salt", "salt"], pool.addresses, salts=[None, None, "tenant-b"],
                       args=["--prefix-caching"])
        objects = pool_objects(pool.addresses)
    c0, c1, c2 = r["counters_after"]
    assert r["outputs"] == [cold["salt"]] * 3
    # 1: cold, saved
    assert r["cached"][0] == 0 and c0["save_chunks"] == SAVED
    # 2: a local hit (vLLM's own cache), and nothing re-sent to the pool
    assert r["cached"][1] >= PROMPT_TOKENS - CHUNK, r["cached"]
    assert delta(c1, c0, "lookups") == 1, (c0, c1)        # looked up to learn what the pool holds
    assert delta(c1, c0, "save_known_chunks") == SAVED, (c0, c1)
    assert delta(c1, c0, "save_jobs") == 0 and delta(c1, c0, "save_chunks") == 0, (c0, c1)
    # 3: another tenant's salt: nothing from the unsalted entries, its own saved
    assert r["cached"][2] == 0, r["cached"]
    assert delta(c2, c1, "scheduled_load_tokens") == 0 and delta(c2, c1, "lookup_hit_tokens") == 0
    assert delta(c2, c1, "save_chunks") == SAVED
    assert objects == 2 * SAVED * PARTS         # one pool object per (chunk, layer, KV head)
    # vLLM's log output (its handler, its format) carries the connector's INFO lines
    out = r["stdout"] + r["log"]
    assert "kvfabric connector (SCHEDULER)" in out and "kvfabric connector (WORKER)" in out, out[-3000:]


def test_waiting_and_preempted_requests_count_once_and_look_up_again(run_engine, cold):
    """Four 700-token prompts at once in an engine whose KV cache holds 3 of them
    (max_model_len 2048, 10 MiB of KV), 200 tokens each, so requests wait for
    blocks (vLLM asks the connector again every step) and running ones are
    preempted as their decodes grow. ``busy_d`` was saved beforehand.

    Defects: ``lookup_hit_tokens`` was added on every scheduler call (a waiting
    request counted its hit every step); a lookup result was kept for the
    request's life, so a preempted request never re-checked the pool (not even
    for its own chunks saved before the preemption). Now: one count per lookup,
    equal to what vLLM then scheduled to load; each preempted request is looked
    up again and loads its saved chunks. Loads are async (``load_kv_async``):
    outputs identical to cold."""
    names = ["busy_a", "busy_b", "busy_c", "busy_d"]
    engine = ["--kv-cache-mb", "10", "--max-model-len", "2048"]
    with start_pool(1, capacity="64MiB") as pool:
        run_engine(["busy_d"], pool.addresses, args=engine)          # busy_d's chunks in the pool
        r = run_engine(names, pool.addresses, max_tokens=200, args=[*engine, "--batch"])
    c = r["counters"]
    assert [o[:12] for o in r["outputs"]] == [cold[n] for n in names]
    assert c["relookups"] >= 1, c                          # someone was preempted and looked up again
    assert c["lookup_hit_tokens"] == c["scheduled_load_tokens"], c   # one count per lookup
    # busy_d's saved chunks, and a preempted request's own chunks found by its second lookup
    assert c["scheduled_load_tokens"] >= 2 * BUSY_LOADABLE, c
    assert c["load_tokens"] == c["scheduled_load_tokens"] and c["async_loads"] >= 2, c
    assert c["load_failed_chunks"] == 0 and c["load_errors"] == 0, c


def test_lora_engine_is_refused_at_start_with_a_clear_error(run_engine):
    """Defect: LoRA (and multimodal) models were not refused: an adapter changes the KV of
    the same tokens, which the keys do not bind. The connector now refuses to start."""
    with pytest.raises(AssertionError, match="engine failed") as err:
        run_engine(["salt"], ["127.0.0.1:1"], args=["--enable-lora"])
    assert "kvfabric: LoRA is not supported" in str(err.value), str(err.value)[-3000:]


def _connector_for(model_dir: str):
    """Build the connector the way vLLM does (scheduler side), on vLLM's own ModelConfig of
    ``model_dir``, with a pool that is not there (it serves without it)."""
    import torch
    from kvfabric_vllm.connector import KVFabricConnector
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    xfer = KVTransferConfig(kv_connector="KVFabricConnector", kv_connector_module_path="kvfabric_vllm.connector",
                            kv_role="kv_both", kv_connector_extra_config={"servers": ["127.0.0.1:1"]})
    vc = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
                    kv_transfer_config=xfer)
    # the tiny Llama's KV heads (the connector checks a rank's heads against the model's, layout 3)
    spec = FullAttentionSpec(block_size=CHUNK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    return KVFabricConnector(vc, KVConnectorRole.SCHEDULER, kvc)


def test_multimodal_model_is_refused_with_a_clear_error(tmp_path, tiny_model):
    """Defect: multimodal models were not refused (an image changes the KV of the same placeholder
    tokens, which the keys do not bind). No multimodal engine can run here (the models vLLM's CPU
    build can import need weights and processors this test cannot fetch), so the check runs where
    vLLM runs it: the connector built on vLLM's own ModelConfig of a tiny PaliGemma config (vLLM
    decides it is multimodal). The same construction on the text-only tiny Llama is accepted."""
    from kvfabric.errors import ConfigError
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    text = GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=16, projection_dim=64)
    cfg = PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=500,
                          projection_dim=64)
    cfg.architectures = ["PaliGemmaForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="kvfabric: multimodal models are not supported"):
        _connector_for(str(tmp_path))
    _connector_for(tiny_model).shutdown()  # text-only: built (the pool is down: it serves without it)
