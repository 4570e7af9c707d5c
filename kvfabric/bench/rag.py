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
figures' grid) with Belady and infinite for that key mode. Every rate it
prints is token-weighted (share of prompt tokens). Then it prints the prefix
level by capacity, with the chunk level beside it when the chunk key mode ran
(else one line saying how to get it), each with its one-line definition; last
the headline (the measured prefix level of lru at ``--capacity``, with Belady
and infinite), what the workload is (share of follow-up turns and the points
of reuse they carry, measured on the trace; the generator's templates and
documents) and, for the generator, the real RAG workload's figures beside it
(MuSiQue's reuse computed from the bundled trace, its measured rate quoted
with the command that measured it). It writes ``rag.json`` and ``rag.png``
to ``--out-dir``.

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
from .replay_report import CHUNK_DEFINITION, PREFIX_DEFINITION, print_report
from .sweep import _floats, plot_or_explain, sweep_trace
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


CHUNK_HOWTO = ("chunk levels not computed (prefix key mode only, the generator's default): add --key-mode both "
               "for a second replay with chunk keys (minutes here), or run --dataset musique (both modes by default)")


def print_side_by_side(results: dict[str, dict[str, Any]], out=None) -> None:
    """Per capacity and policy: prefix-only pool, then prefix+chunk pool (prefix | chunk), token rates; bounds.

    Without the chunk key mode the two chunk columns are left out and one
    line (:data:`CHUNK_HOWTO`) says how to get them.
    """
    out = out or sys.stdout
    pre, ch = results.get("prefix"), results.get("chunk")
    base = pre or ch
    if base is None or not base["points"]:
        return
    pols = list(base["points"][0]["sim"])
    if ch:
        print(f"\n{base['trace']}: prefix and chunk levels side by side, token hit rates, {base['shards']} shard(s); "
              f"R = measured on real servers, else simulated", file=out)
        print(f"  {PREFIX_DEFINITION}\n  {CHUNK_DEFINITION}", file=out)
        print(f"{'capacity':>8} {'policy':>11} {'prefix-only pool':>17} {'prefix+chunk pool: prefix':>26} "
              f"{'chunk':>8}", file=out)
    else:
        print(f"\n{base['trace']}: prefix level (exists) by capacity, token hit rates, {base['shards']} shard(s); "
              f"R = measured on real servers, else simulated", file=out)
        print(f"  {PREFIX_DEFINITION}", file=out)
        print(f"{'capacity':>8} {'policy':>11} {'prefix':>17}", file=out)
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
            line = f"{row['capacity_fraction']:>8.0%} {pol:>11} {cell(prow, pol, 'prefix'):>17}"
            if ch:
                line += f" {cell(crow, pol, 'prefix'):>26} {cell(crow, pol, 'chunk'):>8}"
            print(line, file=out)
        bp = f"{prow['belady_tokens']:.1%} " if prow else "-"
        ip = f"{prow['infinite_tokens']:.1%} " if prow else "-"
        cm = crow.get("chunk_mode") if crow else None
        for name, p_only in (("belady", bp), ("infinite", ip)):
            line = f"{'':>8} {name:>11} {p_only:>17}"
            if ch:
                c_pre = f"{cm[name]['prefix_token_hit_rate']:.1%} " if cm else "-"
                c_ch = f"{cm[name]['chunk_token_hit_rate']:.1%} " if cm else "-"
                line += f" {c_pre:>26} {c_ch:>8}"
            print(line, file=out)
    if ch:
        print("belady in the prefix+chunk pool is MIN over both key streams: a reference, not a proven bound on the "
              "chunk level", file=out)
    else:
        print(CHUNK_HOWTO, file=out)


#: the bundled real workload the synthetic headline is put beside, and the command that measured it
REAL_RAG = ("musique", 16)
REAL_RAG_COMMAND = "kvfabric bench rag --dataset musique --block-tokens 16"
#: quoted, not computed here: LRU at 10% through real servers, from REAL_RAG_COMMAND (docs/img/rag-musique-b16.txt)
REAL_RAG_MEASURED_LRU_10 = 0.013


def real_rag_reference() -> list[str]:
    """Lines on the real RAG workload: its reuse computed now from the bundled trace, its measured rate quoted."""
    from .belady import infinite_chunks

    try:
        tr = load_dataset(*REAL_RAG)
    except TraceError as e:  # a checkout without data/: say so instead of a figure
        return [f"real RAG for comparison: not available ({e})"]
    sh = ragtrace.workload_shares(tr)
    _, chunk = infinite_chunks(tr)
    return [f"real RAG for comparison: MuSiQue, {sh.requests} questions x 10 retrieved passages (data/rag/musique, "
            f"{tr.block_tokens}-token blocks), {sh.followup_share:.0%} follow-up turns: prefix reuse at infinite "
            f"capacity {sh.reuse_tokens:.1%} of prompt tokens, passages seen before at another position "
            f"{chunk.token_hit_rate:.1%} (chunk keys + blending); computed now from the bundled trace",
            f"  measured through real servers, LRU at 10%: prefix {REAL_RAG_MEASURED_LRU_10:.1%} (quoted from "
            f"`{REAL_RAG_COMMAND}`, docs/img/rag-musique-b16.txt)"]


