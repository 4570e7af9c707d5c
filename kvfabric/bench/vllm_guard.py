"""The load guard's figure (issue 26 part 3): TTFT of pool hits from a throttled pool, guard on vs off vs
recompute-only, on real vLLM.

Runs in the vLLM virtualenv::

    .venvs/vllm/bin/python benchmarks/vllm_guard.py --pool ssd [--ssd-read-mbps 0,16] [--length 1500]
        [--repeats 5] [--warm 4] [--model DIR] [--out bench-results/vllm_guard.json]
    .venvs/vllm/bin/python benchmarks/vllm_guard.py [--pool proxy] [--delays 0,1.0] ...

One ``kvfabric serve`` on this host, made slow one of two ways:

* ``--pool ssd`` (the issue's figure): the server has a small DRAM (``--dram-mib``, 32) and an SSD
  tier (``--ssd-dir``, a directory on a real disk), and its process is put in a block-I/O cgroup
  that throttles its reads of that disk to each of ``--ssd-read-mbps`` in turn
  (:class:`kvfabric.testing.throttle.ReadThrottle`; 0 = not throttled): the same ``O_DIRECT``
  io_uring reads, from a disk that delivers a few MB/s. Before every hit of the saved prompt the
  engine waits out its lookup lease (1 s here instead of the default 30 s: a lease pins what a
  lookup found in DRAM), pushes ``--evict-mib`` (by default DRAM + 8 MiB) of other objects through
  the server and waits for the write-behind, so the saved prompt's objects are on the SSD tier only and each
  hit reads them from the disk (checked: the server's ``ssd_reads`` per mode are printed). Needs
  root and a blkio/io controller (it says so and stops otherwise).
* ``--pool proxy``: the engines reach the server through
  :class:`kvfabric.testing.proxy.SlowReplyProxy`, which holds each GET reply ``delay`` seconds
  (lookups and puts pass at once): a congested link, made by a real delay on the wire.

One prompt of ``--length`` tokens is saved first (an engine straight on the server). Then per
condition, per mode, a fresh engine (its own process, the tiny random Llama unless ``--model``,
float32, eager, vLLM's prefix cache off, the connector over ``native``):

* **recompute**: the connector with ``load: false``: every token computed;
* **guard off**: ``load_guard: false``: every hit loaded, as before issue 26;
* **guard on**: the default, ``load_guard_min_tokens`` = ``--length`` so ``--warm`` fresh prompts
  give the prefill rate its window.

Each engine first computes ``--warm`` fresh prompts of the same length (the prefill rate; two
output tokens each, so the guard counts their prefill steps) and
serves the saved prompt twice (its loads give the load rate its window; the guard loads them, it
has no load rate yet), then serves the saved prompt ``--repeats`` times, timed: TTFT is the wall
time of ``LLM.generate`` with ``max_tokens=1``. Printed: best and median per mode, guard on /
recompute (target: within 10%) and guard off / recompute, and what the guard did
(``loads_skipped_slower``). The machine's load average is printed beside it: no figure here is a
quiet-machine figure unless it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

MODES = {"recompute": {"load": False}, "guard_off": {"load_guard": False}, "guard_on": {}}
_SAVED_SEED, _WARM_SEED = 7000, 8000


#: --pool ssd: the connector's lookup lease (ms); the filler waits it out, or the prompt a lookup
#: found stays pinned in DRAM (the default lease, 30 s, would keep every hit after the first there)
_SSD_LEASE_MS = 1000


def _evictor(server: str, mib: int):
    """A function that waits out the connector's lookup lease, pushes ``mib`` MiB of fresh 1 MiB
    objects through ``server`` and waits until its write-behind queue is empty: what was in DRAM
    before is then on the SSD tier only."""
    import numpy as np

    from kvfabric import Client, ClientConfig
    from kvfabric.testing import wait_for

    client = Client([server], config=ClientConfig(transport="native", timeout_s=60))
    filler = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)

    def evict() -> None:
        time.sleep(_SSD_LEASE_MS / 1000 + 0.2)
        for _ in range(mib):
            if client.put([os.urandom(16)], [filler]).dropped:
                raise RuntimeError("the eviction filler was dropped")
        st = lambda: next(iter(client.stats()["servers"].values()))  # noqa: E731
        if not wait_for(lambda: st().get("ssd_queue_bytes", 0) == 0, timeout_s=120):
            raise RuntimeError(f"the write-behind did not drain: {st()}")
    return evict


def _child(args: argparse.Namespace) -> int:
    """One engine in this process: warm-up, then the timed hits; one JSON line on stdout."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfabric.bench.vllm_ttft import _engine
    from kvfabric_vllm.metrics import all_counters
    from kvfabric_vllm.tinymodel import random_prompt

    llm = _engine(args.model, args.servers.split(","), args.length + 16, 128, "async", "native", args.options)
    evict = _evictor(args.servers.split(",")[0], args.evict_mib) if args.evict_mib else (lambda: None)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    # warm-up prompts decode one more token: a step that finished all its requests may be followed by
    # idle time, so the guard does not count it (guard.py); a served engine's other requests do that
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def timed(tokens: list[int], p=params) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], p, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens or 0

    saved = random_prompt(args.length, seed=_SAVED_SEED)
    samples = []
    if args.repeats:
        for i in range(args.warm):
            timed(random_prompt(args.length, seed=args.warm_seed + i), warm)
        for _ in range(2):
            evict()
            timed(saved)
        for _ in range(args.repeats):
            evict()                        # (--pool ssd) the saved prompt on the SSD tier only
            samples.append(timed(saved))
    else:
        timed(saved)                       # the prep engine: compute and save it
    counters = all_counters()
    llm.llm_engine.engine_core.shutdown()  # flushes the connector's saves
    print("KVF-GUARD " + json.dumps({"ttft_s": [s for s, _ in samples], "cached": [c for _, c in samples],
                                     "counters": counters}), flush=True)
    return 0


