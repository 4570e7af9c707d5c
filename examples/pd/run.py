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
3. starts ``examples/pd/proxy.py`` in front of them (``kvfabric route --mode pd``:
   docs/route.md);
4. sends two ``/v1/completions`` requests to the proxy (the second one
   streamed) and prints, per request, the prompt tokens the decode instance
   loaded from the pool and whether its tokens equal those of the prefill
   instance computing the same request alone; then the pool servers' object
   and hit counts and the proxy's counts. It exits with status 1 if the
   tokens differ or the decode instance loaded nothing.

Already running a pool and the two instances? Point the example at them
instead of starting its own (the CI test does; the model name is the decode
instance's)::

    python examples/pd/run.py --prefill http://P:8100 --decode http://D:8200 [--servers H:P,H:P]

Everything it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Iterator

from kvfabric import Client
from kvfabric.testing.ports import PortTaken, free_port, http_ready
from kvfabric.testing.servers import start_pool, stop_process_group

HERE = Path(__file__).resolve().parent
QUESTIONS = ("question one: which shard holds the prefix?", "question two: how many blocks were loaded?")
MAX_TOKENS = 16


def _request(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def complete(url: str, body: dict) -> tuple[list[int], int, int]:
    """POST a completion (streamed if ``body["stream"]``): (generated token ids, prompt tokens, cached tokens)."""
    body = dict(body, return_token_ids=True)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}    # the last event carries the usage
    tokens: list[int] = []
    usage: dict = {}
    with _request(url + "/v1/completions", body) as r:
        if not body.get("stream"):
            res = json.loads(r.read())
            tokens, usage = res["choices"][0]["token_ids"], res["usage"]
        else:
            for line in r:                                  # server-sent events: "data: {...}"
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                for choice in event.get("choices") or []:
                    tokens += choice.get("token_ids") or []
                usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return tokens, usage["prompt_tokens"], cached


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 420) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(log.read_text()[-4000:], file=sys.stderr)
            raise SystemExit(f"vLLM at {url} exited with status {proc.returncode}")
        try:
            if http_ready(url, proc.pid, timeout_s=2):
                return
        except PortTaken as e:                      # its port was taken before it bound it
            raise SystemExit(str(e)) from None
        time.sleep(1)
    raise SystemExit(f"vLLM at {url} did not become healthy in time")


def start_vllm(model: str, role: str, servers: list[str], log: IO, extra_config: dict | None = None,
               extra_args: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """Start an OpenAI server with the kvfabric connector in ``role`` (output to ``log``, an open file):
    (process, base URL). ``extra_config`` adds ``kv_connector_extra_config`` keys, ``extra_args`` flags."""
    flag = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric_vllm.connector",
            "kv_role": role,
            "kv_connector_extra_config": {"servers": servers, "chunk_tokens": 128, **(extra_config or {})}}
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20),
           "--max-model-len", "4096", "--enable-prompt-tokens-details", *extra_args,
           "--kv-transfer-config", json.dumps(flag)]
    print(f"starting vLLM ({role}) on port {port}: --kv-transfer-config {json.dumps(flag)}", flush=True)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def start_proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    """Start ``proxy.py`` on a free port in front of one prefill and one decode instance: (process, URL)."""
    proc = subprocess.Popen([sys.executable, str(HERE / "proxy.py"), "--port", "0",
                             "--prefill", prefill, "--decode", decode],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()                       # "PD proxy listening on HOST:PORT"
    if not line.startswith("PD proxy listening on "):
        stop_process_group(proc)
        raise SystemExit(f"the PD proxy did not start: {line!r}")
    return proc, "http://" + line.split()[-1]


def demo(prefill: str, decode: str, servers: list[str], model: str | None = None) -> int:
    """Send the example's requests through a PD proxy in front of ``prefill`` and ``decode`` and print what
    happened; 0 if every answer equals the prefill instance's own and the decode instance loaded from the pool."""
    proxy, url = start_proxy(prefill, decode)
    ok = True
    try:
        print("PD proxy:", url, flush=True)
        model = model or get_json(url + "/v1/models")["data"][0]["id"]     # the decode instance's
        rng = random.Random(0)
        words = "pool block cache key value token prefix shard server engine layer chunk".split()
        for i, question in enumerate(QUESTIONS):
            document = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(700))
            body = {"model": model, "prompt": document + "\n" + question, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": i == 1}
            t0 = time.perf_counter()
            tokens, prompt, cached = complete(url, body)
            ms = 1e3 * (time.perf_counter() - t0)
            # the reference: the same request computed by one instance alone (the prefill
            # instance never loads, and its prefix cache is off: it computes the whole prompt)
            alone, _, _ = complete(prefill, dict(body, stream=False))
            same = tokens == alone and len(tokens) == MAX_TOKENS
            ok = ok and same and cached > 0
            print(f"request {question[:12]!r}{' (streamed)' if body['stream'] else ''}: prompt {prompt} tokens, "
                  f"decode instance loaded {cached} from the pool and computed {prompt - cached}; "
                  f"{ms:.0f} ms through the proxy; same tokens as one instance alone: {'yes' if same else 'NO'}",
                  flush=True)
        if servers:
            with Client(servers) as c:
                for addr, s in c.stats()["servers"].items():
                    print(f"pool server {addr}: {s['objects']} objects (one per chunk and layer), {s['hits']} hits")
        print("proxy:", json.dumps(get_json(url + "/stats")), flush=True)
    finally:
        stop_process_group(proxy)
    return 0 if ok else 1


@contextlib.contextmanager
def own_deployment(model: str | None, servers_n: int) -> Iterator[tuple[str, str, list[str], str]]:
    """A pool and the two instances, stopped on exit: (prefill URL, decode URL, pool addresses, model)."""
    with tempfile.TemporaryDirectory(prefix="kvf-pd-example-") as tmp:
        if model is None:
            from kvfabric_vllm.tinymodel import build_tiny_llama

            model = str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        procs: list[subprocess.Popen] = []
        with start_pool(servers_n, capacity="256MiB") as pool:
            print("pool servers:", ", ".join(pool.addresses))
            try:
                logs = {role: Path(tmp) / f"{role}.log" for role in ("kv_producer", "kv_consumer")}
                urls = {}
                for role, log in logs.items():
                    proc, urls[role] = start_vllm(model, role, pool.addresses, open(log, "w"))
                    procs.append(proc)
                for proc, (role, log) in zip(procs, logs.items()):
                    wait_healthy(proc, urls[role], log)
                yield urls["kv_producer"], urls["kv_consumer"], pool.addresses, model
            finally:
                for p in reversed(procs):
                    stop_process_group(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory or name (default: build a tiny random Llama; with "
                                    "--prefill/--decode: the decode instance's model)")
    ap.add_argument("--servers-n", type=int, default=2, help="pool servers to start")
    ap.add_argument("--prefill", help="base URL of a running kv_producer instance (with --decode: start nothing)")
    ap.add_argument("--decode", help="base URL of a running kv_consumer instance")
    ap.add_argument("--servers", default="", help="with --prefill/--decode: the pool's HOST:PORT,... (for its stats)")
    args = ap.parse_args()
    if bool(args.prefill) != bool(args.decode):
        ap.error("--prefill and --decode go together")
    if args.prefill:
        servers = [s for s in args.servers.split(",") if s]
        return demo(args.prefill.rstrip("/"), args.decode.rstrip("/"), servers, args.model)
    with own_deployment(args.model, args.servers_n) as (prefill, decode, servers, model):
        return demo(prefill, decode, servers, model)


if __name__ == "__main__":
    sys.exit(main())