def headline(results: dict[str, dict[str, Any]], capacity: float) -> str | None:
    """One line: the measured prefix level of lru (else the first policy) at ``capacity``, with the bounds."""
    res = results.get("prefix")
    if not res:
        return None
    row = next((p for p in res["points"] if abs(p["capacity_fraction"] - capacity) < 1e-12), None)
    if row is None or not row["real"]:
        return None
    pol = "lru" if "lru" in row["real"] else next(iter(row["real"]))
    lv = row["real"][pol]["levels"]
    return (f"headline: {res['trace']}, {pol} at {capacity:.0%} capacity, {res['shards']} shard(s), measured: prefix "
            f"hit {lv['exists']['token_hit_rate']:.1%} of prompt tokens (exists; loaded "
            f"{lv['loaded']['token_hit_rate']:.1%}, useful {lv['useful']['token_hit_rate']:.1%}); Belady "
            f"{row['belady_tokens']:.1%}, infinite {row['infinite_tokens']:.1%} (all token-weighted)")


def same_curves(ys: dict[str, list[float]], tol: float = 0.05) -> dict[str, str]:
    """Policies whose curve equals an earlier one's at every point (within ``tol`` points): {later: earlier}."""
    out: dict[str, str] = {}
    names = list(ys)
    for j, later in enumerate(names):
        for earlier in names[:j]:
            if earlier not in out and all(abs(x - y) <= tol for x, y in zip(ys[later], ys[earlier])):
                out[later] = earlier
                break
    return out


def plot_modes(results: dict[str, dict[str, Any]], path: str | Path, title: str) -> None:
    """Token hit rate vs capacity: prefix level (prefix-only pool) and chunk level (prefix+chunk pool).

    Laid out by matplotlib's constrained layout with the titles wrapped to
    the figure's width, so no text is clipped; every policy has its own
    colour, line style and marker, and a policy whose curve equals an
    earlier one's says so in the legend (lru and tail-lru often coincide).
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, results[m]) for m in KEY_MODES if m in results]
    # One y scale for both panels, from 0, so the prefix level is read against the chunk level.
    width = 6.4 * len(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 5.8), squeeze=False, sharey=True, layout="constrained")
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
        ys = {pol: [p["sim"][pol][level] * 100 for p in pts] for pol in pols}
        same = same_curves(ys)
        for i, pol in enumerate(pols):
            # Own colour, line style and marker (filled, then hollow, alternating); the later of equal curves
            # is drawn thinner on top of the earlier one, so both stay visible.
            ls, mk = POLICY_STYLES[i % len(POLICY_STYLES)]
            label = pol + (f" (= {same[pol]} within 0.05 points)" if pol in same else "")
            ax.plot(xs, ys[pol], linestyle=ls, marker=mk, markersize=7 - 2 * (i % 2),
                    markerfacecolor=f"C{i}" if i % 2 == 0 else "white", markeredgecolor=f"C{i}",
                    linewidth=3.2 - 2.2 * i / max(1, len(pols) - 1), color=f"C{i}", label=label, zorder=2 + i)
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
                ax.plot(rx, ry, linestyle="none", marker=mk, color=f"C{i}", markersize=9, markerfacecolor="none",
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
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    top = max(max(line.get_ydata(), default=0) for ax in axes[0] for line in ax.get_lines())
    axes[0][0].set_ylim(0, max(1.0, top * 1.08))  # shared: both panels from 0, one scale
    # ~0.075 inch per character at 9 pt: wrap every line of the title to the figure's width
    chars = int(width / 0.075)
    note = ("lines: offline simulation of the server's policies; hollow markers: measured on real servers "
            "(exists level); token-weighted")
    fig.suptitle("\n".join(textwrap.fill(t, chars) for t in (title, note)), fontsize=9)
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
    shares = ragtrace.workload_shares(trace)
    print(f"workload: {shares.line()}")
    if cfg is not None:
        print(f"  {ragtrace.describe(cfg)}")
    print("hit-rate levels (per request; every rate below is token-weighted: % of prompt tokens):")
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
            print_report(rep, weighting="token")
    print_side_by_side(results)
    print("levels:")
    for line in level_definitions(opts[modes[0]]):
        print("  " + line)
    head = headline(results, args.capacity)
    print()
    if head:
        print(head)
    print(f"  workload: {shares.line()}")
    if cfg is not None:
        print(f"  {ragtrace.describe(cfg)}")
    if args.dataset != REAL_RAG[0]:
        for line in real_rag_reference():
            print("  " + line)
    doc: dict[str, Any] = {"modes": results, "dataset": args.dataset, "workload": asdict(shares)}
    if cfg is not None:
        doc["generator"] = asdict(cfg)
    # The single-mode view older readers of rag.json expect (points, replays, ...) is the prefix mode's.
    doc.update(results.get("prefix", {}))
    (out / "rag.json").write_text(json.dumps(doc, indent=1, default=str))
    title = (f"kvfabric bench rag{' --dataset ' + args.dataset if args.dataset else ''}, "
             f"{opts[modes[0]].shards} shard(s): {shares.followup_share:.0%} follow-up turns, carrying "
             f"{shares.followup_reuse_tokens * 100:.1f} of the {shares.reuse_tokens * 100:.1f} points of prefix reuse")
    try:
        plot_modes(results, out / "rag.png", title)
    except ImportError:
        return int(not plot_or_explain([], out / "rag.png", title, "kvfabric bench rag", out / "rag.json"))
    print(f"\nwrote {out / 'rag.json'} and {out / 'rag.png'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