def _run_child(args: argparse.Namespace, servers: str, options: dict, repeats: int, warm_seed: int = 0) -> dict:
    cmd = [sys.executable, "-m", "kvfabric.bench.vllm_guard", "--child", "--model", args.model, "--servers", servers,
           "--length", str(args.length), "--warm", str(args.warm), "--repeats", str(repeats),
           "--options", json.dumps(options), "--warm-seed", str(warm_seed),
           "--evict-mib", str(args.evict_mib if args.pool == "ssd" else 0)]
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800)
        if p.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"engine failed ({p.returncode}):\n{err.read()[-4000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("KVF-GUARD "))
    out = json.loads(line[len("KVF-GUARD "):])
    # the guard's own lines (vLLM logs to stdout): its first cut and the rates it measured
    out["guard_log"] = [ln for ln in p.stdout.splitlines() if "kvfabric load guard" in ln or "predicted slower" in ln]
    return out


def _ssd_reads(address: str) -> int:
    from kvfabric import Client

    with Client([address]) as c:
        return next(iter(c.stats()["servers"].values())).get("ssd_reads", 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool", choices=("ssd", "proxy"), default="proxy",
                    help="how the pool is made slow: its SSD tier's disk reads throttled, or a proxy delaying GETs")
    ap.add_argument("--ssd-read-mbps", default="0,16", help="--pool ssd: the disk's read limits, MB/s (0: none)")
    ap.add_argument("--ssd-dir", default="/var/tmp", help="--pool ssd: where the SSD tier goes (a real disk)")
    ap.add_argument("--dram-mib", type=int, default=32, help="--pool ssd: the server's DRAM")
    ap.add_argument("--evict-mib", type=int, default=None, help="--pool ssd: filler before each hit (DRAM + 8)")
    ap.add_argument("--delays", default="0,1.0", help="--pool proxy: seconds each GET reply is held, comma list")
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm", type=int, default=4, help="fresh prompts computed before the timed hits")
    ap.add_argument("--model", default=None, help="model dir (default: build the tiny Llama)")
    ap.add_argument("--out", default="bench-results/vllm_guard.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--servers", default="", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--warm-seed", type=int, default=_WARM_SEED, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)

    from kvfabric.testing.proxy import SlowReplyProxy
    from kvfabric.testing.servers import start_server
    from kvfabric.testing.throttle import ReadThrottle, unavailable

    tmp = tempfile.TemporaryDirectory(prefix="kvf-guard-")
    ssd = args.pool == "ssd"
    if ssd:
        why = unavailable(args.ssd_dir)
        if why is not None:
            raise SystemExit(f"vllm_guard --pool ssd: cannot throttle {args.ssd_dir}'s disk: {why}")
        if args.evict_mib is None:
            args.evict_mib = args.dram_mib + 8
    if args.model is None:
        from kvfabric_vllm.tinymodel import build_tiny_llama

        args.model = str(build_tiny_llama(Path(tmp.name) / "tiny-llama"))
    if ssd:
        unit, conditions = "MB/s", [float(x) for x in args.ssd_read_mbps.split(",")]
        ssd_dir = tempfile.mkdtemp(prefix="kvf-guard-ssd-", dir=args.ssd_dir)
        server_args = ["--transports", "tcp,native", "--ssd-path", ssd_dir, "--ssd-capacity", "8GiB"]
        capacity = f"{args.dram_mib}MiB"
    else:
        unit, conditions = "s", [float(x) for x in args.delays.split(",")]
        server_args, capacity = ["--transports", "tcp,native"], "512MiB"
    result: dict = {"pool": args.pool, "length": args.length, "repeats": args.repeats, "warm": args.warm,
                    "dram_mib": args.dram_mib if ssd else None, "runs": {}, "loadavg_start": os.getloadavg()}
    try:
        with start_server(capacity=capacity, extra_args=server_args) as server:
            _run_child(args, server.address, {}, 0)          # the saved prompt, straight on the server
            for d, cond in enumerate(conditions):
                if ssd:
                    throttle = ReadThrottle(ssd_dir, int(cond * 1e6)) if cond else None
                    if throttle is not None:
                        throttle.add(server.pid)
                    address, close = server.address, (throttle.close if throttle else (lambda: None))
                else:
                    proxy = SlowReplyProxy(server.address, delay_s=cond)
                    address, close = proxy.address, proxy.close
                try:
                    for m, (mode, opts) in enumerate(MODES.items()):
                        opts = {**opts, **({"load_guard_min_tokens": args.length} if mode == "guard_on" else {}),
                                **({"lease_ms": _SSD_LEASE_MS} if ssd else {})}
                        reads0 = _ssd_reads(server.address) if ssd else 0
                        # fresh warm-up prompts per engine: an earlier engine saved its own, which would be hits
                        r = _run_child(args, address, opts, args.repeats, _WARM_SEED + 100 * (d * len(MODES) + m))
                        r["ssd_reads"] = _ssd_reads(server.address) - reads0 if ssd else None
                        result["runs"][f"{cond}/{mode}"] = r
                        c = r["counters"]
                        print(f"{cond:g} {unit} {mode:9s}: TTFT best {min(r['ttft_s']) * 1e3:7.1f} ms, median "
                              f"{statistics.median(r['ttft_s']) * 1e3:7.1f} ms; cached {r['cached']}; "
                              f"loads_skipped_slower {c['loads_skipped_slower']} of loads_guarded "
                              f"{c['loads_guarded']}" + (f"; ssd_reads {r['ssd_reads']}" if ssd else "")
                              + f"; load {os.getloadavg()[0]:.1f}", flush=True)
                        for ln in r["guard_log"]:
                            print("    " + ln[ln.index("kvfabric"):], flush=True)
                finally:
                    close()
                rec = statistics.median(result["runs"][f"{cond}/recompute"]["ttft_s"])
                for mode in ("guard_on", "guard_off"):
                    med = statistics.median(result["runs"][f"{cond}/{mode}"]["ttft_s"])
                    result.setdefault("ratios", {})[f"{cond}/{mode}"] = med / rec
                    print(f"{cond:g} {unit}: {mode} / recompute (medians) = {med / rec:.2f}x")
    finally:
        if ssd:
            shutil.rmtree(ssd_dir, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"load average {result['loadavg_start']} -> {result['loadavg_end']}; wrote {args.out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
