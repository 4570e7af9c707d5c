"""``kvfabric bench serve``: end-to-end serving on real vLLM instances: with kvfabric, alone, with peer L2s.

One command starts everything it measures (engines and pools; all stopped
on exit) and replays a Mooncake trace against each configuration in turn::

    kvfabric bench serve --engine-python .venvs/vllm/bin/python [--trace mooncake-conversation]
        [--sessions 12] [--loads 1,4]
        [--configs vllm,vllm-offload,lmcache,mooncake,kvfabric,kvfabric-ssd,route-rr,route,vllm-route]
        [--instances 2] [--kv-mib 128] [--dram-mib 256] [--ssd-mib 1024] [--out bench-results/serve.json]
    kvfabric bench serve --workload rl --engine-python .venvs/vllm/bin/python [--rl-prompts 4 --rl-group 4
        --rl-turns 4 --rl-update-every 2 --rl-env-delay-ms 1000] [--configs vllm,kvfabric,kvfabric-retire]

The parts (each a module beside this one):

* workload (``_serve_workload``): whole sessions drawn from the trace, each
  trace block of 512 tokens scaled to ``--block-tokens`` engine tokens
  (the scale is printed and in the JSON), token ids synthesized from the
  block ids so equal ids give equal tokens, outputs of the trace's length
  times ``--output-scale`` (default: the same scale) with ``ignore_eos``;
* deployments (``_serve_engines``): ``--instances`` vLLM OpenAI servers
  (separate processes, the interpreter ``--engine-python``, default this
  one) over what the configuration puts beneath them, at the same memory:
  ``--kv-mib`` of vLLM KV cache per instance for all, ``--dram-mib`` in all
  for the L2 of (b)-(e) (for (c'), Mooncake Store, its one holder's segment), ``--ssd-mib``
  more on SSD for (e);
* load (``_serve_load``): streamed completions, round-robin over the
  instances (or all to ``kvfabric route`` in front of them: (f) with its
  round-robin policy, (g) KV-aware; the same deployment as (d) plus each
  engine's KV events; (h) KV-aware in front of (a), no pool; docs/route.md),
  closed-loop sessions (``--loads`` = sessions in flight) or an
  open loop at the trace's arrival times (``--mode open``, ``--loads`` =
  speed-ups); every load level uses fresh token ids (all caches cold);
* report (``_serve_report``): requests/s, output tokens/s, TTFT and
  end-to-end p50/p99, the TTFT of later turns, hit rates as vLLM reports
  them (its prefix cache; prompt tokens computed, hit locally, loaded by the
  connector) and as the pool's STATS do; best throughput at ``--slo-ttft-ms``.

**Calibration** r = (prefill time per token) / (time to move one token's KV
over the pool's transport): the prefill slope of the first configuration's
engine between two cold prompts, over ``Client.get_into`` of the model's
chunk objects from fresh pool servers offering ``--server-transports``;
also r over the connector's own load time per token, from vLLM's metrics
of the kvfabric run. The model shape (``--layers --kv-heads --head-dim``)
sets the KV bytes per token and with them r; ``--calibrate-only`` measures r
and stops.

**RL rollouts** (``--workload rl``; ``_serve_rl``): groups of ``--rl-group``
samples of ``--rl-prompts`` prompts, ``--rl-turns`` agent turns each (one turn
of every session per step, an environment delay between steps), every turn on
another generator than the previous, a weight update in memory on every
generator every ``--rl-update-every`` steps (over the servers' HTTP dev
endpoints: ``reload_weights`` + ``refresh_weights_version``, a worker
extension), on ``vllm``, ``kvfabric``, ``kvfabric-retire`` (``weights_retire``)
and the control ``kvfabric-unversioned``; reports rollout tokens/s, TTFT,
hits, the connector's weight counters per generator and stale hits (must be 0
but in the control). No calibration in this mode.

A configuration that cannot run here (its server exits before it answers)
is reported as not runnable with the engine's own error, never replaced.
Prints a table, writes JSON (``--out``) and a PNG (``--plot``). Exit
status 2 on bad arguments, 1 when no configuration ran.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..testing.poll import wait_for
from . import proc_cpu_s, write_json
from ._serve_engines import (CHUNK_TOKENS, CONFIGS, LABELS, OFFLOAD_VARIANTS, RL_CONFIGS, NotRunnable, Options, Shape,
                             build_model, engine_cpu_sets, lmcache_installation, machine_busy_s, route_stats, start)
from ._serve_load import Result, complete, run
from ._serve_report import (delta, plot, pool_counters, print_reuse_bound, print_table, reuse_bound, summarize,
                             vllm_counters)
from ._serve_workload import Workload, build_workload
from .mooncake_store import GAUGES as MOONCAKE_GAUGES
from .mooncake_store import binaries_beside as mooncake_binaries
from .mooncake_store import metrics as mooncake_metrics
from .traces import TraceError, load_trace

CALIB_LENGTHS = (256, 1024)
CALIB_CHUNKS = 16


def _mib(x: float) -> int:
    return int(x * (1 << 20))


def calibrate_transport(shape: Shape, servers_n: int, transports: str, chunk_tokens: int,
                        repeats: int = 5) -> dict[str, Any]:
    """Seconds per token to GET a token's KV from fresh pool servers (median of ``repeats``): the model's
    chunk objects (one per chunk and layer, as the connector stores them), received into buffers."""
    import numpy as np

    from kvfabric import Client
    from kvfabric.testing.servers import start_pool

    from .traces import block_keys

    obj = chunk_tokens * shape.kv_bytes_per_token // shape.layers
    n = CALIB_CHUNKS * shape.layers
    keys = block_keys(range(n), salt=7)
    bufs = [np.full(obj, i % 251, np.uint8) for i in range(n)]
    with start_pool(servers_n, capacity=2 * n * obj // servers_n + (64 << 20),
                    extra_args=["--transports", transports]) as pool, Client(pool.addresses) as c:
        res = c.put(keys, bufs)
        if res.stored != n:
            raise RuntimeError(f"calibration: {res.stored} of {n} objects stored")
        out = [np.empty(obj, np.uint8) for _ in range(n)]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sizes = c.get_into(keys, out)
            times.append(time.perf_counter() - t0)
            if sizes != [obj] * n:
                raise RuntimeError("calibration: a GET missed")
        used = sorted(set(filter(None, c.transports.values())))
    tokens = CALIB_CHUNKS * chunk_tokens
    best = statistics.median(times)
    return {"transfer_s_per_token": best / tokens, "transfer_gbps": n * obj / best / 1e9, "transport": used,
            "object_bytes": obj, "objects": n}


def calib_lengths(max_model_len: int) -> tuple[int, int]:
    """The two prompt lengths of :func:`calibrate_prefill`: :data:`CALIB_LENGTHS`, or shorter ones (same ratio)
    that leave room for the output in ``max_model_len``."""
    hi = min(CALIB_LENGTHS[1], max_model_len // 2)
    return max(1, hi * CALIB_LENGTHS[0] // CALIB_LENGTHS[1]), hi


def calibrate_prefill(url: str, vocab: int, lengths: tuple[int, int], repeats: int = 3) -> dict[str, Any]:
    """Prefill seconds per token on one engine: the TTFT slope between two cold prompts (fresh random ids)
    of ``lengths`` tokens (best of ``repeats`` each)."""
    import random

    rng = random.Random(12345)
    ttft: dict[int, float] = {}
    for n in lengths:
        best = None
        for _ in range(repeats):
            prompt = [rng.randrange(8, vocab - 8) for _ in range(n)]
            t, _, _ = complete(url, prompt, 1)
            best = t if best is None else min(best, t)
        ttft[n] = best
    lo, hi = lengths
    slope = (ttft[hi] - ttft[lo]) / (hi - lo)
    return {"prefill_s_per_token": slope, "ttft_s": ttft, "prefill_s_per_token_at_max": ttft[hi] / hi,
            "lengths": list(lengths)}


def settled_vllm_counters(urls: list[str], before: dict[str, float], generated: int,
                          timeout_s: float = 60.0) -> dict[str, float]:
    """The run's vLLM counters (``after - before``) once vLLM has recorded them: its metrics are updated
    after each engine step, so read until they count every generated token and two reads agree (up to
    ``timeout_s``; then the last read, which the report shows as it is)."""
    last: list[dict[str, float]] = [{}]

    def settled() -> bool:
        now = delta(before, vllm_counters(urls))
        same = now == last[0]
        last[0] = now
        return same and now["generation_tokens"] >= generated

    wait_for(settled, timeout_s=timeout_s, interval_s=0.2)
    return last[0]


def _bar(total: int, desc: str, on: bool):
    if not on:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5)


def run_config(config: str, opt: Options, workload: Workload, loads: list[float], mode: str, vocab: int,
               reuse: set[int], progress: bool, calib: dict[str, Any]) -> dict[str, Any]:
    """Start ``config``, run every load level on it, stop it; its report entry."""
    entry: dict[str, Any] = {"config": config, "label": LABELS[config], "runs": []}
    t0 = time.monotonic()
    failures: list[str] = []
    dep = None
    for env in (OFFLOAD_VARIANTS if config == "vllm-offload" else ({},)):
        try:
            dep = start(config, opt, env)
            break
        except NotRunnable as e:
            failures.append((f"with {env}: " if env else "") + str(e))
            print(f"{config}: NOT RUNNABLE here{f' (with {env})' if env else ''}: "
                  f"{str(e).strip().splitlines()[0]}", file=sys.stderr)
    if failures:
        entry["attempts"] = failures
    if dep is None:
        entry["not_runnable"] = "\n".join(f.strip().splitlines()[0] for f in failures)
        return entry
    entry["start_s"] = time.monotonic() - t0
    entry["settings"] = dep.settings
    try:
        for url in dep.urls:                       # warm-up: each instance's first request
            complete(url, list(range(8, 8 + 2 * workload.block_tokens)), 2)
        if "prefill_s_per_token" not in calib:
            calib.update(calibrate_prefill(dep.urls[0], vocab, calib_lengths(opt.max_model_len)))
            calib["prefill_config"] = config
        for li, load in enumerate(loads):
            v0 = vllm_counters(dep.urls)
            p0 = pool_counters(dep.pool.addresses) if dep.pool else None
            mc = dep.settings.get("mooncake", {}).get("master_admin")
            mc0 = mooncake_metrics(mc) if mc else None
            c0, m0, b0 = dep.cpu_s(), machine_busy_s(), proc_cpu_s(os.getpid())
            bar = _bar(len(workload.requests), f"{config} load {load:g}", progress)

            def done(r: Result, bar=bar) -> None:
                if bar is not None:
                    bar.update(1)
            results, wall = run(workload, dep.entry, concurrency=int(load) if mode == "closed" else None,
                                speedup=load, epoch=li + 1, vocab=vocab, on_done=done)
            if bar is not None:
                bar.close()
            dead = dep.dead()
            if dead:
                raise RuntimeError(f"{config}: an engine died during the run:\n" + "\n".join(dead))
            v = settled_vllm_counters(dep.urls, v0, sum(r.output_tokens for r in results if not r.error))
            p = delta(p0, pool_counters(dep.pool.addresses)) if dep.pool else None
            c1, m1, b1 = dep.cpu_s(), machine_busy_s(), proc_cpu_s(os.getpid())
            row = summarize(results, wall, reuse, v, p)
            if mc0 is not None:     # the peer store's own figures over the level (keys, bytes: as they end)
                mc1 = mooncake_metrics(mc)
                row["mooncake"] = {k: (x if k in MOONCAKE_GAUGES else x - mc0[k]) for k, x in mc1.items()}
            # where the machine's CPU went during the level: this configuration's engines, its L2 servers,
            # the load generator, and everything else on the machine (other users)
            cpu = {"engines_s": c1["engines"] - c0["engines"], "l2_s": c1["l2"] - c0["l2"], "bench_s": b1 - b0,
                   "router_s": c1["router"] - c0["router"],
                   "machine_busy_s": m1 - m0, "machine_capacity_s": wall * (os.cpu_count() or 1)}
            cpu["others_s"] = max(0.0, cpu["machine_busy_s"] - cpu["engines_s"] - cpu["l2_s"] - cpu["bench_s"]
                                  - cpu["router_s"])
            row["cpu"] = cpu
            # a figure other users' load moves less: output tokens per CPU second this configuration used
            used = cpu["engines_s"] + cpu["l2_s"] + cpu["router_s"]
            out_tokens = sum(r.output_tokens for r in results if not r.error)
            row["output_tokens_per_cpu_s"] = out_tokens / used if used else None
            row["load"] = load
            row["loadavg"] = os.getloadavg()
            rs = route_stats(dep)
            if rs is not None:          # cumulative over the levels: where the router sent requests, and why
                row["route"] = rs
            row["results"] = [r.to_json() for r in results]
            entry["runs"].append(row)
    finally:
        dep.stop()
    return entry


def run_rl_config(config: str, opt: Options, spec, vocab: int, weights_dirs: list[str],
                  progress: bool) -> dict[str, Any]:
    """Start ``config`` with the RL extension, run the RL workload once (``_serve_rl``), stop it; its entry."""
    from . import _serve_rl as rl

    entry: dict[str, Any] = {"config": config, "label": LABELS[config], "runs": []}
    t0 = time.monotonic()
    try:
        dep = start(config, opt, {"VLLM_SERVER_DEV_MODE": "1"})
    except NotRunnable as e:
        entry["not_runnable"] = str(e).strip().splitlines()[0]
        print(f"{config}: NOT RUNNABLE here: {entry['not_runnable']}", file=sys.stderr)
        return entry
    entry["start_s"] = time.monotonic() - t0
    entry["settings"] = dep.settings
    try:
        entry["fingerprints_at_start"] = rl.prepare(dep.urls, config)
        for url in dep.urls:                       # warm-up, after prepare: its first version is bound now
            complete(url, list(range(8, 8 + 2 * CHUNK_TOKENS)), 2)
        v0 = vllm_counters(dep.urls)
        w0 = rl.weights_counters(dep.urls)
        p0 = pool_counters(dep.pool.addresses) if dep.pool else None
        c0, m0, b0 = dep.cpu_s(), machine_busy_s(), proc_cpu_s(os.getpid())
        bar = _bar(spec.sessions * spec.turns, f"{config} rl", progress)
        try:
            res = rl.run_rl(spec, dep.urls, config, vocab, weights_dirs,
                            on_done=(lambda r: bar.update(1)) if bar is not None else (lambda r: None))
        except Exception as e:       # an update's RPC failed: say so with the engine's own error if one died
            dead = dep.dead()
            raise RuntimeError(f"{config}: the RL run failed ({type(e).__name__}: {e})"
                               + ("; an engine died:\n" + "\n".join(dead) if dead else "")) from e
        finally:
            if bar is not None:
                bar.close()
        dead = dep.dead()
        if dead:
            raise RuntimeError(f"{config}: an engine died during the run:\n" + "\n".join(dead))
        v = settled_vllm_counters(dep.urls, v0, sum(r.output_tokens for r in res.results if not r.error))
        p = delta(p0, pool_counters(dep.pool.addresses)) if dep.pool else None
        c1, m1, b1 = dep.cpu_s(), machine_busy_s(), proc_cpu_s(os.getpid())
        row = summarize(res.results, res.wall_s, {r.index for r in res.results if r.step}, v, p)
        row["cpu"] = {"engines_s": c1["engines"] - c0["engines"], "l2_s": c1["l2"] - c0["l2"], "bench_s": b1 - b0,
                      "router_s": 0.0, "machine_busy_s": m1 - m0}
        row["cpu"]["others_s"] = max(0.0, row["cpu"]["machine_busy_s"] - row["cpu"]["engines_s"]
                                     - row["cpu"]["l2_s"] - row["cpu"]["bench_s"])
        used = row["cpu"]["engines_s"] + row["cpu"]["l2_s"]
        out_tokens = sum(r.output_tokens for r in res.results if not r.error)
        row["output_tokens_per_cpu_s"] = out_tokens / used if used else None
        row["rl"] = rl.rl_figures(res, w0, rl.weights_counters(dep.urls))
        row["load"] = spec.sessions
        row["loadavg"] = os.getloadavg()
        row["results"] = [r.to_json() for r in res.results]
        entry["runs"].append(row)
    finally:
        dep.stop()
    return entry


def rl_main(args: argparse.Namespace, shape: Shape) -> int:
    """``--workload rl``: the RL rollout preset (``_serve_rl``) over ``--configs`` (default: vLLM alone and the
    DRAM pool with and without ``weights_retire``)."""
    from . import _serve_rl as rl

    configs = [c for c in (args.configs or "vllm,kvfabric,kvfabric-retire").split(",") if c]
    bad = [c for c in configs if c not in RL_CONFIGS]
    try:
        spec = rl.RLSpec(prompts=args.rl_prompts, group=args.rl_group, turns=args.rl_turns,
                         update_every=args.rl_update_every, system_tokens=args.rl_system_tokens,
                         prompt_tokens=args.rl_prompt_tokens, obs_tokens=args.rl_obs_tokens,
                         output_tokens=args.rl_output_tokens, env_delay_s=args.rl_env_delay_ms / 1000,
                         temperature=args.rl_temperature, seed=args.seed)
    except ValueError as e:
        print(f"kvfabric bench serve: {e}", file=sys.stderr)
        return 2
    if bad or not configs or args.instances < 2 or spec.max_context >= args.max_model_len:
        print(f"kvfabric bench serve --workload rl: need configs among {', '.join(RL_CONFIGS)} (got {bad or configs}), "
              f"--instances >= 2 (sessions move between generators), and --max-model-len above the longest "
              f"context ({spec.max_context} tokens)", file=sys.stderr)
        return 2
    d = spec.describe()
    print(f"rl workload: {d['prompts']} prompts x {d['group']} samples = {d['sessions']} sessions, {d['turns']} turns "
          f"(steps), a weight update every {d['update_every']} steps ({d['updates']} in all) on each of "
          f"{args.instances} generators, environment delay {spec.env_delay_s:g} s, contexts up to "
          f"{d['max_context_tokens']} tokens, {d['requests']} requests", flush=True)
    report: dict[str, Any] = {"args": vars(args), "workload": "rl", "rl": d, "instances": args.instances,
                              "shape": {**shape.__dict__, "kv_bytes_per_token": shape.kv_bytes_per_token},
                              "configs": []}
    logs = Path(args.logs or Path(args.out).with_suffix("").as_posix() + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    report["logs"] = str(logs)
    with tempfile.TemporaryDirectory(prefix="kvf-serve-rl-") as tmp:
        model = args.model or str(build_model(args.engine_python, Path(tmp) / "model", shape))
        # update k loads the k-th other random model of the same shape (seed k): other weights each time
        weights = [str(build_model(args.engine_python, Path(tmp) / f"weights-{k}", shape, seed=k))
                   for k in range(1, spec.updates + 1)]
        report["weights_dirs"] = len(weights)
        opt = Options(python=args.engine_python, model=model, instances=args.instances, kv_bytes=_mib(args.kv_mib),
                      dram_bytes=_mib(args.dram_mib), ssd_bytes=_mib(args.ssd_mib), ssd_dir=args.ssd_dir,
                      pool_servers=args.pool_servers, max_model_len=args.max_model_len,
                      max_batched_tokens=args.max_model_len, workdir=logs,
                      server_transports=args.server_transports, engine_extra=("--worker-extension-cls", rl.EXTENSION),
                      engine_cpus=args.engine_cpu_sets)
        for config in configs:
            report["configs"].append(run_rl_config(config, opt, spec, shape.vocab, weights, args.progress))
    report["loadavg"] = os.getloadavg()
    print(f"load average {report['loadavg'][0]:.1f} {report['loadavg'][1]:.1f} on {os.cpu_count()} CPUs")
    if any(c.get("runs") for c in report["configs"]):
        print_table(report)
        rl.print_rl(report)
    for c in report["configs"]:
        if c.get("not_runnable"):
            print(f"NOT RUN {c['label']}: {c['not_runnable']}")
    write_json(args.out, report)
    return 0 if any(c.get("runs") for c in report["configs"]) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench serve", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="mooncake-conversation", help="bundled trace name or file")
    ap.add_argument("--sessions", type=int, default=12, help="sessions drawn from the trace")
    ap.add_argument("--max-requests", type=int, default=None, help="keep the first N requests of those sessions")
    ap.add_argument("--no-reuse", action="store_true",
                    help="the same requests with no token block shared between prompts (a control: no reuse)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-tokens", type=int, default=32,
                    help="engine tokens per trace block (scale = this / the trace's 512)")
    ap.add_argument("--output-scale", type=float, default=None, help="output length scale (default: the scale)")
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--mode", choices=["closed", "open"], default="closed")
    ap.add_argument("--loads", default="1,4", help="closed: sessions in flight; open: speed-ups (comma list)")
    ap.add_argument("--configs", default=None,
                    help=f"some of {','.join(CONFIGS)} (default all); --workload rl: some of {','.join(RL_CONFIGS)} "
                         f"(default vllm,kvfabric,kvfabric-retire)")
    ap.add_argument("--workload", choices=["trace", "rl"], default="trace",
                    help="trace: replay --trace's sessions; rl: RL rollouts (groups, agent turns, weight updates)")
    rlg = ap.add_argument_group("--workload rl")
    rlg.add_argument("--rl-prompts", type=int, default=4, help="prompts (tasks) per run")
    rlg.add_argument("--rl-group", type=int, default=4, help="samples per prompt (sessions = prompts x group)")
    rlg.add_argument("--rl-turns", type=int, default=4, help="agent turns per session (= steps)")
    rlg.add_argument("--rl-update-every", type=int, default=2, help="steps between weight updates")
    rlg.add_argument("--rl-system-tokens", type=int, default=256, help="system prompt shared by every prompt")
    rlg.add_argument("--rl-prompt-tokens", type=int, default=384, help="each prompt's own tokens")
    rlg.add_argument("--rl-obs-tokens", type=int, default=128, help="environment observation per turn")
    rlg.add_argument("--rl-output-tokens", type=int, default=64, help="generated tokens per turn")
    rlg.add_argument("--rl-env-delay-ms", type=float, default=1000.0, help="environment delay between steps")
    rlg.add_argument("--rl-temperature", type=float, default=1.0)
    ap.add_argument("--instances", type=int, default=2,
                    help="vLLM instances (behind round-robin routing, or kvfabric route for route configs)")
    ap.add_argument("--engine-cpus", default="split",
                    help="CPUs of each instance: split (default: its own share of this process's CPUs, as each "
                         "instance has its own accelerator), none (every engine on every CPU), or sets such as "
                         "0|1 (one per instance)")
    ap.add_argument("--pool-servers", type=int, default=2)
    ap.add_argument("--kv-mib", type=float, default=128, help="vLLM KV cache per instance (the 'HBM')")
    ap.add_argument("--dram-mib", type=float, default=256, help="L2 DRAM in all, for (b)-(e)")
    ap.add_argument("--ssd-mib", type=float, default=1024, help="SSD tier in all, for (e)")
    ap.add_argument("--ssd-dir", default=tempfile.gettempdir())
    ap.add_argument("--server-transports", default="tcp,native",
                    help="what the pool servers offer (default: no shm, as for a pool on other nodes)")
    ap.add_argument("--pool-args", default="",
                    help="more `kvfabric serve` arguments for every pool server, e.g. '--policy s3fifo' "
                         "(default: none: LRU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--model", default=None, help="a model directory built with the same shape (default: build)")
    ap.add_argument("--engine-python", default=sys.executable, help="interpreter with vLLM (default: this one)")
    ap.add_argument("--lmcache-venv", default=None,
                    help="virtualenv with LMCache for (c) (default: a 'lmcache' venv beside the engine's)")
    ap.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    ap.add_argument("--calibrate-only", action="store_true", help="measure r and stop")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--out", default="bench-results/serve.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--logs", default=None, help="folder for the engines' and L2 servers' logs "
                                                 "(default: --out without .json, plus -logs)")
    args = ap.parse_args(argv)
    try:   # checked before anything starts: a bad --engine-cpus is a usage error, not a traceback after the model
        args.engine_cpu_sets = engine_cpu_sets(args.engine_cpus, args.instances)
    except ValueError as e:
        print(f"kvfabric bench serve: {e}", file=sys.stderr)
        return 2

    shape = Shape(args.layers, args.heads, args.kv_heads, args.head_dim, args.hidden)
    if args.workload == "rl":
        if _mib(args.kv_mib) < (args.max_model_len + CHUNK_TOKENS) * shape.kv_bytes_per_token:
            print(f"kvfabric bench serve: --kv-mib {args.kv_mib:g} cannot hold one request of --max-model-len "
                  f"{args.max_model_len}", file=sys.stderr)
            return 2
        return rl_main(args, shape)
    configs = [c for c in (args.configs or ",".join(CONFIGS)).split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    try:
        loads = [float(x) for x in args.loads.split(",") if x]
    except ValueError:
        loads = []
    if bad or not configs or not loads or min(loads) <= 0 or args.instances < 1 or args.pool_servers < 1:
        print(f"kvfabric bench serve: need configs among {', '.join(CONFIGS)} (got {bad or configs}), positive "
              f"--loads, --instances and --pool-servers >= 1", file=sys.stderr)
        return 2
    need = (args.max_model_len + CHUNK_TOKENS) * shape.kv_bytes_per_token
    if _mib(args.kv_mib) < need:
        print(f"kvfabric bench serve: --kv-mib {args.kv_mib:g} cannot hold one request of --max-model-len "
              f"{args.max_model_len} at {shape.kv_bytes_per_token} B of KV per token: give at least "
              f"{need / (1 << 20):.0f} MiB or a shorter --max-model-len", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace)
        workload = build_workload(trace, sessions=args.sessions, seed=args.seed, block_tokens=args.block_tokens,
                                  max_model_len=args.max_model_len, output_scale=args.output_scale,
                                  max_requests=args.max_requests, no_reuse=args.no_reuse)
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench serve: {e}", file=sys.stderr)
        return 2
    wdesc = workload.describe()
    wdesc["infinite_reuse_fraction"] = workload.reusable_tokens(CHUNK_TOKENS) / max(1, wdesc["prompt_tokens"])
    print(f"workload: {wdesc['requests']} requests in {wdesc['sessions']} sessions of {wdesc['trace']}, scale "
          f"{wdesc['scale']:g} ({args.block_tokens} engine tokens per {trace.block_tokens}-token trace block; outputs "
          f"x{wdesc['output_scale']:g}), prompts {wdesc['mean_prompt_tokens']:.0f} tokens on average (max "
          f"{wdesc['max_prompt_tokens']}, {wdesc['truncated']} cut to max_model_len {args.max_model_len}), "
          f"{wdesc['unique_blocks']} unique blocks, infinite-cache block hit rate "
          f"{wdesc['infinite_block_hit_rate']:.1%} ({wdesc['infinite_reuse_fraction']:.1%} of prompt tokens in "
          f"whole {CHUNK_TOKENS}-token chunks)", flush=True)
    reuse = {r.index for r in workload.requests
             if any(q.session == r.session and q.index < r.index for q in workload.requests)}
    lm_py, lm_site = lmcache_installation(args.lmcache_venv or str(Path(args.engine_python).parents[2] / "lmcache"))
    report: dict[str, Any] = {"args": vars(args), "workload": wdesc, "instances": args.instances,
                              "shape": {**shape.__dict__, "kv_bytes_per_token": shape.kv_bytes_per_token},
                              "mode": args.mode, "slo_ttft_ms": args.slo_ttft_ms, "configs": [],
                              "load_axis": ("sessions in flight (closed loop)" if args.mode == "closed"
                                            else "speed-up over the trace's arrivals (open loop)")}
    logs = Path(args.logs or Path(args.out).with_suffix("").as_posix() + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    report["logs"] = str(logs)
    with tempfile.TemporaryDirectory(prefix="kvf-serve-bench-") as tmp:
        model = args.model or str(build_model(args.engine_python, Path(tmp) / "model", shape))
        calib = calibrate_transport(shape, args.pool_servers, args.server_transports, CHUNK_TOKENS)
        print(f"transport: {calib['transfer_gbps']:.2f} GB/s ({','.join(calib['transport'])}), "
              f"{1e6 * calib['transfer_s_per_token']:.2f} us per token of KV ({shape.kv_bytes_per_token} B)",
              flush=True)
        opt = Options(python=args.engine_python, model=model, instances=args.instances, kv_bytes=_mib(args.kv_mib),
                      dram_bytes=_mib(args.dram_mib), ssd_bytes=_mib(args.ssd_mib), ssd_dir=args.ssd_dir,
                      pool_servers=args.pool_servers, max_model_len=args.max_model_len,
                      max_batched_tokens=args.max_model_len, workdir=logs,
                      server_transports=args.server_transports, lmcache_site=lm_site, lmcache_python=lm_py,
                      mooncake_bin=mooncake_binaries(args.engine_python), engine_cpus=args.engine_cpu_sets,
                      pool_args=tuple(shlex.split(args.pool_args)))
        todo = configs[:1] if args.calibrate_only else configs
        for config in todo:
            entry = run_config(config, opt, workload, [] if args.calibrate_only else loads, args.mode,
                               shape.vocab, reuse, args.progress, calib)
            report["configs"].append(entry)
            if entry.get("runs") and args.slo_ttft_ms:
                ok = [r["output_tokens_per_s"] for r in entry["runs"]
                      if r["ttft_ms_p99"] is not None and r["ttft_ms_p99"] <= args.slo_ttft_ms]
                entry["best_at_slo"] = max(ok) if ok else None
            if entry.get("runs"):
                entry["saturation_output_tokens_per_s"] = max(r["output_tokens_per_s"] for r in entry["runs"])
    if "prefill_s_per_token" in calib:
        # the slope excludes the fixed cost of a request; on a loaded machine it can come out <= 0, and then
        # only the whole-prompt figure (TTFT / tokens at the longer prompt, an upper bound) is reported
        calib["r_at_max"] = calib["prefill_s_per_token_at_max"] / calib["transfer_s_per_token"]
        if calib["prefill_s_per_token"] > 0:
            calib["r"] = calib["prefill_s_per_token"] / calib["transfer_s_per_token"]
    for entry in report["configs"]:
        for row in entry.get("runs", []):
            v = row["vllm"]
            if entry["config"].startswith(("kvfabric", "route")) and v["kvfabric_load_tokens"] > 0 and "r" in calib \
                    and v["kvfabric_load_seconds"] > 0:
                calib.setdefault("engine_load_s_per_token", v["kvfabric_load_seconds"] / v["kvfabric_load_tokens"])
    if "engine_load_s_per_token" in calib and calib["engine_load_s_per_token"] > 0:
        calib["r_engine_load"] = calib["prefill_s_per_token"] / calib["engine_load_s_per_token"]
    report["calibration"] = calib
    report["loadavg"] = os.getloadavg()
    if "r_at_max" in calib:
        lo, hi = calib["lengths"]
        r = f"r = {calib['r']:.1f}" if "r" in calib else "r not measured (the slope was <= 0: load swamped it)"
        print(f"calibration: prefill {1e6 * calib['prefill_s_per_token']:.1f} us/token (slope {lo}->{hi} tokens "
              f"on {calib['prefill_config']}; {1e6 * calib['prefill_s_per_token_at_max']:.1f} us/token over the "
              f"whole {hi}-token prompt), transfer {1e6 * calib['transfer_s_per_token']:.2f} us/token: {r}"
              f" (whole prompt: {calib['r_at_max']:.1f})"
              + (f"; over the connector's own load time r = {calib['r_engine_load']:.1f}"
                 if "r_engine_load" in calib else ""))
    print(f"load average {report['loadavg'][0]:.1f} {report['loadavg'][1]:.1f} on {os.cpu_count()} CPUs")
    report["reuse_bound"] = reuse_bound(report)
    if not args.calibrate_only:
        print_table(report)
        print_reuse_bound(report)
    write_json(args.out, report)
    if not args.calibrate_only:
        png = args.plot or str(Path(args.out).with_suffix(".png"))
        try:
            plot(report, png)
            print(f"wrote {png}")
        except ImportError:
            print("kvfabric bench serve: no plot (needs matplotlib: pip install 'kvfabric[bench]')", file=sys.stderr)
    ran = [c for c in report["configs"] if c.get("runs") or (args.calibrate_only and not c.get("not_runnable"))]
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
