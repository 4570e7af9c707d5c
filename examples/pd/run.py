"""Prefill/decode disaggregation through a kvfabric pool: a pool, two vLLM servers and the PD proxy.

Run it in the vLLM virtualenv (``scripts/ci-vllm.sh`` creates .venvs/vllm)::

    .venvs/vllm/bin/python examples/pd/run.py [--model DIR] [--servers-n 2]

Without ``--model`` it builds a tiny random-weight Llama offline (the text is
gibberish; the point is where the KV comes from). Step by step:

1. starts ``--servers-n`` ``kvfabric serve`` processes on free loopback ports;
2. starts two ``python -m vllm.entrypoints.openai.api_server`` instances
   with the kvfabric connector: a prefill instance (``kv_role:
   kv_producer``: saves prompt KV, never loads; a finished request's blocks
   are held until its puts are acknowledged) and a decode instance
   (``kv_role: kv_consumer``: loads, never saves); vLLM's own prefix cache
   is off on both, and ``chunk_tokens`` is vLLM's CPU block size (128), so the
   decode instance computes at most one partial block of each prompt;
3. starts ``examples/pd/proxy.py`` in front of them;
4. sends two ``/v1/completions`` requests to the proxy and prints, per
   request, the prompt tokens the decode instance loaded from the pool, then
   the pool servers' object and hit counts and the proxy's counts.

Everything it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvfabric import Client
from kvfabric.testing.servers import start_pool, stop_process_group

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 420) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(log.read_text()[-4000:], file=sys.stderr)
            raise SystemExit(f"vLLM at {url} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"vLLM at {url} did not become healthy in time")


def start_vllm(model: str, role: str, servers: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    flag = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric_vllm.connector",
            "kv_role": role, "kv_connector_extra_config": {"servers": servers, "chunk_tokens": 128}}
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20),
           "--max-model-len", "4096", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(flag)]
    print(f"starting vLLM ({role}) on port {port}: --kv-transfer-config {json.dumps(flag)}")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))
    return proc, f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory or name (default: build a tiny random Llama)")
    ap.add_argument("--servers-n", type=int, default=2)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvf-pd-example-") as tmp:
        model = args.model
        if model is None:
            from kvfabric_vllm.tinymodel import build_tiny_llama

            model = str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        procs: list[subprocess.Popen] = []
        with start_pool(args.servers_n, capacity="256MiB") as pool:
            print("pool servers:", ", ".join(pool.addresses))
            try:
                prefill, purl = start_vllm(model, "kv_producer", pool.addresses, Path(tmp) / "prefill.log")
                procs.append(prefill)
                decode, durl = start_vllm(model, "kv_consumer", pool.addresses, Path(tmp) / "decode.log")
                procs.append(decode)
                wait_healthy(prefill, purl, Path(tmp) / "prefill.log")
                wait_healthy(decode, durl, Path(tmp) / "decode.log")
                proxy = subprocess.Popen([sys.executable, str(HERE / "proxy.py"), "--port", "0",
                                          "--prefill", purl, "--decode", durl],
                                         stdout=subprocess.PIPE, text=True, start_new_session=True)
                procs.append(proxy)
                url = "http://" + proxy.stdout.readline().split()[-1]
                print("PD proxy:", url)
                rng = random.Random(0)
                words = "pool block cache key value token prefix shard server engine layer chunk".split()
                for question in ("question one: which shard holds the prefix?",
                                 "question two: how many blocks were loaded?"):
                    document = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(700))
                    t0 = time.perf_counter()
                    res = post(url + "/v1/completions", {"model": model, "prompt": document + "\n" + question,
                                                         "max_tokens": 16, "temperature": 0})
                    usage = res["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    print(f"request {question[:12]!r}: prompt {usage['prompt_tokens']} tokens, decode instance "
                          f"loaded {cached} from the pool and computed {usage['prompt_tokens'] - cached}; "
                          f"{1e3 * (time.perf_counter() - t0):.0f} ms through the proxy")
                with Client(pool.addresses) as c:
                    for addr, s in c.stats()["servers"].items():
                        print(f"pool server {addr}: {s['objects']} chunks stored, {s['hits']} chunk hits")
                with urllib.request.urlopen(url + "/stats", timeout=10) as r:
                    print("proxy:", r.read().decode())
            finally:
                for p in reversed(procs):
                    stop_process_group(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
