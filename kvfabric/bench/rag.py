"""``kvfabric bench rag``: the main job. Generate a RAG trace, replay it on real servers, plot.

With no arguments it:

1. generates a RAG trace with :mod:`kvfabric.bench.ragtrace`'s defaults
   (3000 requests, 2 tenants, 3000 documents with Zipf popularity, top-4
   retrieval, follow-up turns; seed 0) and writes it to
   ``bench-results/rag-trace.jsonl``;
2. starts ``--shards`` (2) local pool servers per eviction policy, with a pool
   capacity of ``--capacity`` (10%) of the trace's unique blocks, replays the
   trace against them and prints the three-level table (exists / loaded /
   useful, block and token hit rates, latencies, gap closed toward Belady);
3. simulates every policy offline over capacities 1-50% (the server's own
   policy classes), computes Belady and infinite, prints that table and
   writes ``bench-results/rag.png`` and ``bench-results/rag.json``.

It takes well under two minutes on two cores. Every generator parameter is
a flag (``--docs``, ``--zipf``, ``--top-k``, ``--followup-prob``, ...; see
``--help``); replay flags are those of ``kvfabric bench replay``.
Exit status 2 on bad arguments, 1 when a server could not start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ..server.eviction import POLICIES
from . import ragtrace
from .replay import add_common_arguments, exit_on_sigterm, options_from_args
from .sweep import _floats, plot_or_explain, print_report, print_sweep, sweep_trace
from .traces import write_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench rag",
                                description="The main job: generate a RAG trace, replay it on real servers, plot.")
    p.add_argument("--out-dir", default="bench-results", help="where the trace, JSON and PNG go (default bench-results)")
    p.add_argument("--capacity", type=float, default=0.1, help="pool capacity for the real replay (default 0.1)")
    p.add_argument("--capacities", type=_floats, default=[0.01, 0.05, 0.1, 0.25, 0.5],
                   help="simulated capacities for the plot (default 0.01,0.05,0.1,0.25,0.5)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default all)")
    ragtrace.add_arguments(p)
    add_common_arguments(p, block_tokens=False)
    args = p.parse_args(argv)
    exit_on_sigterm()
    policies = [x for x in args.policies.split(",") if x]
    t0 = time.perf_counter()
    try:
        for pol in policies:
            if pol not in POLICIES:
                raise ValueError(f"unknown policy {pol!r}; known: {sorted(POLICIES)}")
        if not args.capacities:
            raise ValueError("--capacities must name at least one fraction")
        for c in args.capacities + [args.capacity]:
            if not 0 < c <= 10:
                raise ValueError(f"capacities are fractions in (0, 10], got {c}")
        cfg = ragtrace.config_from_args(args)
        opt = options_from_args(args, policies=policies, capacity=args.capacity)
        opt.validate()
        trace = ragtrace.generate(cfg)
    except ValueError as e:
        print(f"kvfabric bench rag: {e}", file=sys.stderr)
        return 2
    if args.limit:
        trace = trace.head(args.limit)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_trace(out / "rag-trace.jsonl", trace.requests, trace.block_tokens)
    print(f"generated {len(trace)} requests, {trace.total_blocks} block accesses, {trace.unique_blocks} unique "
          f"blocks of {trace.block_tokens} tokens -> {out / 'rag-trace.jsonl'}")
    try:
        result = sweep_trace(trace, args.capacities, policies, [args.capacity], opt)
    except RuntimeError as e:
        print(f"kvfabric bench rag: {e}", file=sys.stderr)
        return 1
    for rep in result["replays"]:
        print()
        print_report(rep)
    print_sweep(result)
    result["generator"] = asdict(cfg)
    (out / "rag.json").write_text(json.dumps(result, indent=1, default=str))
    if not plot_or_explain([result], out / "rag.png", f"kvfabric bench rag, {opt.shards} shard(s)", "kvfabric bench rag",
                           out / "rag.json"):
        return 1
    print(f"\nwrote {out / 'rag.json'} and {out / 'rag.png'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
