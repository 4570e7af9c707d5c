"""The load guard's figure (issue 26 part 3): TTFT of pool hits from a throttled pool, guard on vs off vs
recompute-only, on real vLLM.

Runs in the vLLM virtualenv::

    .venvs/vllm/bin/python benchmarks/vllm_guard.py [--delays 0,1.0] [--length 1500] [--repeats 5]
        [--warm 4] [--model DIR] [--out bench-results/vllm_guard.json]

One ``kvfabric serve`` on this host; the engines reach it through
:class:`kvfabric.testing.proxy.SlowReplyProxy`, which holds each GET reply ``delay`` seconds
(lookups and puts pass at once): a pool whose bytes come slowly (a throttled SSD tier, a
congested link), made by a real delay on the wire. One prompt of ``--length`` tokens is saved
first (an engine straight on the server). Then per delay, per mode, a fresh engine (its own
process, the tiny random Llama unless ``--model``, float32, eager, vLLM's prefix cache off, the
connector over ``native`` through the proxy):

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

MODES = {"recompute": {"load": False}, "guard_off": {"load_guard": False}, "guard_on": {}}
_SAVED_SEED, _WARM_SEED = 7000, 8000


def _child(args: argparse.Namespace) -> int:
    """One engine in this process: warm-up, then the timed hits; one JSON line on stdout."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfabric.bench.vllm_ttft import _engine
    from kvfabric_vllm.metrics import all_counters
    from kvfabric_vllm.tinymodel import random_prompt

    llm = _engine(args.model, args.servers.split(","), args.length + 16, 128, "async", "native", args.options)
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
            timed(saved)
        samples = [timed(saved) for _ in range(args.repeats)]
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
           "--options", json.dumps(options), "--warm-seed", str(warm_seed)]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delays", default="0,1.0", help="seconds each GET reply is held, comma list")
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

    tmp = tempfile.TemporaryDirectory(prefix="kvf-guard-")
    if args.model is None:
        from kvfabric_vllm.tinymodel import build_tiny_llama

        args.model = str(build_tiny_llama(Path(tmp.name) / "tiny-llama"))
    delays = [float(x) for x in args.delays.split(",")]
    result: dict = {"length": args.length, "repeats": args.repeats, "warm": args.warm, "runs": {},
                    "loadavg_start": os.getloadavg()}
    with start_server(capacity="512MiB", extra_args=["--transports", "tcp,native"]) as server:
        _run_child(args, server.address, {}, 0)          # the saved prompt, straight on the server
        for d, delay in enumerate(delays):
            proxy = SlowReplyProxy(server.address, delay_s=delay)
            try:
                for m, (mode, opts) in enumerate(MODES.items()):
                    opts = {**opts, **({"load_guard_min_tokens": args.length} if mode == "guard_on" else {})}
                    # fresh warm-up prompts per engine: an earlier engine saved its own, which would be hits
                    r = _run_child(args, proxy.address, opts, args.repeats, _WARM_SEED + 100 * (d * len(MODES) + m))
                    result["runs"][f"{delay}/{mode}"] = r
                    c = r["counters"]
                    print(f"delay {delay:g} s {mode:9s}: TTFT best {min(r['ttft_s']) * 1e3:7.1f} ms, median "
                          f"{statistics.median(r['ttft_s']) * 1e3:7.1f} ms; cached {r['cached']}; "
                          f"loads_skipped_slower {c['loads_skipped_slower']} of loads_guarded {c['loads_guarded']}; "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
                    for ln in r["guard_log"]:
                        print("    " + ln[ln.index("kvfabric"):], flush=True)
            finally:
                proxy.close()
            rec = statistics.median(result["runs"][f"{delay}/recompute"]["ttft_s"])
            for mode in ("guard_on", "guard_off"):
                med = statistics.median(result["runs"][f"{delay}/{mode}"]["ttft_s"])
                print(f"delay {delay:g} s: {mode} / recompute (medians) = {med / rec:.2f}x")
    result["loadavg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"load average {result['loadavg_start']} -> {result['loadavg_end']}; wrote {args.out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
