"""``kvfabric bench lmcache_backend``: LMCache store/retrieve, the kvfabric plugin vs LMCache's own ``lm://`` server.

Runs in the LMCache virtualenv (``scripts/ci-lmcache.sh`` builds it)::

    .venvs/lmcache/bin/python benchmarks/lmcache_backend.py [--model llama3-8b] [--tokens 2048] [--repeats 3]

What one run measures, all through LMCache 0.5.6's real ``LMCacheEngine``
(chunk size 256 tokens, local CPU cache off so every hit is remote, naive
serde, the CPU stand-in GPU connector of ``kvfabric_lmcache.cpu_kv``):

* **store**: ``engine.store(tokens, kv=...)`` of a new ``--tokens`` prompt,
  timed until every put has finished. LMCache's puts are asynchronous, and
  its ``RemoteBackend.put_tasks`` set only tracks single puts (a batched put,
  which the kvfabric plugin offers, never enters it), so both kinds of row
  count completions the same way: the backend's own done-callbacks of single
  (``put_callback``) and batched (``batched_put_callback``) put futures are
  wrapped to count the keys whose put finished;
* **lookup**: ``engine.lookup`` of that prompt (latency; must be a full hit);
* **retrieve**: ``engine.retrieve`` of it into a zeroed tensor, checked
  bit-identical, so a figure never counts a miss or wrong bytes. With the
  local CPU cache off the engine keeps no copy itself: every byte comes back
  from the backend.

Backends, side by side in one process: ``kvfabric://`` with 1 and with 2
``kvfabric serve`` processes (the ``native`` transport: TCP with the C data
path, what a network deployment uses), ``lm://`` with one
``python -m lmcache.v1.server`` process, and with ``--shm`` one more
kvfabric row over the same-host ``shm`` transport (a GET is one copy out of
the server's shared arena; no network path, so not the figure to compare
with ``lm://``'s TCP). Ceilings, for the same bytes:

* ``memcpy``: one CPU copy of the prompt's KV each way (the engine itself
  copies at least this much per store and per retrieve);
* ``kvfabric client``: ``Client.put`` / ``lookup`` / ``get_into`` of the
  plugin's own chunk objects (header + bytes) to the same servers, no LMCache:
  what the pool's transport gives the plugin.

Rounds are interleaved (every round runs every row once, after one warm-up
round) so load on a shared machine spreads evenly; figures are medians.

KV size per token comes from ``--model`` (layers x KV heads x head size x 2
(K and V) x 2 bytes): llama3-8b 128 KiB, qwen2.5-7b 56 KiB, llama2-7b 512 KiB,
tiny 2 KiB. Prints a table; writes JSON (``--out``, default
bench-results/lmcache_backend.json).
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
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..testing.ports import PortTaken, free_port, listener

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


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until the lm server ``proc`` itself listens on ``port`` (it listens once it serves; another process
    listening there is :class:`PortTaken`, never taken for it). Where /proc cannot say who listens, until
    the port accepts a connection."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"lm server exited with {proc.returncode}")
        who = listener(port, proc.pid)
        if who == "other":
            raise PortTaken(f"another process listens on 127.0.0.1:{port}, the lm server's port")
        if who == "ours":
            return
        if who == "unknown":
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError("lm server did not start listening")


class LMServer:
    """LMCache's own remote server, ``python -m lmcache.v1.server 127.0.0.1 PORT cpu``."""

    def __init__(self) -> None:
        self.port = free_port()
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
            "remote_storage_plugin.kvfabric.url": backend_url + ("&" if "?" in backend_url else "?") + "timeout_s=30",
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


class Target:
    """One row of the table: ``round(tokens)`` stores and retrieves one prompt, returns (store_s, retrieve_s, lookup_s)."""

    label = ""
    transport: list[str] | None = None

    def close(self) -> None:
        pass


class MemcpyCeiling(Target):
    """One CPU copy of the prompt's KV bytes each way (the engine copies at least this much)."""

    label = "ceiling: memcpy"

    def __init__(self, kv) -> None:
        import torch

        self.kv = kv
        self.dst = torch.empty_like(kv)
        self.dst.copy_(kv)  # fault the pages in first

    def round(self, tokens) -> tuple[float, float, None]:
        t0 = time.perf_counter()
        self.dst.copy_(self.kv)
        t1 = time.perf_counter()
        self.dst.copy_(self.kv)
        return t1 - t0, time.perf_counter() - t1, None


