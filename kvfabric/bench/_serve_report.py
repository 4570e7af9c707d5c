"""The serving benchmark's figures: what vLLM and the pool report, per run, and the table and plot.

Counters are read before and after each run and the difference kept, so a
run's figures are its own even on engines and pools that served earlier
runs: vLLM's ``/metrics`` of every instance (its prefix cache, the prompt
tokens by source: computed, local prefix-cache hit, loaded by a KV
connector; the kvfabric connector's ``vllm:kvfabric_*`` counters) and the
pool servers' STATS (GET keys hit and missed, puts, evictions, SSD hits).
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path
from typing import Any

from ._serve_load import Result

# vLLM counters summed over instances (and over label sets, except the by-source split)
VLLM_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "kvfabric_lookup_hit_tokens": "vllm:kvfabric_lookup_hit_tokens_total",
    "kvfabric_load_tokens": "vllm:kvfabric_load_tokens_total",
    "kvfabric_load_chunks": "vllm:kvfabric_load_chunks_total",
    "kvfabric_load_errors": "vllm:kvfabric_load_errors_total",
    "kvfabric_load_seconds": "vllm:kvfabric_load_seconds_sum",
    "kvfabric_save_chunks": "vllm:kvfabric_save_chunks_total",
}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
POOL_COUNTERS = ("hits", "misses", "puts", "evictions", "ssd_hits", "bytes_out")


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """One OpenAI server's /metrics: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def vllm_counters(urls: list[str]) -> dict[str, float]:
    """:data:`VLLM_COUNTERS` and ``tokens_<source>`` summed over the instances at ``urls``."""
    out = dict.fromkeys([*VLLM_COUNTERS, *(f"tokens_{s}" for s in SOURCES)], 0.0)
    for url in urls:
        samples = scrape(url)
        for (name, labels), v in samples.items():
            for key, metric in VLLM_COUNTERS.items():
                if name == metric:
                    out[key] += v
            if name == "vllm:prompt_tokens_by_source_total":
                src = dict(labels).get("source")
                if src in SOURCES:
                    out[f"tokens_{src}"] += v
    return out


