"""``kvfabric bench rag``: the main job. Replay a RAG workload on real servers, both key modes, plot.

``kvfabric bench rag --dataset musique`` replays the bundled **real**
workload (150 MuSiQue multi-hop questions, each prompt = system template + 10
retrieved passages + question; :mod:`kvfabric.bench.ragdata`,
``data/rag/musique``), 256-token blocks unless ``--block-tokens 16``. With no
``--dataset`` it generates a synthetic RAG trace with
:mod:`kvfabric.bench.ragtrace` (defaults, or ``--preset musique`` for the
generator calibrated on the real workload; every generator parameter is a
flag) and writes it to ``bench-results/rag-trace.jsonl``. Then, for each key
mode (``--key-mode prefix|chunk|both``; default both for ``--dataset``, prefix
for the generator, whose 3000 requests take minutes in both modes here):

* ``prefix``: the pool holds prefix keys, the hit an engine gets today;
* ``chunk``: the pool (same capacity) also holds every passage's
  position-independent chunk keys; the *chunk* level ("reusable with
  blending") is counted apart from the prefix level, never added to it;

it starts ``--shards`` (2) local pool servers per eviction policy with a
capacity of ``--capacity`` (10%) of the trace's unique prefix blocks, replays
the trace and prints the three levels (exists / loaded / useful), and
simulates every policy offline over the capacities 1-50% (the Mooncake
figures' grid) with Belady and infinite for that key mode. Last it prints
prefix and chunk levels side by side, each with its one-line definition, and
writes ``rag.json`` and ``rag.png`` to ``--out-dir``.

Under two minutes on two shared cores for ``--dataset musique`` (and for the
generator's defaults). ``--spread`` (default 4 with ``--dataset``, else 0)
reports the sharding spread of every real run.
Exit status 2 on bad arguments, 1 when a server could not start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..server.eviction import POLICIES
from . import ragtrace
from .replay import (
    KEY_MODES,
    LLAMA31_8B_BYTES_PER_TOKEN,
    add_common_arguments,
    exit_on_sigterm,
    options_from_args,
)
from .replay_report import CHUNK_DEFINITION, PREFIX_DEFINITION
from .sweep import _floats, plot_or_explain, print_report, print_sweep, sweep_trace
from .traces import Trace, TraceError, load_trace, write_trace

DATASETS = {"musique": "musique-b{}"}
#: line style and marker per policy, in the order policies are listed
POLICY_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P"))
#: The engine the useful level is modelled for: Llama-3-8B (and 3.1-8B), 32 layers x 8 KV heads x 128 dims
#: x K and V x 2 bytes (bf16) = 131072 B = 128 KiB of KV per token.
KV_MODEL = "Llama-3-8B (32 layers x 8 KV heads x 128 dims x K,V x 2 B bf16)"


def level_definitions(opt: Any) -> list[str]:
    """One line per level, with the numbers this run uses."""
    kv = opt.kv_bytes_per_token
    load = (f"its measured GET of {opt.bytes_per_token} B/token payloads plus the modelled transfer of the "
            f"real {kv} B/token ({KV_MODEL}) over {opt.link_gbps:g} Gb/s"
            if kv and kv > opt.bytes_per_token else f"its measured GET of {opt.bytes_per_token} B/token payloads")
    return [
        "exists = leading blocks of the prompt the pool held when asked (LOOKUP)",
        f"loaded = of those, blocks that arrived whole with the right bytes within {opt.deadline_ms:g} ms "
        "(and every earlier block too)",
        f"useful = loaded blocks of requests whose load beat recomputing them at {opt.prefill_tokens_per_s:g} "
        f"tokens/s; a load takes {load}",
    ]
DATASET_BLOCK_TOKENS = (16, 256)


def load_dataset(name: str, block_tokens: int | None) -> Trace:
    """A bundled real workload by name, at 16- or 256-token blocks (default 256)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; bundled: {sorted(DATASETS)}")
    bt = block_tokens or 256
    if bt not in DATASET_BLOCK_TOKENS:
        raise ValueError(f"--dataset {name} is bundled at --block-tokens {DATASET_BLOCK_TOKENS}, not {bt}")
    return load_trace(DATASETS[name].format(bt))


