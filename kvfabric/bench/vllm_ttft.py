"""TTFT on real vLLM: cold prefill vs a kvfabric pool hit vs vLLM's own local prefix-cache hit.

Runs in the vLLM virtualenv (``scripts/ci-vllm.sh`` builds it)::

    .venvs/vllm/bin/python benchmarks/vllm_ttft.py [--lengths 512,1500,3000,6000] [--repeats 3]
        [--servers-n 2] [--chunk-tokens 128] [--load async|sync|layerwise] [--model DIR]
        [--server-transports tcp,native,shm] [--transport auto] [--no-trace]
        [--out bench-results/vllm_ttft.json]
    .venvs/vllm/bin/python benchmarks/vllm_ttft.py --data-path [--lengths ...]   # no engine: per-step times

One run, same machine, same model (the tiny random Llama of
``kvfabric_vllm.tinymodel`` unless ``--model``; float32, eager), each engine
in its own process, both alive at once and taking turns: per length and
repeat the pool engine serves its two requests, then the local engine the
same prompt's two (``_Engine``), so both see the same machine load:

* **pool** engine: the kvfabric connector on ``--servers-n`` fresh
  ``kvfabric serve`` processes on this host, vLLM's prefix cache OFF. The
  servers offer ``--server-transports`` (default ``tcp,native,shm``: an engine
  on the pool server's host, the deployment this figure is for), and the
  connector's client picks with ``--transport`` (default ``auto``: ``shm``
  when offered, one copy out of the server's arena; checksums verified as
  on every transport). ``--server-transports tcp,native`` gives the figure
  for an engine that reaches the pool over the network stack. Per length and repeat
  a fresh random prompt is sent twice: the first request is a **cold**
  prefill (the pool is empty for it; it saves its chunks), then, once its
  saves are in the pool, the same prompt again is a **pool hit** (all whole
  chunks loaded from the pool, the tail and one token computed).
* **local** engine: no connector, vLLM's prefix cache ON. The same twice-sent
  prompts give a second **cold** figure (vLLM without kvfabric) and the
  **local prefix-cache hit**: the ceiling a remote pool can approach, since
  the KV is already in vLLM's own blocks.

TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1`` (prefill plus
the first token); the table shows the best and the median over repeats, and
the ratios use the best (on a shared machine the least disturbed run). Each engine first serves a warm-up
prompt. Ratios printed: ``pool_hit / local_hit`` (target <= 1.5) and
``cold / pool_hit`` (target >= 4 at >= 1500 tokens). The JSON holds every
sample, the cached-token counts vLLM reported, and the connector's counters.

Unless ``--no-trace``, each hit is traced (``_Trace``: wrappers around the
connector's and vLLM's methods in the engine process, a few microseconds
per call): when the lookup ran and how long, when the load started, its
bytes, transport, duration and checksum time, when the load was reported,
how many engine steps came between and the forward that reads the blocks;
printed for the best hit of each length and kept per sample in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

CHUNK = 128   # default --chunk-tokens: the connector's default on vLLM's CPU backend (its block size)


_LOAD_MODES = {"async": {}, "sync": {"load_async": False},
               "layerwise": {"load_async": False, "load_layerwise": True}}


class TraceTargetMissing(RuntimeError):
    """A function the trace wraps is gone (renamed or moved by a refactor): the message names it."""


class _Trace:
    """Where a pool hit's time goes (on unless ``--no-trace``), measured by wrapping the connector's methods in
    this (single) engine process. Per timed request: the pool lookup, the load (bytes, transport,
    checksum time), the engine steps between the load's end and the forward that reads it, and
    that forward. Class-level wrappers, so nothing in the connector changes.

    Every target is looked up by :meth:`_patch`, which raises :class:`TraceTargetMissing` naming it when a
    refactor moved it (the engine process then fails at start with that line, never a trace that quietly
    measures nothing); ``tests/integration/test_bench_smoke.py`` checks the kvfabric targets without vLLM
    and ``tests/e2e/vllm/test_bench_smoke.py`` the whole trace."""

    #: (module, attribute) of kvfabric's own function the trace times: the client's checksum of an object
    #: received into a buffer (``kvfabric._reads``; on the native transport the C receive loop hashes
    #: instead and this is called only for the objects it could not).
    CHECKSUM = ("kvfabric._reads", "_object_checksum")

    def __init__(self) -> None:
        self.events: list[tuple[float, str, dict]] = []
        self.checksum_s = 0.0
        self._undo: list[tuple[object, str, object]] = []
        self._on_gc = None

    def reset(self) -> None:
        self.events, self.checksum_s = [], 0.0

    def _patch(self, owner: object, name: str, make) -> None:
        """Replace ``owner.name`` by ``make(original)``; :class:`TraceTargetMissing` if it is not there."""
        orig = getattr(owner, name, None)
        if not callable(orig):
            where = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
            raise TraceTargetMissing(
                f"vllm_ttft trace: {where}.{name} not found (renamed or moved?): update _Trace in "
                f"kvfabric/bench/vllm_ttft.py to its new place, or run with --no-trace")
        self._undo.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else orig))
        setattr(owner, name, make(orig))

    def remove(self) -> None:
        """Put every wrapped function back (the reverse order of :meth:`_patch`) and stop timing gc."""
        import gc

        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        while self._undo:
            owner, name, orig = self._undo.pop()
            if orig is None:
                delattr(owner, name)   # it was inherited: drop the override
            else:
                setattr(owner, name, orig)

    def install_client(self) -> None:
        """Time kvfabric's client-side checksums (``checksum_s``); needs no engine."""
        import importlib

        tr = self

        def timed(orig):
            def ck(*a):
                t0 = time.perf_counter()
                try:
                    return orig(*a)
                finally:
                    tr.checksum_s += time.perf_counter() - t0
            return ck

        module, name = self.CHECKSUM
        self._patch(importlib.import_module(module), name, timed)

    def install(self) -> None:
        from kvfabric_vllm import connector, scheduler, worker

        def wrap(cls, name, on_exit):
            def make(orig):
                def inner(self_, *a, **kw):
                    t0 = time.perf_counter()
                    out = orig(self_, *a, **kw)
                    on_exit(self_, t0, time.perf_counter(), a, out)
                    return out
                return inner
            self._patch(cls, name, make)

        def ev(name, **info):
            def rec(self_, t0, t1, a, out):
                self.events.append((t0, name, {"t1": t1, **{k: f(self_, a, out) for k, f in info.items()}}))
            return rec

        wrap(scheduler.SchedulerSide, "_lookup_all_parts", ev("lookup", run=lambda s, a, o: o))
        wrap(scheduler.SchedulerSide, "get_num_new_matched_tokens", ev("match", ext=lambda s, a, o: o[0]))
        wrap(worker.WorkerSide, "_load_one", ev(
            "load", chunks=lambda s, a, o: len(a[0].block_ids),
            bytes=lambda s, a, o: len(a[0].block_ids) * s.chunk_bytes,
            transport=lambda s, a, o: sorted(set(filter(None, s.client.transports.values()))) if s.client else []))
        wrap(worker.WorkerSide, "finished_loads", ev("reported", n=lambda s, a, o: len(o)))
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        wrap(Scheduler, "schedule", ev("step", tokens=lambda s, a, o: o.total_num_scheduled_tokens))
        wrap(GPUModelRunner, "execute_model", ev("exec", tokens=lambda s, a, o: a[0].total_num_scheduled_tokens))
        wrap(GPUModelRunner, "_model_forward", ev("model"))
        for hook in ("start_load_kv", "wait_for_save", "get_finished", "save_kv_layer", "wait_for_layer_load",
                     "get_block_ids_with_load_errors"):
            wrap(connector.KVFabricConnector, hook, ev("hook"))
        self.install_client()
        import gc

        gc_t0: list[float] = []

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                gc_t0[:] = [time.perf_counter()]
            elif gc_t0:
                self.events.append((gc_t0[0], "gc", {"t1": time.perf_counter(), "gen": info["generation"]}))
        self._on_gc = on_gc
        gc.callbacks.append(on_gc)

    def summary(self, t_start: float, t_end: float) -> dict:
        """Milliseconds from the request's submission: lookup, load, report, forward (see class doc)."""
        ms = lambda a, b: round(1e3 * (b - a), 2)  # noqa: E731
        ev = sorted(self.events, key=lambda e: e[0])
        out: dict = {"total_ms": ms(t_start, t_end), "checksum_ms": round(1e3 * self.checksum_s, 2),
                     "steps": sum(1 for e in ev if e[1] == "step"),
                     "forwards": sum(1 for e in ev if e[1] == "exec" and e[2]["tokens"])}
        out["events"] = [(name, ms(t_start, t0), ms(t0, info["t1"])) for t0, name, info in ev
                         if name not in ("hook", "model", "gc")]
        gcs = [e for e in ev if e[1] == "gc"]
        out["gc_ms"] = round(sum(1e3 * (e[2]["t1"] - e[0]) for e in gcs), 2)
        out["gc_gen2"] = sum(1 for e in gcs if e[2]["gen"] == 2)
        lk = [e for e in ev if e[1] == "lookup"]
        if lk:
            out["lookup_ms"] = ms(lk[0][0], lk[0][2]["t1"])
            out["lookup_start_ms"] = ms(t_start, lk[0][0])
        loads = [e for e in ev if e[1] == "load"]
        if loads:
            t0, _, info = loads[0]
            out.update(load_start_ms=ms(t_start, t0), load_ms=ms(t0, info["t1"]), load_bytes=info["bytes"],
                       load_chunks=info["chunks"], transport=info["transport"],
                       load_gbps=round(info["bytes"] / max(1e-9, info["t1"] - t0) / 1e9, 2))
            rep = [e for e in ev if e[1] == "reported" and e[2]["n"] and e[0] >= t0]
            # the forward that reads the loaded blocks: the first with tokens once the load ended
            # (sync loads run inside it: then the one around the load)
            fwd = [e for e in ev if e[1] == "exec" and e[2]["tokens"] and e[2]["t1"] >= info["t1"]]
            if rep:
                out["reported_ms"] = ms(t_start, rep[0][2]["t1"])
            if fwd:
                f0 = fwd[0]
                out["forward_start_ms"] = ms(t_start, f0[0])
                out["forward_ms"] = ms(f0[0], f0[2]["t1"])
                out["steps_after_load"] = sum(1 for e in ev if e[1] == "step" and info["t1"] <= e[0] <= f0[0])
                inside = [e for e in ev if f0[0] <= e[0] <= f0[2]["t1"]]
                out["model_ms"] = round(sum(1e3 * (e[2]["t1"] - e[0]) for e in inside if e[1] == "model"), 2)
                out["hooks_ms"] = round(sum(1e3 * (e[2]["t1"] - e[0]) for e in inside if e[1] == "hook"), 2)
        else:
            fwd = [e for e in ev if e[1] == "exec" and e[2]["tokens"]]
            if fwd:
                out["forward_start_ms"] = ms(t_start, fwd[0][0])
                out["forward_ms"] = ms(fwd[0][0], fwd[0][2]["t1"])
                inside = [e for e in ev if fwd[0][0] <= e[0] <= fwd[0][2]["t1"]]
                out["model_ms"] = round(sum(1e3 * (e[2]["t1"] - e[0]) for e in inside if e[1] == "model"), 2)
        return out