def pool_counters(addresses: list[str]) -> dict[str, float]:
    """:data:`POOL_COUNTERS` summed over the pool servers' STATS, plus the objects they hold now."""
    from kvfabric import Client

    with Client(addresses) as c:
        servers = c.stats()["servers"]
    out = dict.fromkeys([*POOL_COUNTERS, "objects", "ssd_objects"], 0.0)
    for st in servers.values():
        for k in out:
            out[k] += float(st.get(k, 0) or 0)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` for every counter (gauges such as ``objects`` are kept as ``after``)."""
    return {k: (after[k] if k in ("objects", "ssd_objects") else after[k] - before.get(k, 0.0)) for k in after}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def summarize(results: list[Result], wall_s: float, reuse: set[int], vllm: dict[str, float],
              pool: dict[str, float] | None) -> dict[str, Any]:
    """One run's row: throughput, latency percentiles (ms), hit rates as vLLM and the pool report them.
    ``reuse`` holds the indexes of requests whose session had an earlier turn."""
    ok = [r for r in results if not r.error]
    ttft = [1e3 * r.ttft_s for r in ok]
    e2e = [1e3 * r.e2e_s for r in ok]
    ttft_reuse = [1e3 * r.ttft_s for r in ok if r.index in reuse]
    ttft_first = [1e3 * r.ttft_s for r in ok if r.index not in reuse]
    prompt = vllm["tokens_local_compute"] + vllm["tokens_local_cache_hit"] + vllm["tokens_external_kv_transfer"]
    row: dict[str, Any] = {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
        "ttft_ms_p50_reuse": _pct(ttft_reuse, 0.5), "ttft_ms_p50_first_turn": _pct(ttft_first, 0.5),
        "e2e_ms_p50": _pct(e2e, 0.5), "e2e_ms_p99": _pct(e2e, 0.99),
        "ttft_ms": sorted(ttft),
        "cached_tokens_usage": sum(r.cached_tokens for r in ok),
        "vllm": vllm,
        "vllm_prefix_hit_rate": vllm["prefix_hits"] / vllm["prefix_queries"] if vllm["prefix_queries"] else None,
        "vllm_external_hit_rate": (vllm["external_hits"] / vllm["external_queries"]
                                   if vllm["external_queries"] else None),
        "prefill_tokens": prompt,
        "prefill_computed_fraction": vllm["tokens_local_compute"] / prompt if prompt else None,
        "prefill_loaded_fraction": vllm["tokens_external_kv_transfer"] / prompt if prompt else None,
        "prefill_local_hit_fraction": vllm["tokens_local_cache_hit"] / prompt if prompt else None,
        "pool": pool,
        "pool_get_hit_rate": (pool["hits"] / (pool["hits"] + pool["misses"])
                              if pool and pool["hits"] + pool["misses"] else None),
        "errors_sample": [r.error for r in results if r.error][:3],
    }
    return row


def _f(v: Any, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _cpu(c: dict | None) -> str:
    return "-" if not c else f"{c['engines_s']:.0f}/{c['l2_s'] + c.get('router_s', 0.0):.1f}/{c['others_s']:.0f}"


def print_table(report: dict[str, Any], out=sys.stdout) -> None:
    """The per-run table, then the configurations that did not run and why."""
    hdr = (f"{'configuration':<44} {'load':>5} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} {'p99':>8} "
           f"{'reuse p50':>9} {'E2E p50':>8} {'p99':>8} {'vLLM hit':>8} {'loaded':>7} {'computed':>8} "
           f"{'pool hit':>8} {'err':>4} {'loadavg':>7} {'CPU s eng/L2/other':>19} {'tok/CPU s':>9}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for cfg in report["configs"]:
        if cfg.get("not_runnable"):
            continue
        for run in cfg["runs"]:
            print(f"{cfg['label']:<44} {run['load']:>5g} {run['requests_per_s']:>6.2f} "
                  f"{run['output_tokens_per_s']:>9.1f} {_f(run['ttft_ms_p50'], '9.0f'):>9} "
                  f"{_f(run['ttft_ms_p99'], '8.0f'):>8} {_f(run['ttft_ms_p50_reuse'], '9.0f'):>9} "
                  f"{_f(run['e2e_ms_p50'], '8.0f'):>8} {_f(run['e2e_ms_p99'], '8.0f'):>8} "
                  f"{_f(run['vllm_prefix_hit_rate'], '8.1%'):>8} {_f(run['prefill_loaded_fraction'], '7.1%'):>7} "
                  f"{_f(run['prefill_computed_fraction'], '8.1%'):>8} {_f(run['pool_get_hit_rate'], '8.1%'):>8} "
                  f"{run['errors']:>4} {run['loadavg'][0]:>7.1f} {_cpu(run.get('cpu')):>19} "
                  f"{_f(run.get('output_tokens_per_cpu_s'), '9.1f'):>9}", file=out)
    print("load: closed-loop sessions in flight (or open-loop speed-up); TTFT/E2E in ms; reuse p50: TTFT of "
          "later turns of a session; vLLM hit: its local prefix cache (hits/queries); loaded / computed: prompt "
          "tokens vLLM reports loaded by its KV connector / computed; pool hit: GET keys hit in the pool's STATS; "
          "loadavg: 1-minute load average at the run's end; CPU s: CPU seconds the level took in this "
          "configuration's engines / its L2 servers and router / everything else on the machine; tok/CPU s: output tokens "
          "per CPU second of the engines, L2 servers and router (moved less by other users' load)", file=out)
    for cfg in report["configs"]:
        for line in (cfg.get("not_runnable") or "").strip().splitlines():
            print(f"NOT RUN {cfg['label']}: {line}", file=out)
    slo = report.get("slo_ttft_ms")
    if slo:
        print(f"best output tok/s with TTFT p99 <= {slo:.0f} ms: " + ", ".join(
            f"{c['config']} {_f(c.get('best_at_slo'), '.1f', 'none')}" for c in report["configs"]
            if not c.get("not_runnable")), file=out)


def reuse_bound(report: dict[str, Any]) -> list[dict]:
    """Per load that vLLM alone ran at: the prompt tokens it computed, the least any cache could leave
    computed (what a cache of infinite capacity cannot serve: ``infinite_reuse_fraction``), and their
    quotient, the most a cache beneath it could cut prefill work by at that load."""
    reuse = report.get("workload", {}).get("infinite_reuse_fraction")
    alone = next((c for c in report["configs"] if c["config"] == "vllm" and c.get("runs")), None)
    if reuse is None or alone is None or reuse >= 1:
        return []
    return [{"load": r["load"], "vllm_computed": r["prefill_computed_fraction"], "least_computed": 1 - reuse,
             "prefill_cut_at_most": r["prefill_computed_fraction"] / (1 - reuse)}
            for r in alone["runs"] if r["prefill_computed_fraction"]]


def print_reuse_bound(report: dict[str, Any], out=sys.stdout) -> None:
    for b in report.get("reuse_bound", []):
        print(f"reuse bound at load {b['load']:g}: vLLM alone computed {b['vllm_computed']:.1%} of prompt tokens, "
              f"a cache of infinite capacity would leave {b['least_computed']:.1%}: no cache beneath it cuts "
              f"prefill work by more than {b['prefill_cut_at_most']:.2f}x on this workload (decode not counted)",
              file=out)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Throughput vs offered load per configuration, and the TTFT CDF at the highest load; ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, cfg in enumerate(c for c in report["configs"] if not c.get("not_runnable") and c["runs"]):
        runs = cfg["runs"]
        a1.plot([r["load"] for r in runs], [r["output_tokens_per_s"] for r in runs], "o-", color=f"C{i}",
                label=cfg["label"])
        xs = runs[-1]["ttft_ms"]
        if xs:
            a2.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", color=f"C{i}",
                    label=f"{cfg['label']} (load {runs[-1]['load']})")
    a1.set_xlabel(report["load_axis"])
    a1.set_ylabel("output tokens/s")
    a1.grid(True, alpha=0.3)
    a1.legend(fontsize=7)
    a2.set_xscale("log")
    a2.set_xlabel("TTFT (ms, log scale)")
    a2.set_ylabel("fraction of requests")
    a2.grid(True, which="both", alpha=0.3)
    a2.legend(fontsize=7)
    w = report["workload"]
    fig.suptitle(f"{w['trace']}: {w['requests']} requests in {w['sessions']} sessions, scale {w['scale']:g}, "
                 f"{report['instances']} vLLM instances (CPU); r = {_f(report['calibration'].get('r'), '.1f')} "
                 f"(whole prompt {_f(report['calibration'].get('r_at_max'), '.1f')}); "
                 f"load average {report['loadavg'][0]:.1f}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["delta", "plot", "pool_counters", "print_table", "scrape", "summarize", "vllm_counters"]