class ClientCeiling(Target):
    """``kvfabric.Client`` put/get of the plugin's own chunk objects (header + bytes), no LMCache."""

    def __init__(self, addresses: list[str], kv) -> None:
        import numpy as np
        from kvfabric import Client, ClientConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat

        from kvfabric_lmcache import value

        n = kv.shape[2]
        alloc = MixedMemoryAllocator(kv[:, :, :CHUNK].numel() * kv.element_size() + (64 << 20))
        self.objs = []
        for s in range(0, n, CHUNK):
            o = alloc.allocate(kv[:, :, s:s + CHUNK].shape, kv.dtype, MemoryFormat.KV_2LTD)
            o.tensor.copy_(kv[:, :, s:s + CHUNK])
            self.objs.append(value.encode(o))  # exactly what the plugin sends
            o.ref_count_down()
        alloc.close()
        self.bufs = [np.empty(len(v), dtype=np.uint8) for v in self.objs]
        self.client = Client(addresses, config=ClientConfig(timeout_s=30, connect_timeout_s=5))  # as the plugin rows
        self.label = f"ceiling: kvfabric client x{len(addresses)}"
        self.transport = sorted(set(self.client.transports.values()) - {None})

    def round(self, tokens) -> tuple[float, float, float]:
        keys = [uuid.uuid4().bytes for _ in self.objs]
        t0 = time.perf_counter()
        res = self.client.put(keys, self.objs)
        t1 = time.perf_counter()
        if res.stored != len(keys):
            raise RuntimeError(f"{self.label}: only {res.stored} of {len(keys)} puts stored")
        found = self.client.lookup(keys)
        t2 = time.perf_counter()
        got = self.client.get_into(keys, self.bufs)
        t3 = time.perf_counter()
        if found != len(keys) or any(g is None for g in got):
            raise RuntimeError(f"{self.label}: a get missed")
        self.client.delete(keys)  # keep the servers' memory flat across rounds
        return t1 - t0, t3 - t2, t2 - t1

    def close(self) -> None:
        self.client.close()


class EngineTarget(Target):
    """LMCache's engine with a remote backend (local CPU cache off): store, then lookup + retrieve, verified."""

    def __init__(self, label: str, url: str, eng: Engines, kv, out, cpu_gb: float) -> None:
        self.label, self.url, self.eng, self.kv, self.out = label, url, eng, kv, out
        self.name, self.engine = eng.build(engine_config(url, cpu_gb))
        self.backend = next(b for k, b in self.engine.storage_manager.storage_backends.items() if k.startswith("RemoteBackend"))
        if self.backend.connection is None:
            raise RuntimeError(f"{label}: LMCache could not build the remote connector for {url}")
        self.conn = self.backend.connection.getWrappedConnector()
        self.kvfabric = url.startswith("kvfabric://")
        if self.kvfabric:
            self.transport = sorted(set(self.conn.client.transports.values()) - {None})
        self._count_put_completions()

    def _count_put_completions(self) -> None:
        """Count keys whose put future finished, single or batched (LMCache calls these on its loop)."""
        self.puts_done = 0
        lock = threading.Lock()
        single, batched = self.backend.put_callback, self.backend.batched_put_callback

        def on_single(future, key) -> None:
            single(future, key)
            with lock:
                self.puts_done += 1

        def on_batched(future, keys) -> None:
            batched(future, keys)
            with lock:
                self.puts_done += len(keys)

        self.backend.put_callback = on_single
        self.backend.batched_put_callback = on_batched

    def round(self, tokens) -> tuple[float, float, float]:
        import torch

        n = self.kv.shape[2]
        chunks = len(range(0, n, CHUNK))
        puts0 = self.puts_done
        t0 = time.perf_counter()
        self.engine.store(tokens, kv=self.kv)
        while self.puts_done < puts0 + chunks:
            if time.perf_counter() - t0 > 120:
                raise RuntimeError(f"{self.label}: puts not finished after 120 s")
            time.sleep(0.001)
        t1 = time.perf_counter()
        found = self.engine.lookup(tokens)
        t2 = time.perf_counter()
        self.out.zero_()
        t3 = time.perf_counter()
        got = int(self.engine.retrieve(tokens, kv=self.out).sum())
        t4 = time.perf_counter()
        if found != n or got != n or not torch.equal(self.out.view(torch.int16), self.kv.view(torch.int16)):
            raise RuntimeError(f"{self.label}: not a full bit-identical hit (lookup {found}, retrieved {got} of {n})")
        return t1 - t0, t4 - t3, t2 - t1

    def close(self) -> None:
        self.eng.destroy(self.name)


