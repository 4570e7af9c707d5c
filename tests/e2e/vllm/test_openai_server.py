"""The OpenAI-compatible server with the one --kv-transfer-config flag, on a real pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from kvfabric import Client
from kvfabric.testing.servers import start_pool, stop_process_group

from conftest import CHUNK, LOADABLE, PARTS, PROMPTS, free_port, metric_total, post_json, scrape_metrics, wait_healthy

START_TIMEOUT_S = 300


def _post(url: str, body: dict) -> dict:
    return post_json(url, body, 120)


def test_openai_completions_hit_the_pool(tiny_model, cold):
    prompt = PROMPTS["openai"]
    with start_pool(1, capacity="64MiB") as pool, tempfile.TemporaryFile("w+") as log:
        port = free_port()
        flag = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric_vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"servers": pool.addresses, "chunk_tokens": CHUNK}}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20),
               "--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--seed", "0",
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(flag)]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log, START_TIMEOUT_S)
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            first = _post(url + "/v1/completions", body)     # prefills and saves
            with Client(pool.addresses) as c:
                before = c.stats()["servers"][pool.addresses[0]]
            second = _post(url + "/v1/completions", body)    # no local prefix cache: loads from the pool
            with Client(pool.addresses) as c:
                after = c.stats()["servers"][pool.addresses[0]]
            # vLLM's own /metrics carries the connector's counters (KV-connector stats -> Prometheus);
            # vLLM records a step's stats after the step, so wait for the load to show up
            deadline = time.monotonic() + 60
            while True:
                metrics = scrape_metrics(url)
                if metric_total(metrics, "vllm:kvfabric_load_tokens_total") > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            stop_process_group(proc)
    assert first["choices"][0]["token_ids"] == cold["openai"]
    assert second["choices"][0]["token_ids"] == cold["openai"]
    assert before["objects"] == len(prompt) // CHUNK * PARTS     # one object per (chunk, layer, KV head)
    assert after["hits"] - before["hits"] >= LOADABLE // CHUNK        # hits visible in the pool's stats
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens", 0) >= LOADABLE
    # pool hits (exists, loaded), bytes and load / save latency in vLLM's own /metrics
    assert metric_total(metrics, "vllm:kvfabric_lookup_hit_tokens_total") >= LOADABLE
    assert metric_total(metrics, "vllm:kvfabric_load_tokens_total") >= LOADABLE
    assert metric_total(metrics, "vllm:kvfabric_load_chunks_total") >= LOADABLE // CHUNK
    assert metric_total(metrics, "vllm:kvfabric_load_bytes_total") > 0
    assert metric_total(metrics, "vllm:kvfabric_save_chunks_total") >= len(prompt) // CHUNK
    assert metric_total(metrics, "vllm:kvfabric_save_bytes_total") > 0
    assert metric_total(metrics, "vllm:kvfabric_load_seconds_count") >= 1
    assert metric_total(metrics, "vllm:kvfabric_save_seconds_count") >= 1
    assert metric_total(metrics, "vllm:kvfabric_load_seconds_sum") > 0
    assert metric_total(metrics, "vllm:kvfabric_load_errors_total") == 0
