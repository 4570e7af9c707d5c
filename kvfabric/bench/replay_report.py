"""The replay report's tables: :func:`print_report` (one row per policy: the three levels, the gap
closed, latencies; tier and sharding-spread lines) and :func:`print_chunk_levels` (prefix and chunk
levels side by side, with the definitions :data:`PREFIX_DEFINITION` and :data:`CHUNK_DEFINITION`).
Shared by ``kvfabric bench replay``, ``sweep`` and ``rag``; the report itself is built by
:func:`kvfabric.bench.replay.run_replay`.
"""

from __future__ import annotations

import sys
from typing import Any

from ._tiers import print_tiers
from .simulate import gap_closed


def print_report(report: dict[str, Any], out=None, weighting: str = "both") -> None:
    """The table: one row per policy, three levels, bound, gap, latencies.

    ``weighting="both"`` shows block and token hit rates (header and gap
    block-weighted, as ``kvfabric bench replay`` and ``sweep`` report them);
    ``"token"`` shows token rates only, with the header's bounds, the gap and
    the sharding spread token-weighted too (``kvfabric bench rag``).
    """
    if weighting not in ("both", "token"):
        raise ValueError(f"weighting is 'both' or 'token', not {weighting!r}")
    out = out or sys.stdout
    tok = weighting == "token"
    rate = "token_hit_rate" if tok else "block_hit_rate"
    print(f"trace {report['trace']}: {report['requests']} requests, {report['total_blocks']} blocks "
          f"({report['unique_blocks']} unique) of {report['block_tokens']} tokens; capacity "
          f"{report['capacity_blocks']} blocks = {report['capacity_fraction']:.1%} of unique; "
          f"{report['block_bytes']} B/block; belady {report['belady'][rate]:.1%}, "
          f"infinite {report['infinite'][rate]:.1%} "
          f"({'prefix hits, token-weighted' if tok else 'block-level prefix hits'})", file=out)
    w = 7 if tok else 13
    head = (f"{'policy':>11} {'exists':>{w}} {'loaded':>{w}} {'useful':>{w}} {'gap':>5} {'lookup p50/p99':>15} "
            f"{'get p50/p99':>15} {'put p50/p99':>15} {'req/s':>6} {'GB moved':>8} {'sim':>5}")
    print(head, file=out)
    if tok:
        print(f"{'':>11} {'(% of prompt tokens)':>{3 * w + 2}}", file=out)
    else:
        print(f"{'':>11} {'(blk / tok)':>13} {'(blk / tok)':>13} {'(blk / tok)':>13}", file=out)

    def lv(x: dict) -> str:
        return f"{x['token_hit_rate']:.1%}" if tok else f"{x['block_hit_rate']:6.1%}/{x['token_hit_rate']:5.1%}"

    def ms(x: dict) -> str:
        if x["p50_ms"] is None:
            return "-"
        return f"{x['p50_ms']:.2f}/{x['p99_ms']:.2f}"

    lru = next((r for r in report["runs"] if r["policy"] == "lru" and r.get("admit") in (None, "off")), None)
    for r in report["runs"]:
        g = r.get("gap_closed")
        if tok:  # the same gap, over token rates (block-weighted in run_replay's report)
            tiered = r.get("admit") not in (None, "off")  # more capacity than Belady's: no gap to speak of
            g = None if lru is None or tiered else gap_closed(
                r["levels"]["exists"][rate], lru["levels"]["exists"][rate], report["belady"][rate])
        sim = r.get("sim")
        simtxt = "-" if sim is None else ("ok" if sim["requests_differing"] == 0 else
                                          f"{sim['requests_differing']}/{sim.get('requests', '?')}d")
        gb = (r["bytes"]["get_bytes"] + r["bytes"]["put_bytes"]) / 1e9
        print(f"{r.get('label', r['policy']):>11} {lv(r['levels']['exists']):>{w}} {lv(r['levels']['loaded']):>{w}} "
              f"{lv(r['levels']['useful']):>{w}} {'-' if g is None else f'{round(g, 2) + 0.0:.0%}':>5} {ms(r['latency']['lookup']):>15} "
              f"{ms(r['latency']['get']):>15} {ms(r['latency']['put']):>15} {r['requests_per_s']:>6.0f} {gb:>8.2f} "
              f"{simtxt:>5}", file=out)
    print("gap = share of the LRU-to-Belady gap closed (exists level); sim = offline simulator agrees "
          "request by request", file=out)
    if any("ssd" in r or "admit" in r and r["admit"] for r in report["runs"]):
        print_tiers(report, out)
    for r in report["runs"]:
        sp = r.get("sharding_spread")
        if sp:
            lo, hi = sp[rate]
            chunk = ""
            if "chunk_token_hit_rate" in sp and "chunk_levels" in r:
                clo, chi = sp["chunk_token_hit_rate"]
                chunk = (f"; chunk tokens {r['chunk_levels']['exists']['token_hit_rate']:.2%} measured, "
                         f"{clo:.2%}..{chi:.2%} offline")
            print(f"  {r['policy']}: exists {r['levels']['exists'][rate]:.2%} measured; "
                  f"{lo:.2%}..{hi:.2%} offline over {sp['server_id_sets']} other server-id sets (sharding spread"
                  f"{', tokens' if tok else ''}){chunk}", file=out)
    for r in report["runs"]:
        trouble = {k: v for k, v in r.get("transport", {}).get("control", {}).items() if v}
        if trouble:
            print(f"  {r['policy']}: transport trouble on LOOKUP/PUT {trouble}: its exists level is not the policy's "
                  f"alone", file=out)
    if any("chunk_levels" in r for r in report["runs"]):
        print_chunk_levels(report, out)