def _engine(model: str, servers: list[str] | None, max_len: int, chunk: int, load: str = "async",
            transport: str = "auto", options: str = "{}"):
    from vllm import LLM

    kw = {}
    if servers:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVFabricConnector",
            "kv_connector_module_path": "kvfabric_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"servers": servers, "chunk_tokens": chunk, "transport": transport,
                                          **_LOAD_MODES[load], **json.loads(options)},
        }
    return LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=not servers,
               kv_cache_memory_bytes=512 << 20, max_model_len=max_len, max_num_batched_tokens=max_len,
               seed=0, **kw)


def _child(args: argparse.Namespace) -> int:
    """One engine in this process: time cold then hit for every (length, repeat)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfabric_vllm.metrics import all_counters
    from kvfabric_vllm.tinymodel import random_prompt

    servers = args.servers.split(",") if args.servers else None
    lengths = [int(x) for x in args.lengths.split(",")]
    trace = _Trace() if args.trace else None
    if trace is not None:
        trace.install()
    llm = _engine(args.model, servers, max(lengths) + 16, args.chunk_tokens, args.load, args.transport,
                  args.connector_options)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(tokens: list[int]) -> tuple[float, int]:
        if trace is not None:
            trace.reset()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        t1 = time.perf_counter()
        timed.trace = trace.summary(t0, t1) if trace is not None else None
        return t1 - t0, out.num_cached_tokens or 0

    def saves_settled(timeout_s: float = 60.0) -> bool:
        """Wait until the connector has no put in flight (its jobs-done counter caught up)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            c = all_counters()
            if c["save_jobs_done"] >= c["save_jobs"]:
                return True
            time.sleep(0.005)
        return False

    def sample(n: int, r: int) -> dict:
        prompt = random_prompt(n, seed=1000 * n + r)
        cold_s, cold_cached = timed(prompt)
        if servers and not saves_settled():
            print(f"warning: saves of the {n}-token prompt did not settle", file=sys.stderr)
        hit_s, hit_cached = timed(prompt)
        return {"tokens": n, "repeat": r, "cold_s": cold_s, "cold_cached": cold_cached,
                "hit_s": hit_s, "hit_cached": hit_cached, "hit_trace": timed.trace}

    timed(random_prompt(300, seed=999))          # warm-up
    # Driven by the parent (``_Engine``): one "run N R" line per sample, answered with one
    # tagged JSON line on stdout (vLLM logs there too), until "quit".
    print(_TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        print(_TAG + json.dumps(sample(int(cmd[1]), int(cmd[2]))), flush=True)
    result = {"counters": all_counters() if servers else None}
    llm.llm_engine.engine_core.shutdown()
    Path(args.child_out).write_text(json.dumps(result))
    return 0


_TAG = "KVF-TTFT-SAMPLE "


class _Engine:
    """One engine process (``_child``), driven one sample at a time, so the pool and the local
    engine take turns on the same prompt seconds apart: on a shared machine whose load drifts
    over minutes, both then see the same conditions (run one after the other, a whole engine's
    run apart, the ratio measured the drift as much as the pool)."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.out = out
        self.err = out.with_suffix(".err")
        cmd = [sys.executable, "-m", "kvfabric.bench.vllm_ttft", *argv, "--child-out", str(out)]
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True)
        self._answer()                                   # "ready": built and warmed up

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG):])
        raise SystemExit(f"engine process failed ({self.proc.wait()}):\n{self.err.read_text()[-4000:]}")

    def sample(self, n: int, r: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {n} {r}\n")
        self.proc.stdin.flush()
        return self._answer()

    def finish(self, samples: list[dict]) -> dict:
        """Stop the engine; its samples and connector counters."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        for _ in self.proc.stdout or ():
            pass
        if self.proc.wait(timeout=300) != 0:
            raise SystemExit(f"engine process failed ({self.proc.returncode}):\n{self.err.read_text()[-4000:]}")
        return {"samples": samples, **json.loads(self.out.read_text())}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _data_path(args: argparse.Namespace) -> int:
    """``--data-path``: time each step of moving one prompt's KV, without an engine.

    The tiny Llama's KV pages (CPU backend: per layer ``[blocks, 2 heads, 128
    tokens, 128 channels]`` float32, 128 KiB a page, 4 layers) on
    ``--servers-n`` real servers. Per length, the loadable whole 128-token
    blocks are stored as (chunk, layer) objects, then (median of
    ``--repeats``, ms and us per chunk = 4 pages):

    * ``recv_staged`` + ``copy``: receive into a staging buffer, then one
      ``copy_`` per page into the blocks (before issue 13, and today's path for
      chunks of several blocks);
    * ``recv_in_place``: receive straight into the pages (the default now);
    * ``gather`` + ``put``: a save's copy out of the pages, then the put from
      the copy; ``put_in_place``: a put straight from the pages (what a save
      without the copy would cost; not used, see worker.py).
    """
    import torch

    from kvfabric import Client, ClientConfig
    from kvfabric.testing.servers import start_pool

    block, nl, page = 128, 4, (2, 128, 128)
    lengths = [int(x) for x in args.lengths.split(",")]
    nblocks = max(lengths) // block + 8
    layers = [torch.randn((nblocks, *page)) for _ in range(nl)]
    pages = [t.view(torch.uint8).numpy() for t in layers]
    obj = layers[0][0].numel() * 4
    rows = []
    with start_pool(args.servers_n, capacity=args.capacity) as pool, Client(
            pool.addresses, config=ClientConfig(timeout_s=60)) as c:
        c.register_buffers([t.view(torch.uint8).view(-1).numpy() for t in layers])
        for n_tok in lengths:
            n = (n_tok - 1) // block
            blocks = list(range(n))
            keys = [os.urandom(16) for _ in range(n * nl)]
            views = [pages[li][b] for b in blocks for li in range(nl)]
            t: dict[str, list[float]] = {k: [] for k in ("recv_staged", "copy", "recv_in_place", "gather", "put",
                                                         "put_in_place")}
            staging = torch.empty((n * nl, obj), dtype=torch.uint8)
            c.register_buffers([*(x.view(torch.uint8).view(-1).numpy() for x in layers), staging.numpy()])
            for r in range(args.repeats):
                c.delete(keys)
                t0 = time.perf_counter()
                data = torch.empty((n, nl, *page))
                for li in range(nl):
                    for i, b in enumerate(blocks):
                        data[i, li].copy_(layers[li][b])
                t1 = time.perf_counter()
                raw = data.view(n * nl, -1).view(torch.uint8)
                res = c.put(keys, [raw[j].numpy() for j in range(n * nl)])
                t2 = time.perf_counter()
                assert res.stored == n * nl, res
                c.delete(keys)
                t3 = time.perf_counter()
                c.put(keys, views)
                t4 = time.perf_counter()
                t["gather"].append(t1 - t0)
                t["put"].append(t2 - t1)
                t["put_in_place"].append(t4 - t3)
                t0 = time.perf_counter()
                sizes = c.get_into(keys, [staging[j].numpy() for j in range(n * nl)])
                t1 = time.perf_counter()
                src = staging.view(torch.float32).view(n, nl, *page)
                for i, b in enumerate(blocks):
                    for li in range(nl):
                        layers[li][b].copy_(src[i, li])
                t2 = time.perf_counter()
                sizes2 = c.get_into(keys, views)
                t3 = time.perf_counter()
                assert sizes == sizes2 == [obj] * (n * nl), "a load missed"
                t["recv_staged"].append(t1 - t0)
                t["copy"].append(t2 - t1)
                t["recv_in_place"].append(t3 - t2)
            row = {"tokens": n_tok, "chunks": n, "bytes": n * nl * obj,
                   "transport": sorted(set(filter(None, c.transports.values())))}
            row.update({f"{k}_ms": 1e3 * _median(v) for k, v in t.items()})
            rows.append(row)
    print(f"KV data path, ms for one prompt's loadable blocks (us per 128-token chunk = {nl} pages of "
          f"{obj >> 10} KiB), median of {args.repeats}; {args.servers_n} servers; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    cols = ("recv_staged", "copy", "recv_in_place", "gather", "put", "put_in_place")
    print(f"{'tokens':>7} {'chunks':>6} " + " ".join(f"{k:>18}" for k in cols))
    for row in rows:
        print(f"{row['tokens']:>7} {row['chunks']:>6} " + " ".join(
            f"{row[k + '_ms']:>8.2f} ({1e3 * row[k + '_ms'] / row['chunks']:>5.0f})" for k in cols))
    print(f"transports: {rows[0]['transport'] if rows else '-'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def _print_traces(lengths: list[int], pooled: dict, local: dict) -> None:
    """The best pool hit's and the best local hit's time line per length (ms)."""
    print("\ntrace of the best hit per length, ms from submission (lookup: its duration; load: when it "
          "started, its duration; rep: the load reported done; fwd: the forward that reads the blocks "
          "started, its duration; +steps: engine steps between the load's end and that forward)")
    for n in lengths:
        for name, eng in (("pool", pooled), ("local", local)):
            best = min((s for s in eng["samples"] if s["tokens"] == n), key=lambda s: s["hit_s"])
            t = best.get("hit_trace") or {}
            if "load_ms" in t:
                load = (f"lookup {t.get('lookup_ms', '-')} load @{t['load_start_ms']} {t['load_ms']} "
                        f"({t['load_bytes'] >> 20} MiB, {t['load_gbps']} GB/s, {','.join(t['transport'])}, "
                        f"checksums {t['checksum_ms']}) rep @{t.get('reported_ms', '-')} ")
            else:
                load = ""
            print(f"{n:>7} {name:>5} total {t.get('total_ms', '-')}: {load}fwd @{t.get('forward_start_ms', '-')} "
                  f"{t.get('forward_ms', '-')} (model {t.get('model_ms', '-')}, hooks {t.get('hooks_ms', '-')}) "
                  f"+steps {t.get('steps_after_load', '-')} (steps {t.get('steps')}, forwards {t.get('forwards')}, "
                  f"gc {t.get('gc_ms', '-')})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_ttft", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1500,3000,6000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--servers-n", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=CHUNK,
                    help="connector chunk (multiple of 128; default: the connector's, vLLM's block)")
    ap.add_argument("--load", choices=["async", "sync", "layerwise"], default="async",
                    help="connector load mode: load_async (default), sync, or sync layer by layer")
    ap.add_argument("--server-transports", default="tcp,native,shm",
                    help="what the pool servers offer (default: with shm, as for engines on the pool's host)")
    ap.add_argument("--transport", default="auto", help="the connector's client transport (default auto)")
    ap.add_argument("--connector-options", default="{}",
                    help='more kv_connector_extra_config keys, JSON (e.g. \'{"register_load_buffer": false}\')')
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="do not record where each hit's time goes (lookup, load, transport, steps, forward)")
    ap.add_argument("--data-path", action="store_true",
                    help="no engine: time receive/copy/gather/put per chunk on real servers")
    ap.add_argument("--capacity", default="512MiB", help="per pool server")
    ap.add_argument("--model", default=None, help="model dir (default: build the tiny Llama)")
    ap.add_argument("--out", default="bench-results/vllm_ttft.json")
    # internal: one engine process
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--servers", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_out:
        return _child(args)
    if args.data_path:
        if args.out == ap.get_default("out"):
            args.out = "bench-results/vllm_kv_data_path.json"
        return _data_path(args)

    from kvfabric.testing.servers import start_pool
    from kvfabric_vllm.tinymodel import build_tiny_llama

    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) <= args.chunk_tokens or args.repeats < 1 or args.servers_n < 1:
        raise SystemExit("lengths must exceed --chunk-tokens; repeats and servers-n must be >= 1")
    with tempfile.TemporaryDirectory(prefix="kvf-ttft-") as tmp:
        model = args.model or str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        common = ["--model", model, "--lengths", args.lengths, "--repeats", str(args.repeats),
                  "--connector-options", args.connector_options,
                  "--chunk-tokens", str(args.chunk_tokens), "--load", args.load]
        if not args.trace:
            common.append("--no-trace")
        with start_pool(args.servers_n, capacity=args.capacity,
                        extra_args=["--transports", args.server_transports]) as pool:
            engines: list[_Engine] = []
            try:
                engines.append(_Engine(common + ["--servers", ",".join(pool.addresses), "--transport",
                                                 args.transport], Path(tmp) / "pool.json"))
                engines.append(_Engine(common, Path(tmp) / "local.json"))
                got: list[list[dict]] = [[], []]
                for n in lengths:
                    for r in range(args.repeats):
                        for e, out in zip(engines, got):      # the same prompt, pool then local
                            out.append(e.sample(n, r))
                pooled, local = (e.finish(out) for e, out in zip(engines, got))
            finally:
                for e in engines:
                    e.kill()

    rows = []
    used = sorted({t for s in pooled["samples"] for t in (s.get("hit_trace") or {}).get("transport", [])})
    print(f"vLLM TTFT in ms, best (median) of {args.repeats}; tiny Llama fp32 on CPU, {args.servers_n} pool "
          f"servers offering {args.server_transports}, connector transport {args.transport} "
          f"(used: {','.join(used) or 'not traced'}), chunk {args.chunk_tokens} tokens, {args.load} loads; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    hdr = (f"{'tokens':>7} {'cold':>15} {'cold+kvf':>15} {'pool hit':>15} {'local hit':>15} "
           f"{'pool/local':>11} {'cold/pool':>10} {'loaded':>7}")
    print(hdr)
    print("-" * len(hdr))
    for n in lengths:
        ps = [s for s in pooled["samples"] if s["tokens"] == n]
        ls = [s for s in local["samples"] if s["tokens"] == n]
        row = {"tokens": n}
        for name, samples, key in (("cold", ls, "cold_s"), ("cold_with_connector", ps, "cold_s"),
                                   ("pool_hit", ps, "hit_s"), ("local_hit", ls, "hit_s")):
            xs = [1e3 * s[key] for s in samples]
            row[f"{name}_ms_min"] = min(xs)
            row[f"{name}_ms_median"] = _median(xs)
        row["pool_hit_cached_tokens"] = min(s["hit_cached"] for s in ps)
        row["local_hit_cached_tokens"] = min(s["hit_cached"] for s in ls)
        # ratios of the best runs: on a shared machine the minimum is the
        # least disturbed measurement of each path
        row["pool_over_local"] = row["pool_hit_ms_min"] / row["local_hit_ms_min"]
        row["cold_over_pool"] = row["cold_ms_min"] / row["pool_hit_ms_min"]
        rows.append(row)

        def cell(name: str) -> str:
            return f"{row[name + '_ms_min']:.0f} ({row[name + '_ms_median']:.0f})"

        print(f"{n:>7} {cell('cold'):>15} {cell('cold_with_connector'):>15} {cell('pool_hit'):>15} "
              f"{cell('local_hit'):>15} {row['pool_over_local']:>10.2f}x {row['cold_over_pool']:>9.2f}x "
              f"{row['pool_hit_cached_tokens']:>7}")
    print("cold: no connector; cold+kvf: connector on, pool empty for the prompt (includes gathering its saves); "
          "pool hit: prefix cache off, whole chunks loaded from the pool; local hit: vLLM's own prefix cache; "
          "ratios from the best runs; loaded: tokens vLLM reported cached on the pool hit")
    if args.trace:
        _print_traces(lengths, pooled, local)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "pool_engine": pooled, "local_engine": local},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
