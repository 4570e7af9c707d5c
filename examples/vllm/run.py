"""kvfabric + vLLM in one script: two pool servers, one vLLM server with the flag, two requests sharing a prefix.

Run it in the vLLM virtualenv (``scripts/ci-vllm.sh`` creates .venvs/vllm)::

    .venvs/vllm/bin/python examples/vllm/run.py [--model DIR]

Without ``--model`` it builds a tiny random-weight Llama offline (the output
text is gibberish; the point is the cache hits). What it does, step by step:

1. starts two ``kvfabric serve`` processes on free loopback ports;
2. starts ``python -m vllm.entrypoints.openai.api_server`` with
   ``--kv-transfer-config`` naming ``KVFabricConnector`` and the two servers
   (vLLM's own prefix cache is turned off, so every reuse below comes from the
   pool, as it would for a second vLLM instance on another node);
3. sends two ``/v1/completions`` requests whose prompts share a long prefix
   (a "document") and end with different questions;
4. prints, per request, the prompt tokens vLLM reported as cached, and the
   pool servers' object and hit counts.

Everything it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvfabric import Client
from kvfabric.testing.ports import PortTaken, free_port, http_ready
from kvfabric.testing.servers import start_pool, stop_process_group


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with status {proc.returncode}; see its log above")
        try:
            if http_ready(url, proc.pid, timeout_s=2):
                return
        except PortTaken as e:                      # its port was taken before it bound it
            raise SystemExit(str(e)) from None
        time.sleep(1)
    raise SystemExit("vLLM did not become healthy in time")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory or name (default: build a tiny random Llama)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvf-example-") as tmp:
        model = args.model
        if model is None:
            from kvfabric_vllm.tinymodel import build_tiny_llama

            model = str(build_tiny_llama(Path(tmp) / "tiny-llama"))

        with start_pool(2, capacity="256MiB") as pool:
            print("pool servers:", ", ".join(pool.addresses))
            flag = {
                "kv_connector": "KVFabricConnector",
                "kv_connector_module_path": "kvfabric_vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"servers": pool.addresses},
            }
            port = free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                   "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20),
                   "--max-model-len", "4096", "--enable-prompt-tokens-details",
                   "--kv-transfer-config", json.dumps(flag)]
            print("starting vLLM:", " ".join(cmd[:3]), "... --kv-transfer-config", json.dumps(flag))
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
            proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "vllm.log", "w"))
            try:
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(proc, url)
                except SystemExit:
                    print((Path(tmp) / "vllm.log").read_text()[-4000:], file=sys.stderr)
                    raise
                rng = random.Random(0)
                words = "pool block cache key value token prefix shard server engine layer chunk".split()
                document = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(900))
                for question in ("question one: which shard holds the prefix?",
                                 "question two: how many blocks were loaded?"):
                    res = post(url + "/v1/completions", {"model": model, "prompt": document + "\n" + question,
                                                         "max_tokens": 16, "temperature": 0})
                    usage = res["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    print(f"request {question[:12]!r}: prompt {usage['prompt_tokens']} tokens, "
                          f"{cached} cached (loaded from the pool)")
                with Client(pool.addresses) as c:
                    for addr, s in c.stats()["servers"].items():
                        print(f"pool server {addr}: {s['objects']} chunks stored, {s['hits']} chunk hits")
            finally:
                stop_process_group(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
