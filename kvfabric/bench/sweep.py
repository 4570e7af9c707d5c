"""``kvfabric bench sweep``: hit rate vs pool capacity for every policy, with Belady and infinite lines.

For each trace and each capacity (a fraction of the trace's unique blocks)
it computes, offline, the block-level prefix hit rate of every eviction
policy (:mod:`kvfabric.bench.simulate`, the server's own policy classes on
``--shards`` shards), Belady's bound and the infinite-capacity rate. At the
``--real`` capacities it also replays the trace against real local servers
(:mod:`kvfabric.bench.replay`) for every policy, so the figure and the table
carry measured points next to the simulated curves, and the real runs'
three-level results go into the JSON.

Output: a table on stdout (per trace and capacity: each policy's hit rate
and the share of the LRU-to-Belady gap it closes, real where measured), a
JSON file and a PNG (one panel per trace; lines = simulated, markers = real
servers; dashed = Belady, dotted = infinite). Defaults: both bundled Mooncake
traces, capacities 1, 5, 10, 25, 50%, real replays at 5% and 10% (several
minutes on two cores; ``--real none`` for the offline figure alone, about a
minute).

With ``--ssd-capacity F`` every point also carries, per policy and
``--ssd-admit`` rule, the two-level simulation (DRAM at the point's capacity
+ an SSD log of F x the unique blocks; :mod:`kvfabric.bench._tiers`) as a
``POLICY/ssd-RULE`` column and line, and the ``--real`` replays start tiered
servers (``off`` = the same DRAM without a tier, shown as the policy itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..server.eviction import POLICIES
from .belady import belady, belady_chunks, infinite, infinite_chunks, reuse_oracle
from .replay import (
    ReplayOptions,
    add_common_arguments,
    exit_on_sigterm,
    options_from_args,
    run_replay,
)
from .replay_report import print_report
from ._tiers import ssd_geometry
from .simulate import default_servers, gap_closed, shard_capacity, simulate
from .traces import Trace, TraceError, load_trace

DEFAULT_CAPACITIES = [0.01, 0.05, 0.1, 0.25, 0.5]
DEFAULT_REAL = [0.05, 0.1]


def _floats(text: str) -> list[float]:
    if text.strip().lower() in ("", "none"):
        return []
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None


def sweep_trace(trace: Trace, capacities: list[float], policies: list[str], real: list[float],
                opt: ReplayOptions, log=None) -> dict[str, Any]:
    """Simulated grid + Belady/infinite for every capacity, real replays at ``real``; a JSON-able dict."""
    log = log or sys.stderr
    chunks = opt.key_mode == "chunk"
    inf = infinite(trace)
    inf_c = infinite_chunks(trace) if chunks else None
    sim_servers = default_servers(opt.shards)
    points = []
    replays = []
    for frac in sorted(set(capacities) | set(real)):
        per = shard_capacity(trace, frac, opt.shards)
        total = per * opt.shards
        bound = belady(trace, total)
        row: dict[str, Any] = {"capacity_fraction": frac, "capacity_blocks": total,
                               "belady": bound.block_hit_rate, "infinite": inf.block_hit_rate,
                               "reuse_oracle": reuse_oracle(trace, total).block_hit_rate,
                               "belady_tokens": bound.token_hit_rate, "infinite_tokens": inf.token_hit_rate,
                               "sim": {}, "real": {}}
        if inf_c is not None:
            bc = belady_chunks(trace, total)
            row["chunk_mode"] = {
                name: {"prefix_token_hit_rate": p.token_hit_rate, "chunk_token_hit_rate": c.token_hit_rate}
                for name, (p, c) in (("belady", bc), ("infinite", inf_c))}
        print(f"[sweep] {trace.name} capacity {frac:.0%}: simulating {', '.join(policies)}"
              f"{' (prefix+chunk keys)' if chunks else ''}", file=log)
        ssd = seg = 0
        if opt.ssd_capacity:  # the log a real server lays out for that many blocks (see replay)
            _, ssd, seg = ssd_geometry(shard_capacity(trace, opt.ssd_capacity, opt.shards),
                                       trace.block_tokens * opt.bytes_per_token)
        runs = [(pol, pol, 0, "all") for pol in policies]
        if ssd:
            row["ssd_capacity_blocks"] = ssd * opt.shards
            runs += [(f"{pol}/ssd-{a}", pol, ssd, a) for pol in policies for a in opt.ssd_admit if a != "off"]
        for name, pol, tier, admit in runs:
            r = simulate(trace, pol, per, sim_servers, chunks=chunks, ssd_blocks_per_shard=tier, admit=admit,
                         ssd_segment_blocks=seg)
            row["sim"][name] = {"block_hit_rate": r.hits.block_hit_rate, "token_hit_rate": r.hits.token_hit_rate}
            if r.tiers is not None:
                row["sim"][name]["tiers"] = r.tiers.as_dict()
            if r.chunk_hits is not None:
                row["sim"][name]["chunk_block_hit_rate"] = r.chunk_hits.block_hit_rate
                row["sim"][name]["chunk_token_hit_rate"] = r.chunk_hits.token_hit_rate
        if frac in real:
            rep = run_replay(trace, ReplayOptions(**{**opt.__dict__, "capacity": frac, "policies": policies,
                                                     "servers": None}))
            replays.append(rep)
            for run in rep["runs"]:
                keep = ("levels", "chunk_levels", "sharding_spread", "latency", "bytes", "requests_per_s",
                        "gap_closed", "sim", "wall_s")
                name = run["policy"] if run.get("admit") in (None, "off") else f"{run['policy']}/ssd-{run['admit']}"
                row["real"][name] = {k: run.get(k) for k in keep + ("ssd",)}
        for kind in ("sim", "real"):
            lru = row[kind].get("lru")
            for pol, v in row[kind].items():
                if "/ssd-" in pol:  # a tier changes the capacity: the DRAM-only gap says nothing about it
                    v["gap_closed"] = None
                    continue
                rate = v["block_hit_rate"] if kind == "sim" else v["levels"]["exists"]["block_hit_rate"]
                v["gap_closed"] = None if lru is None else gap_closed(
                    rate, lru["block_hit_rate"] if kind == "sim" else lru["levels"]["exists"]["block_hit_rate"],
                    bound.block_hit_rate)
        points.append(row)
    return {"trace": trace.name, "requests": len(trace), "unique_blocks": trace.unique_blocks,
            "total_blocks": trace.total_blocks, "block_tokens": trace.block_tokens, "shards": opt.shards,
            "bytes_per_token": opt.bytes_per_token, "key_mode": opt.key_mode, "points": points, "replays": replays}


def print_sweep(result: dict[str, Any], out=None) -> None:
    out = out or sys.stdout
    pols = list(result["points"][0]["sim"]) if result["points"] else []
    print(f"\n{result['trace']}: {result['requests']} requests, {result['unique_blocks']} unique blocks, "
          f"{result['shards']} shard(s); block-level prefix hit rate (gap closed LRU->Belady); "
          f"R = measured on real servers, else simulated; oracle = LRU + perfect reuse predictor", file=out)
    print(f"{'capacity':>8} " + " ".join(f"{p:>17}" for p in pols) + f" {'oracle':>7} {'belady':>7} {'infinite':>8}", file=out)
    for row in result["points"]:
        cells = []
        for p in pols:
            real = row["real"].get(p)
            if real is not None:
                rate, g, tag = real["levels"]["exists"]["block_hit_rate"], real["gap_closed"], "R"
            else:
                rate, g, tag = row["sim"][p]["block_hit_rate"], row["sim"][p]["gap_closed"], " "
            gtxt = "" if g is None or p == "lru" else f"({g:+.0%})"
            cells.append(f"{rate:6.1%}{tag}{gtxt:>9}")
        print(f"{row['capacity_fraction']:>8.0%} " + " ".join(f"{c:>17}" for c in cells)
              + f" {row['reuse_oracle']:>7.1%} {row['belady']:>7.1%} {row['infinite']:>8.1%}", file=out)


def plot_or_explain(results: list[dict[str, Any]], png: str | Path, title: str, prog: str, wrote: str | Path) -> bool:
    """:func:`plot`, or, without matplotlib, say that only ``wrote`` was written; False then."""
    try:
        plot(results, png, title)
    except ImportError:
        print(f"{prog}: wrote {wrote}, but the PNG needs matplotlib (pip install 'kvfabric[bench]')", file=sys.stderr)
        return False
    return True


def plot(results: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """One panel per trace: hit rate vs capacity; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(6.2 * n, 4.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        pts = res["points"]
        xs = [p["capacity_fraction"] * 100 for p in pts]
        ax.plot(xs, [p["infinite"] * 100 for p in pts], "k:", label="infinite")
        ax.plot(xs, [p["belady"] * 100 for p in pts], "k--", label="Belady (offline bound)")
        ax.plot(xs, [p["reuse_oracle"] * 100 for p in pts], "-.", color="0.55",
                label="LRU + perfect reuse predictor (offline)")
        for i, pol in enumerate(pts[0]["sim"] if pts else []):
            color = f"C{i}"
            ax.plot(xs, [p["sim"][pol]["block_hit_rate"] * 100 for p in pts], "-", color=color, label=pol)
            rx = [p["capacity_fraction"] * 100 for p in pts if pol in p["real"]]
            ry = [p["real"][pol]["levels"]["exists"]["block_hit_rate"] * 100 for p in pts if pol in p["real"]]
            if rx:
                ax.plot(rx, ry, "o", color=color, markersize=6, markerfacecolor="none")
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("pool capacity (% of unique blocks, log scale)")
        ax.set_ylabel("block-level prefix hit rate (%)")
        ax.set_title(f"{res['trace']} ({res['requests']} requests, {res['shards']} shard(s))")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title + "\nlines: offline simulation of the server's policies; circles: measured on real servers",
                     fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench sweep", description="Hit rate vs capacity x policy, with bounds.")
    p.add_argument("traces", nargs="*", default=["mooncake-conversation", "mooncake-synthetic"],
                   help="trace files or bundled names (default both Mooncake traces)")
    p.add_argument("--capacities", type=_floats, default=DEFAULT_CAPACITIES,
                   help="comma-separated fractions of unique blocks (default 0.01,0.05,0.1,0.25,0.5)")
    p.add_argument("--real", type=_floats, default=DEFAULT_REAL,
                   help="capacities to also replay on real servers (default 0.05,0.1; 'none' to skip)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default all)")
    p.add_argument("--json", default="bench-results/sweep.json")
    p.add_argument("--png", default="bench-results/sweep.png")
    add_common_arguments(p)
    args = p.parse_args(argv)
    exit_on_sigterm()
    policies = [x for x in args.policies.split(",") if x]
    try:
        for pol in policies:
            if pol not in POLICIES:
                raise ValueError(f"unknown policy {pol!r}; known: {sorted(POLICIES)}")
        if not args.capacities:
            raise ValueError("--capacities must name at least one fraction")
        for c in args.capacities + args.real:
            if not 0 < c <= 10:
                raise ValueError(f"capacities are fractions in (0, 10], got {c}")
        opt = options_from_args(args, policies=policies)
        opt.validate()
        traces = [load_trace(t, args.block_tokens, args.limit) for t in args.traces]
        if opt.key_mode == "chunk" and not all(t.has_chunks for t in traces):
            raise ValueError("--key-mode chunk needs traces with chunks (passage boundaries)")
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench sweep: {e}", file=sys.stderr)
        return 2
    try:
        results = [sweep_trace(t, args.capacities, policies, args.real, opt) for t in traces]
    except RuntimeError as e:
        print(f"kvfabric bench sweep: {e}", file=sys.stderr)
        return 1
    for r in results:
        for rep in r["replays"]:
            print()
            print_report(rep)
        print_sweep(r)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"results": results}, indent=1))
    tier = (f"; POLICY/ssd-RULE: the capacity on the x axis in DRAM + an SSD log of {opt.ssd_capacity:.0%} of unique "
            f"blocks" if opt.ssd_capacity else "")
    if not plot_or_explain(results, args.png, f"kvfabric bench sweep, {opt.shards} shard(s){tier}", "kvfabric bench sweep",
                           args.json):
        return 1
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
