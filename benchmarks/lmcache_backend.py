"""LMCache store/retrieve throughput: the kvfabric plugin vs LMCache's own ``lm://`` server, same run.

Runs in the LMCache virtualenv (``scripts/ci-lmcache.sh`` builds it)::

    .venvs/lmcache/bin/python benchmarks/lmcache_backend.py [--model llama3-8b] [--tokens 2048] [--repeats 3]

What one run measures, all through LMCache 0.5.6's real ``LMCacheEngine``
(chunk size 256 tokens, local CPU cache off so every hit is remote, naive
serde, the CPU stand-in GPU connector of ``kvfabric_lmcache.cpu_kv``):

* **store**: ``engine.store(tokens, kv=...)`` of a ``--tokens`` prompt, timed
  until a lookup through the same engine reports the whole prompt in the
  backend (LMCache's puts are asynchronous; this is time-to-visible);
* **retrieve**: a second engine (empty, same config) does ``lookup`` then
  ``retrieve`` of that prompt into a zeroed tensor; the result is checked
  bit-identical, so a figure never counts a miss or wrong bytes;
* **lookup**: one ``engine.lookup`` of the stored prompt (latency).

Backends, each fresh: ``kvfabric://`` with 1 and with 2 ``kvfabric serve``
processes, and ``lm://`` with one ``python -m lmcache.v1.server`` process. Each
repeat stores a new prompt (fresh keys; nothing is deduplicated).

Ceilings measured in the same run, for the same chunk objects:

* ``memcpy``: one CPU copy of the prompt's KV bytes (the engine's own copy
  in/out of its memory objects costs at least this);
* ``kvfabric client``: ``Client.put`` / ``Client.get`` of the same chunk
  bytes (with the plugin's header) to the same servers, no LMCache: what the
  pool's transport gives the plugin.

KV size per token comes from ``--model`` (layers x KV heads x head size x 2
(K and V) x 2 bytes): llama3-8b 128 KiB, qwen2.5-7b 56 KiB, llama2-7b 512 KiB,
tiny 2 KiB. Prints a table; writes JSON (``--out``, default
bench-results/lmcache_backend.json). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

MODELS = {  # name: (layers, kv_heads, head_size)
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "llama2-7b": (32, 32, 128),
    "tiny": (4, 2, 64),
}
CHUNK = 256


def _quiet_lmcache() -> None:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    for name in ("lmcache", "kvfabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"lm server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("lm server did not start listening")


class LMServer:
    """LMCache's own remote server, ``python -m lmcache.v1.server 127.0.0.1 PORT cpu``."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc)
        self.url = f"lm://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def engine_config(backend_url: str, cpu_gb: float):
    from lmcache.v1.config import LMCacheEngineConfig

    kw: dict[str, Any] = dict(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=cpu_gb, remote_serde="naive",
                              save_unfull_chunk=True, blocking_timeout_secs=60)
    if backend_url.startswith("kvfabric://"):
        kw.update(remote_storage_plugins=["kvfabric"], extra_config={
            "remote_storage_plugin.kvfabric.module_path": "kvfabric_lmcache",
            "remote_storage_plugin.kvfabric.class_name": "KVFabricConnectorAdapter",
            "remote_storage_plugin.kvfabric.url": backend_url + "?timeout_s=30",
        })
    else:
        kw.update(remote_url=backend_url)
    return LMCacheEngineConfig.from_defaults(**kw)