PREFIX_DEFINITION = ("prefix = leading prompt blocks the pool holds under prefix keys: loadable as they are "
                     "(the hit rate an engine gets today)")
CHUNK_DEFINITION = ("chunk  = passage tokens past the prefix hit that the pool holds under position-independent "
                    "chunk keys: reusable only with blending (CacheBlend-style selective recompute), never a "
                    "loadable hit")


def print_chunk_levels(report: dict[str, Any], out=None) -> None:
    """Prefix and chunk levels side by side (token rates), with the one-line definition of each."""
    out = out or sys.stdout
    ref = report.get("chunk_reference")
    print(f"key mode prefix+chunk: the pool holds prefix keys and every passage's chunk keys "
          f"(same capacity, {report['capacity_blocks']} blocks); token hit rates", file=out)
    print(f"{'policy':>11} {'prefix exists':>13} {'loaded':>7} {'useful':>7} | {'chunk exists':>12} {'loaded':>7} "
          f"{'useful':>7} | {'sim':>5}", file=out)
    for r in report["runs"]:
        lv, cl = r["levels"], r.get("chunk_levels")
        if cl is None:
            continue
        sim = r.get("sim")
        simtxt = "-" if sim is None else (
            "ok" if sim["requests_differing"] == 0 and sim.get("chunk_agrees", True) else "differ")
        print(f"{r.get('label', r['policy']):>11} {lv['exists']['token_hit_rate']:>13.1%} {lv['loaded']['token_hit_rate']:>7.1%} "
              f"{lv['useful']['token_hit_rate']:>7.1%} | {cl['exists']['token_hit_rate']:>12.1%} "
              f"{cl['loaded']['token_hit_rate']:>7.1%} {cl['useful']['token_hit_rate']:>7.1%} | {simtxt:>5}", file=out)
    if ref:
        for name in ("belady", "infinite"):
            print(f"{name:>11} {ref[name]['prefix']['token_hit_rate']:>13.1%} {'':>7} {'':>7} | "
                  f"{ref[name]['chunk']['token_hit_rate']:>12.1%}", file=out)
    print(PREFIX_DEFINITION, file=out)
    print(CHUNK_DEFINITION, file=out)