def print_side_by_side(results: dict[str, dict[str, Any]], out=None) -> None:
    """Per capacity and policy: prefix-only pool, then prefix+chunk pool (prefix | chunk), token rates; bounds."""
    out = out or sys.stdout
    pre, ch = results.get("prefix"), results.get("chunk")
    base = pre or ch
    if base is None or not base["points"]:
        return
    pols = list(base["points"][0]["sim"])
    print(f"\n{base['trace']}: prefix and chunk levels side by side, token hit rates, {base['shards']} shard(s); "
          f"R = measured on real servers, else simulated", file=out)
    print(f"  {PREFIX_DEFINITION}\n  {CHUNK_DEFINITION}", file=out)
    print(f"{'capacity':>8} {'policy':>11} {'prefix-only pool':>17} {'prefix+chunk pool: prefix':>26} {'chunk':>8}",
          file=out)
    for k, row in enumerate(base["points"]):
        prow = pre["points"][k] if pre else None
        crow = ch["points"][k] if ch else None

        def cell(r: dict | None, pol: str, level: str) -> str:
            if r is None:
                return "-"
            real = r["real"].get(pol)
            if real is not None and (level == "prefix" or real.get("chunk_levels")):
                lv = real["levels"] if level == "prefix" else real["chunk_levels"]
                return f"{lv['exists']['token_hit_rate']:.1%}R"
            key = "token_hit_rate" if level == "prefix" else "chunk_token_hit_rate"
            return f"{r['sim'][pol][key]:.1%} "

        for pol in pols:
            print(f"{row['capacity_fraction']:>8.0%} {pol:>11} {cell(prow, pol, 'prefix'):>17} "
                  f"{cell(crow, pol, 'prefix'):>26} {cell(crow, pol, 'chunk'):>8}", file=out)
        bp = f"{prow['belady_tokens']:.1%} " if prow else "-"
        ip = f"{prow['infinite_tokens']:.1%} " if prow else "-"
        cm = crow.get("chunk_mode") if crow else None
        for name, p_only in (("belady", bp), ("infinite", ip)):
            c_pre = f"{cm[name]['prefix_token_hit_rate']:.1%} " if cm else "-"
            c_ch = f"{cm[name]['chunk_token_hit_rate']:.1%} " if cm else "-"
            print(f"{'':>8} {name:>11} {p_only:>17} {c_pre:>26} {c_ch:>8}", file=out)
    if ch:
        print("belady in the prefix+chunk pool is MIN over both key streams: a reference, not a proven bound on the "
              "chunk level", file=out)