class Engines:
    """Builds LMCache engines for one model shape and destroys them."""

    def __init__(self, model: str) -> None:
        import torch
        from kvfabric_lmcache.cpu_kv import CPUKVConnector
        from lmcache.v1.metadata import LMCacheMetadata

        self.layers, self.heads, self.head_size = MODELS[model]
        self.hidden = self.heads * self.head_size
        self.dtype = torch.float16
        self.metadata = LMCacheMetadata(
            model_name=f"bench/{model}", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=self.dtype, kv_shape=CPUKVConnector.kv_shape(self.layers, self.heads, self.head_size, CHUNK),
            chunk_size=CHUNK,
        )
        self._gpu = CPUKVConnector(self.layers, self.hidden, self.dtype)

    def build(self, config):
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        name = f"bench-{uuid.uuid4().hex[:8]}"
        engine = LMCacheEngineBuilder.get_or_create(name, config, self.metadata, self._gpu, lambda t, r: None, lambda o, r: o)
        engine.post_init()
        return name, engine

    @staticmethod
    def destroy(name: str) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(name)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_backend(label: str, url: str, eng: Engines, kv, prompts, cpu_gb: float) -> dict[str, Any]:
    """Store each prompt with one engine, retrieve it with a fresh one; time both; verify the bytes."""
    import torch

    nbytes = kv.numel() * kv.element_size()
    n = kv.shape[2]
    store_s, retrieve_s, lookup_s, hit_tokens = [], [], [], []
    name_s, e_store = eng.build(engine_config(url, cpu_gb))
    try:
        for tokens in prompts:
            t0 = time.perf_counter()
            e_store.store(tokens, kv=kv)
            deadline = t0 + 120
            while e_store.lookup(tokens) < n:  # puts are asynchronous: wait until all are visible
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{label}: stored chunks not visible after 120 s")
                time.sleep(0.002)
            store_s.append(time.perf_counter() - t0)
    finally:
        eng.destroy(name_s)
    name_r, e_load = eng.build(engine_config(url, cpu_gb))
    out = torch.empty_like(kv)
    try:
        for tokens in prompts:
            t0 = time.perf_counter()
            found = e_load.lookup(tokens)
            lookup_s.append(time.perf_counter() - t0)
            out.zero_()
            t0 = time.perf_counter()
            mask = e_load.retrieve(tokens, kv=out)
            retrieve_s.append(time.perf_counter() - t0)
            got = int(mask.sum())
            hit_tokens.append(got)
            if found != n or got != n or not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
                raise RuntimeError(f"{label}: retrieve was not a full bit-identical hit (lookup {found}, retrieved {got} of {n})")
        transport = None
        if url.startswith("kvfabric://"):
            conn = e_load.storage_manager.storage_backends["RemoteBackend-kvfabric"].connection.getWrappedConnector()
            shards = conn.client.stats()["client"].get("shards", {})
            transport = sorted({s.get("transport") for s in shards.values()} - {None}) or None
    finally:
        eng.destroy(name_r)
    return {
        "backend": label, "url": url, "transport": transport, "bytes": nbytes, "tokens": n,
        "store_s": store_s, "retrieve_s": retrieve_s, "lookup_s": lookup_s,
        "store_gbps": nbytes / _median(store_s) / 1e9, "retrieve_gbps": nbytes / _median(retrieve_s) / 1e9,
        "lookup_ms": _median(lookup_s) * 1e3,
    }


def bench_memcpy(kv, repeats: int) -> dict[str, Any]:
    import torch

    dst = torch.empty_like(kv)
    dst.copy_(kv)  # fault the pages in first
    ts = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        dst.copy_(kv)
        ts.append(time.perf_counter() - t0)
    nbytes = kv.numel() * kv.element_size()
    return {"backend": "ceiling: memcpy", "bytes": nbytes, "copy_s": ts, "store_gbps": nbytes / _median(ts) / 1e9,
            "retrieve_gbps": nbytes / _median(ts) / 1e9}