def run_rounds(targets: list[Target], prompts, nbytes: int) -> list[dict[str, Any]]:
    """Round-robin: every round runs every target once, so machine noise spreads evenly over the rows."""
    times: dict[str, dict[str, list[float]]] = {t.label: {"store_s": [], "retrieve_s": [], "lookup_s": []} for t in targets}
    for tokens in prompts:
        for t in targets:
            st, rt, lk = t.round(tokens)
            times[t.label]["store_s"].append(st)
            times[t.label]["retrieve_s"].append(rt)
            if lk is not None:
                times[t.label]["lookup_s"].append(lk)
    rows = []
    for t in targets:
        d = times[t.label]
        row: dict[str, Any] = {"backend": t.label, "transport": t.transport, "bytes": nbytes, **d,
                               "store_gbps": nbytes / _median(d["store_s"]) / 1e9,
                               "retrieve_gbps": nbytes / _median(d["retrieve_s"]) / 1e9}
        if d["lookup_s"]:
            row["lookup_ms"] = _median(d["lookup_s"]) * 1e3
        rows.append(row)
    return rows


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
    p = argparse.ArgumentParser(prog="kvfabric bench lmcache_backend", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048 = 8 chunks)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--capacity", default="1GiB", help="capacity of each kvfabric server")
    p.add_argument("--out", default="bench-results/lmcache_backend.json")
    p.add_argument("--skip-lm", action="store_true", help="do not run LMCache's lm:// server")
    p.add_argument("--shm", action="store_true",
                   help="add a row with the same-host shm transport (1 server offering shm; not a network path)")
    args = p.parse_args(argv)
    if args.tokens < CHUNK or args.repeats < 1:
        p.error("--tokens must be >= 256 and --repeats >= 1")
    _quiet_lmcache()
    import torch
    from kvfabric.testing.servers import start_pool

    eng = Engines(args.model)
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(-(2**15), 2**15, (2, eng.layers, args.tokens, eng.hidden), dtype=torch.int16, generator=g).view(torch.float16)
    prompts = [torch.randint(0, 32000, (args.tokens,), generator=g) for _ in range(args.repeats + 1)]
    nbytes = kv.numel() * kv.element_size()
    cpu_gb = max(0.25, 2 * nbytes / 2**30)  # LMCache stages the whole prompt at once; its allocator needs slack

    targets: list[Target] = []
    pools = []
    srv = None
    try:
        memcpy = MemcpyCeiling(kv)
        targets.append(memcpy)
        for nserv in (1, 2):
            pools.append(start_pool(nserv, capacity=args.capacity))
            targets.append(ClientCeiling(list(pools[-1].addresses), kv))
            url = "kvfabric://" + ",".join(pools[-1].addresses)
            targets.append(EngineTarget(f"LMCache + kvfabric x{nserv}", url, eng, kv, memcpy.dst, cpu_gb))
        if args.shm:
            pools.append(start_pool(1, capacity=args.capacity, extra_args=["--transports", "tcp,native,shm"]))
            url = "kvfabric://" + pools[-1].addresses[0] + "?transport=shm"
            targets.append(EngineTarget("LMCache + kvfabric x1 shm", url, eng, kv, memcpy.dst, cpu_gb))
        if not args.skip_lm:
            srv = LMServer()
            targets.append(EngineTarget("LMCache + lm:// server", srv.url, eng, kv, memcpy.dst, cpu_gb))
        run_rounds(targets, prompts[:1], nbytes)  # warm-up round, not reported
        rows = run_rounds(targets, prompts[1:], nbytes)
    finally:
        for t in targets:
            t.close()
        for p_ in pools:
            p_.stop()
        if srv is not None:
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