def plot_modes(results: dict[str, dict[str, Any]], path: str | Path, title: str) -> None:
    """Token hit rate vs capacity: prefix level (prefix-only pool) and chunk level (prefix+chunk pool)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, results[m]) for m in KEY_MODES if m in results]
    # One y scale for both panels, from 0, so the prefix level is read against the chunk level.
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 5.4), squeeze=False, sharey=True)
    for ax, (mode, res) in zip(axes[0], panels):
        pts = res["points"]
        xs = [p["capacity_fraction"] * 100 for p in pts]
        level = "token_hit_rate" if mode == "prefix" else "chunk_token_hit_rate"
        if mode == "prefix":
            ax.plot(xs, [p["infinite_tokens"] * 100 for p in pts], "k:", label="infinite")
            ax.plot(xs, [p["belady_tokens"] * 100 for p in pts], "k--", label="Belady (offline bound)")
        else:
            ax.plot(xs, [p["chunk_mode"]["infinite"]["chunk_token_hit_rate"] * 100 for p in pts], "k:",
                    label="infinite")
            ax.plot(xs, [p["chunk_mode"]["belady"]["chunk_token_hit_rate"] * 100 for p in pts], "k--",
                    label="MIN over both key streams (reference)")
            ax.plot(xs, [p["sim"][next(iter(p["sim"]))]["token_hit_rate"] * 100 for p in pts], "-", color="0.6",
                    label=f"prefix level in this pool ({next(iter(pts[0]['sim']))})")
        pols = list(pts[0]["sim"]) if pts else []
        for i, pol in enumerate(pols):
            # Each policy its own colour, line style and marker, so equal curves (lru and tail-lru often
            # coincide) stay visible: the later one is drawn thinner on top of the earlier one.
            ls, mk = POLICY_STYLES[i % len(POLICY_STYLES)]
            ax.plot(xs, [p["sim"][pol][level] * 100 for p in pts], linestyle=ls, marker=mk, markersize=4,
                    linewidth=2.4 - 1.6 * i / max(1, len(pols) - 1), color=f"C{i}", label=pol, zorder=2 + i)
            rx, ry = [], []
            # measured points side by side (a small x offset per policy), not on top of each other
            shift = 1.0 + 0.04 * (i - (len(pols) - 1) / 2)
            for p in pts:
                real = p["real"].get(pol)
                if real is not None:
                    lv = real["levels"] if mode == "prefix" else real.get("chunk_levels")
                    if lv:
                        rx.append(p["capacity_fraction"] * 100 * shift)
                        ry.append(lv["exists"]["token_hit_rate"] * 100)
            if rx:
                ax.plot(rx, ry, linestyle="none", marker=mk, color=f"C{i}", markersize=8, markerfacecolor="none",
                        markeredgewidth=1.5, label=f"{pol} measured", zorder=10 + i)
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("pool capacity (% of unique prefix blocks, log scale)")
        if mode == "prefix":
            ax.set_ylabel("prefix hit rate (% of prompt tokens)")
            ax.set_title(f"{res['trace']}: prefix keys (loadable)", fontsize=10)
        else:
            ax.set_ylabel("chunk hit beyond the prefix hit (% of prompt tokens)")
            ax.set_title(f"{res['trace']}: + chunk keys (reusable with blending)", fontsize=10)
        ax.tick_params(labelleft=True)
        ax.grid(True, which="both", alpha=0.3)
        # Below the panel: inside, it always covers some curve.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    top = max(max(line.get_ydata(), default=0) for ax in axes[0] for line in ax.get_lines())
    axes[0][0].set_ylim(0, max(1.0, top * 1.08))  # shared: both panels from 0, one scale
    fig.suptitle(title + "\nlines: offline simulation of the server's policies; hollow markers: measured on real "
                 "servers (exists level)",
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench rag",
                                description="The main job: replay a RAG workload (real or generated) on real servers, "
                                            "prefix and chunk key modes, plot.")
    p.add_argument("--dataset", choices=sorted(DATASETS), default=None,
                   help="replay a bundled real workload (musique: 150 MuSiQue questions x 10 passages) instead of "
                        "generating one; --block-tokens 16 or 256 (default 256)")
    p.add_argument("--out-dir", default="bench-results", help="where the trace, JSON and PNG go (default bench-results)")
    p.add_argument("--capacity", "--dram-capacity", dest="capacity", type=float, default=0.1,
                   help="pool (DRAM) capacity for the real replay (default 0.1)")
    p.add_argument("--capacities", type=_floats, default=[0.01, 0.05, 0.1, 0.25, 0.5],
                   help="simulated capacities for the plot (default 0.01,0.05,0.1,0.25,0.5)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default all)")
    ragtrace.add_arguments(p)
    add_common_arguments(p, block_tokens=False)
    # the main job models a real engine's KV size for the useful level (kvfabric bench replay does not)
    p.set_defaults(kv_bytes_per_token=LLAMA31_8B_BYTES_PER_TOKEN)
    args = p.parse_args(argv)
    exit_on_sigterm()
    policies = [x for x in args.policies.split(",") if x]
    t0 = time.perf_counter()
    cfg = None
    try:
        for pol in policies:
            if pol not in POLICIES:
                raise ValueError(f"unknown policy {pol!r}; known: {sorted(POLICIES)}")
        if not args.capacities:
            raise ValueError("--capacities must name at least one fraction")
        for c in args.capacities + [args.capacity]:
            if not 0 < c <= 10:
                raise ValueError(f"capacities are fractions in (0, 10], got {c}")
        if args.key_mode == "both" or (args.key_mode is None and args.dataset):
            modes = list(KEY_MODES)
        else:
            modes = [args.key_mode or "prefix"]
        spread = (4 if args.dataset else 0) if args.spread is None else args.spread
        opts = {m: options_from_args(args, policies=policies, capacity=args.capacity, key_mode=m, spread=spread)
                for m in modes}
        for o in opts.values():
            o.validate()
        if args.dataset:
            trace = load_dataset(args.dataset, args.block_tokens)
        else:
            cfg = ragtrace.config_from_args(args)
            trace = ragtrace.generate(cfg)
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench rag: {e}", file=sys.stderr)
        return 2
    if args.limit:
        trace = trace.head(args.limit)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        write_trace(out / "rag-trace.jsonl", trace.requests, trace.block_tokens)
        where = f" -> {out / 'rag-trace.jsonl'}"
    else:
        where = f" (bundled dataset {args.dataset})"
    print(f"{trace.name}: {len(trace)} requests, {trace.total_blocks} block accesses, {trace.unique_blocks} unique "
          f"blocks of {trace.block_tokens} tokens, {trace.unique_chunk_blocks} unique chunk blocks{where}")
    print("hit-rate levels (per request, token-weighted in the tables):")
    for line in level_definitions(opts[modes[0]]):
        print("  " + line)
    results: dict[str, dict[str, Any]] = {}
    try:
        for m, opt in opts.items():
            if m == "chunk" and not trace.has_chunks:
                print(f"kvfabric bench rag: {trace.name} has no chunks; skipping the chunk key mode", file=sys.stderr)
                continue
            results[m] = sweep_trace(trace, args.capacities, policies, [args.capacity], opt)
    except RuntimeError as e:
        print(f"kvfabric bench rag: {e}", file=sys.stderr)
        return 1
    for m, res in results.items():
        for rep in res["replays"]:
            print(f"\n== key mode {m} ==")
            print_report(rep)
        if m == "prefix":
            print_sweep(res)
    print_side_by_side(results)
    print("levels:")
    for line in level_definitions(opts[modes[0]]):
        print("  " + line)
    doc: dict[str, Any] = {"modes": results, "dataset": args.dataset}
    if cfg is not None:
        doc["generator"] = asdict(cfg)
    # The single-mode view older readers of rag.json expect (points, replays, ...) is the prefix mode's.
    doc.update(results.get("prefix", {}))
    (out / "rag.json").write_text(json.dumps(doc, indent=1, default=str))
    title = f"kvfabric bench rag{' --dataset ' + args.dataset if args.dataset else ''}, {opts[modes[0]].shards} shard(s)"
    try:
        plot_modes(results, out / "rag.png", title)
    except ImportError:
        return int(not plot_or_explain([], out / "rag.png", title, "kvfabric bench rag", out / "rag.json"))
    print(f"\nwrote {out / 'rag.json'} and {out / 'rag.png'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