def bench_client(addresses: list[str], kv, repeats: int) -> dict[str, Any]:
    """kvfabric Client put/get of the plugin's own chunk objects (header + bytes), no LMCache."""
    import numpy as np
    from kvfabric.client import Client
    from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat

    from kvfabric_lmcache import value

    n = kv.shape[2]
    bounds = [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]
    alloc = MixedMemoryAllocator(kv[:, :, :CHUNK].numel() * kv.element_size() + (64 << 20))
    objs = []
    for s, e in bounds:
        o = alloc.allocate(kv[:, :, s:e].shape, kv.dtype, MemoryFormat.KV_2LTD)
        o.tensor.copy_(kv[:, :, s:e])
        objs.append(value.encode(o))  # exactly what the plugin sends
        o.ref_count_down()
    alloc.close()
    nbytes = kv.numel() * kv.element_size()
    put_s, get_s = [], []
    with Client(addresses, config=None) as c:
        transport = sorted(set(c.transports.values()) - {None})
        bufs = [np.empty(len(v), dtype=np.uint8) for v in objs]
        for r in range(max(1, repeats)):
            keys = [uuid.uuid4().bytes for _ in objs]
            t0 = time.perf_counter()
            res = c.put(keys, objs)
            put_s.append(time.perf_counter() - t0)
            if res.stored != len(keys):
                raise RuntimeError(f"client ceiling: only {res.stored} of {len(keys)} puts stored")
            t0 = time.perf_counter()
            got = c.get_into(keys, bufs)
            get_s.append(time.perf_counter() - t0)
            if any(g is None for g in got):
                raise RuntimeError("client ceiling: a get missed")
    return {"backend": f"ceiling: kvfabric client x{len(addresses)}", "transport": transport, "bytes": nbytes,
            "put_s": put_s, "get_s": get_s, "store_gbps": nbytes / _median(put_s) / 1e9,
            "retrieve_gbps": nbytes / _median(get_s) / 1e9}


def print_table(rows: list[dict[str, Any]], args) -> None:
    layers, heads, hs = MODELS[args.model]
    per_tok = layers * heads * hs * 2 * 2
    print(f"\nLMCache 0.5.6 remote backends: model {args.model} ({per_tok // 1024} KiB KV/token, "
          f"{CHUNK}-token chunks = {per_tok * CHUNK / 2**20:.0f} MiB), prompt {args.tokens} tokens "
          f"({per_tok * args.tokens / 2**20:.0f} MiB), median of {args.repeats}")
    hdr = f"{'backend':<30} {'transport':<10} {'store GB/s':>11} {'retrieve GB/s':>14} {'lookup ms':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        tr = ",".join(r["transport"]) if r.get("transport") else "-"
        lk = f"{r['lookup_ms']:.2f}" if "lookup_ms" in r else "-"
        print(f"{r['backend']:<30} {tr:<10} {r['store_gbps']:>11.3f} {r['retrieve_gbps']:>14.3f} {lk:>10}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048 = 8 chunks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--capacity", default="2GiB", help="capacity of each kvfabric server")
    p.add_argument("--out", default="bench-results/lmcache_backend.json")
    p.add_argument("--skip-lm", action="store_true", help="do not run LMCache's lm:// server")
    args = p.parse_args(argv)
    if args.tokens < CHUNK or args.repeats < 1:
        p.error("--tokens must be >= 256 and --repeats >= 1")
    _quiet_lmcache()
    import torch
    from kvfabric.testing.servers import start_pool

    eng = Engines(args.model)
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(-(2**15), 2**15, (2, eng.layers, args.tokens, eng.hidden), dtype=torch.int16, generator=g).view(torch.float16)
    prompts = [torch.randint(0, 32000, (args.tokens,), generator=g) for _ in range(args.repeats)]
    nbytes = kv.numel() * kv.element_size()
    cpu_gb = max(0.25, 3 * nbytes / 2**30)  # LMCache stages the whole prompt at once; its allocator needs slack

    rows: list[dict[str, Any]] = [bench_memcpy(kv, args.repeats)]
    for nserv in (1, 2):
        with start_pool(nserv, capacity=args.capacity) as pool:
            rows.append(bench_client(list(pool.addresses), kv, args.repeats))
        with start_pool(nserv, capacity=args.capacity) as pool:
            url = "kvfabric://" + ",".join(pool.addresses)
            rows.append(bench_backend(f"LMCache + kvfabric x{nserv}", url, eng, kv, prompts, cpu_gb))
    if not args.skip_lm:
        srv = LMServer()
        try:
            rows.append(bench_backend("LMCache + lm:// server", srv.url, eng, kv, prompts, cpu_gb))
        finally:
            srv.stop()

    print_table(rows, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import lmcache

    meta = {"model": args.model, "kv_bytes_per_token": eng.layers * eng.hidden * 2 * 2, "chunk_tokens": CHUNK,
            "prompt_tokens": args.tokens, "repeats": args.repeats, "capacity": args.capacity,
            "lmcache": getattr(lmcache, "__version__", None), "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "argv": sys.argv[1:] if argv is None else argv}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
