"""Issue 13 item 4: tensor parallel (TP=2) on vLLM's CPU backend through the pool.

vLLM 0.32's CPU build runs TP=2 here only with ``VLLM_CPU_OMP_THREADS_BIND=nobind``:
its automatic binding asserts "Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers. Allowed NUMA nodes are [0]" on a one-NUMA-node machine. Each rank is a
worker process holding its own share of the KV heads (the tiny Llama's 2 KV heads: one
per rank), saving and loading its own objects under its own namespace (``tp_rank``,
``tp_size`` bound in it); a chunk is a hit only if every rank holds it.
"""

from __future__ import annotations

import time

from kvfabric import Client, KeyHasher
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.config import kv_layout_name, make_namespace, parse_extra_config, weights_fingerprint
from kvfabric_vllm.layout import chunk_major_layer_keys

from conftest import CHUNK, LAYERS, LOADABLE, PROMPTS

TP = 2


def rank_keys(model: str, rank: int, tokens: list[int]) -> list[bytes]:
    """The object keys rank ``rank`` of a TP=2 engine uses for ``tokens`` (its own namespace)."""
    cfg = parse_extra_config({"servers": ["127.0.0.1:1"], "chunk_tokens": CHUNK}, "kv_both", 128)
    layout = kv_layout_name("LBHNC", num_kv_heads=2 // TP, head_size=64, head_size_v=64, block_size=128,
                            num_layers=LAYERS)
    ns = make_namespace(cfg, model=model, revision=None, dtype="torch.float32", kv_layout=layout,
                        tp_rank=rank, tp_size=TP, weights=weights_fingerprint(model))
    hasher = KeyHasher(cfg.client.key_algorithm, cfg.client.key_secret)
    return chunk_major_layer_keys(hasher, hasher.prefix_keys(ns, tokens), LAYERS)


def test_tp2_engine_saves_and_loads_each_ranks_share(run_engine, tiny_model, monkeypatch):
    """One TP=2 engine (vLLM's local prefix cache off, so the second run can only hit the pool):
    the prompt cold, then again: both ranks load their own share. That the shares are found by
    their keys alone, not by anything this engine kept, is checked in between: the test derives
    each rank's keys itself (namespace with ``tp_rank``/``tp_size``) and finds them all in the
    pool. (One engine instead of two: a TP=2 start costs ~100 s of CI time on 2 cores.)"""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    prompt = PROMPTS["single"]
    chunks = len(prompt) // CHUNK
    tp = ["--tp", str(TP), "--kv-cache-mb", "64", "--max-model-len", "2048"]
    with start_pool(1, capacity="64MiB") as pool:
        def saves_landed(_i: int) -> None:
            with Client(pool.addresses) as c:
                deadline = time.monotonic() + 120  # the saves are asynchronous: wait for them, generously
                while c.stats()["servers"][pool.addresses[0]]["objects"] < TP * LAYERS * chunks:
                    assert time.monotonic() < deadline, "the TP=2 engine's saves did not reach the pool"
                    time.sleep(0.1)
                assert c.stats()["servers"][pool.addresses[0]]["objects"] == TP * LAYERS * chunks
                # each rank stored its own objects under its own namespace (tp_rank bound in the keys)
                for r in range(TP):
                    assert all(c.exists(rank_keys(tiny_model, r, prompt))), f"rank {r}'s objects are missing"

        res = run_engine(["single", "single"], pool.addresses, args=tp, between=saves_landed)
    assert res["cached"] == [0, LOADABLE], res["cached"]           # cold (empty pool), then both shares loaded
    assert res["counters"]["scheduled_load_tokens"] == LOADABLE    # scheduler side (this process)
    assert res["outputs"][1] == res["outputs"][0]                  # token-identical to the TP=2 cold run
