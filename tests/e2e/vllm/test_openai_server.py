"""The OpenAI-compatible server with the one --kv-transfer-config flag, on a real pool."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from kvfabric import Client
from kvfabric.testing.servers import start_pool, stop_process_group

from conftest import CHUNK, LAYERS, LOADABLE, PROMPTS

START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _wait_healthy(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"api_server exited {proc.returncode}:\n{log.read()[-6000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise AssertionError("api_server did not become healthy")


def test_openai_completions_hit_the_pool(tiny_model, cold):
    prompt = PROMPTS["openai"]
    with start_pool(1, capacity="64MiB") as pool, tempfile.TemporaryFile("w+") as log:
        port = _free_port()
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
            _wait_healthy(proc, url, log)
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            first = _post(url + "/v1/completions", body)     # prefills and saves
            with Client(pool.addresses) as c:
                before = c.stats()["servers"][pool.addresses[0]]
            second = _post(url + "/v1/completions", body)    # no local prefix cache: loads from the pool
            with Client(pool.addresses) as c:
                after = c.stats()["servers"][pool.addresses[0]]
        finally:
            stop_process_group(proc)
    assert first["choices"][0]["token_ids"] == cold["openai"]
    assert second["choices"][0]["token_ids"] == cold["openai"]
    assert before["objects"] == len(prompt) // CHUNK * LAYERS    # one object per (chunk, layer)
    assert after["hits"] - before["hits"] >= LOADABLE // CHUNK        # hits visible in the pool's stats
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens", 0) >= LOADABLE
