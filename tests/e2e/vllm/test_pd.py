"""Prefill/decode disaggregation through the pool (issue 13 item 2).

The worker test runs without an engine on a real server: a producer's held
request is reported (vLLM's ``finished_sending``) only once its put was
acknowledged. The e2e test runs two real OpenAI servers (``kv_producer``,
``kv_consumer``), ``examples/pd/proxy.py`` and a real ``kvfabric serve``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvfabric import Client, KeyHasher
from kvfabric.testing.servers import start_pool, stop_process_group
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.meta import SaveSpec
from kvfabric_vllm.metrics import Counters
from kvfabric_vllm.layout import chunk_major_layer_keys
from kvfabric_vllm.worker import WorkerSide

from conftest import LAYERS, PROMPTS, wait_healthy, free_port, post_json

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 300      # generous: "never hangs" means it answers well within this
VLLM_BLOCK = 128             # vLLM's CPU block size; PD chunks are one block
PD_WAIT_MS = 3000


# ---------------------------------------------------------------------------- worker, no engine

def test_held_request_is_reported_only_after_its_put_is_acknowledged():
    block, layers, names = 32, 2, ["l0", "l1"]
    with start_pool(1, capacity="16MiB") as pool:
        cfg = parse_extra_config({"servers": pool.addresses, "chunk_tokens": block, "save_timeout_s": 60.0,
                                  "timeout_s": 60.0, "connect_timeout_s": 60.0}, "kv_producer", block)
        assert cfg.hold_until_saved and not cfg.load
        w = WorkerSide(cfg, Client(config=cfg.client), 0, block, names, Counters())
        kv = [torch.randn((8, 2, block, 16)) for _ in range(layers)]
        w.register(dict(zip(names, kv)))
        keys = [os.urandom(16), os.urandom(16)]
        spec = SaveSpec("p1", [keys], [[None, keys[0]]], [[1], [5]])
        try:
            assert w.client.lookup(keys) == 0                # connected before the server stops
            os.kill(pool[0].pid, signal.SIGSTOP)          # the put cannot be acknowledged now
            try:
                w.submit_saves([spec])
                # the step where vLLM passes the finished request and the scheduler's hold
                assert w.finished_saves({"p1", "other"}, ["p1"]) == set()
                for _ in range(5):
                    assert w.finished_saves(set(), []) == set()
            finally:
                os.kill(pool[0].pid, signal.SIGCONT)
            deadline = time.monotonic() + 60
            reported: set[str] = set()
            while not reported:
                assert time.monotonic() < deadline, "held request never reported"
                reported = w.finished_saves(set(), [])
            assert reported == {"p1"}                      # never "other": it was not held
            with Client(pool.addresses) as c:                  # reported => in the pool (every layer)
                assert c.lookup(chunk_major_layer_keys(KeyHasher(), keys, layers)) == 2 * layers
            c = w.counters.snapshot()
            assert c["held_released"] == 1 and c["save_chunks"] == 2
            assert w.finished_saves(set(), []) == set()        # reported once
        finally:
            w.shutdown()


# ---------------------------------------------------------------------------- e2e

def _post(url: str, body: dict) -> dict:
    return post_json(url, body, REQUEST_TIMEOUT_S)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _start_vllm(model: str, role: str, servers: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flag = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric_vllm.connector",
            "kv_role": role,
            "kv_connector_extra_config": {"servers": servers, "chunk_tokens": VLLM_BLOCK,
                                          "pd_wait_ms": PD_WAIT_MS}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20),
           "--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--seed", "0",
           "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(flag)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"




def _start_proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(ROOT / "examples" / "pd" / "proxy.py"), "--port", "0",
           "--prefill", prefill, "--decode", decode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()           # "PD proxy listening on host:port"
    assert line.startswith("PD proxy listening on "), line
    return proc, "http://" + line.split()[-1]


def _complete(url: str, model: str, prompt: list[int]) -> dict:
    return _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                           "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})


def _cached(res: dict) -> int:
    return (res["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_pd_proxy_decodes_from_the_pool_and_recomputes_when_it_dies(tiny_model, cold):
    names = ["single", "openai"]                 # 1500-token prompts, run at once through the proxy
    procs: list[subprocess.Popen] = []
    with start_pool(1, capacity="64MiB") as pool, tempfile.TemporaryFile("w+") as plog, \
            tempfile.TemporaryFile("w+") as dlog:
        try:
            prod, purl = _start_vllm(tiny_model, "kv_producer", pool.addresses, plog)
            procs.append(prod)
            cons, curl = _start_vllm(tiny_model, "kv_consumer", pool.addresses, dlog)
            procs.append(cons)
            wait_healthy(prod, purl, plog, START_TIMEOUT_S)
            wait_healthy(cons, curl, dlog, START_TIMEOUT_S)
            proxy, url = _start_proxy(purl, curl)
            procs.append(proxy)

            with ThreadPoolExecutor(2) as ex:
                results = dict(zip(names, ex.map(lambda n: _complete(url, tiny_model, PROMPTS[n]), names)))
            with Client(pool.addresses) as c:
                stats = c.stats()["servers"][pool.addresses[0]]
            proxy_counts = _get(url + "/stats")

            # the pool dies mid-run: the consumer recomputes (after its bounded wait), never hangs
            pool[0].kill()
            down = _complete(url, tiny_model, PROMPTS["down"])
            after = _complete(url, tiny_model, PROMPTS["single"])
        finally:
            for p in reversed(procs):
                stop_process_group(p)
        dlog.seek(0)
        consumer_log = dlog.read()

    for n in names:
        res = results[n]
        assert res["choices"][0]["token_ids"] == cold[n], n          # identical to a single instance
        prompt = len(PROMPTS[n])
        # the consumer computed at most one partial block: everything before it came from the pool
        assert prompt - _cached(res) <= VLLM_BLOCK, (n, _cached(res))
        assert _cached(res) == (prompt - 1) // VLLM_BLOCK * VLLM_BLOCK
    # every request went to the consumer with the producer's kv_transfer_params
    assert proxy_counts == {"requests": 2, "prefill_failures": 0, "with_params": 2}
    whole = sum(len(PROMPTS[n]) // VLLM_BLOCK for n in names)
    assert stats["objects"] == whole * LAYERS            # the producer saved every whole block (per layer)
    assert stats["hits"] >= sum((len(PROMPTS[n]) - 1) // VLLM_BLOCK for n in names)
    assert "kvfabric connector (SCHEDULER)" in consumer_log

    assert down["choices"][0]["token_ids"] == cold["down"]
    assert _cached(down) == 0                            # recomputed: nothing could be loaded
    # ... after waiting (bounded, pd_wait_ms) for the chunks the producer reported: warned once
    assert "chunks the producer reported after" in consumer_log
    assert after["choices"][0]["token_ids"] == cold["single"]
    assert _cached(after) == 0
