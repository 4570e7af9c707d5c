"""The vLLM benchmarks (``benchmarks/vllm_ttft.py``, ``pd.py``, ``vllm_guard.py``) run at their smallest on real vLLM;
``benchmarks/gpu_transfer.py`` (the connector's transfer core, torch only) on host tensors.

Smoke runs for ``tests/integration/test_bench_smoke.py``'s ``SMOKED`` table:
each benchmark is run as the README runs it (``python benchmarks/<name>.py``,
a subprocess from the repository root) on one pool server, one 300-token
prompt (two whole 128-token chunks), one repeat, the session's tiny Llama.
Asserted: exit 0, the JSON's structure, and what the engines report
deterministically (vLLM's own prefix-cache hit); never a speed, and never
that a pool load finished inside a time window.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOKENS = 300
LOADABLE = (TOKENS - 1) // 128 * 128   # whole chunks: the last prompt token is always computed
BENCH_TIMEOUT_S = 900


def _run(name: str, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                  f"--- stderr\n{proc.stderr[-6000:]}")
    assert f"wrote {out}" in proc.stdout, proc.stdout[-6000:]
    return json.loads(out.read_text())


def test_vllm_ttft_smoke(tiny_model, tmp_path):
    """With the trace on (the default: what broke when client.py was split), every sample carries it."""
    rep = _run("vllm_ttft", ["--model", tiny_model, "--lengths", str(TOKENS), "--repeats", "1", "--servers-n", "1",
                             "--capacity", "64MiB"], tmp_path / "vllm_ttft.json")
    (row,) = rep["rows"]
    assert row["tokens"] == TOKENS, row
    for name in ("cold", "cold_with_connector", "pool_hit", "local_hit"):
        assert row[f"{name}_ms_min"] > 0 and row[f"{name}_ms_median"] > 0, row
    assert row["local_hit_cached_tokens"] == LOADABLE, row
    assert 0 <= row["pool_hit_cached_tokens"] <= LOADABLE, row
    assert row["pool_over_local"] > 0 and row["cold_over_pool"] > 0, row
    pool, local = rep["pool_engine"], rep["local_engine"]
    assert pool["counters"]["save_jobs"] > 0, pool["counters"]
    assert local["counters"] is None, local
    for eng in (pool, local):
        (s,) = eng["samples"]
        t = s["hit_trace"]
        assert {"total_ms", "checksum_ms", "steps", "forwards", "events", "gc_ms"} <= set(t), t
        assert t["steps"] >= 1 and t["forwards"] >= 1, t
    pool_trace = pool["samples"][0]["hit_trace"]
    assert "lookup_ms" in pool_trace, pool_trace   # the connector's lookup was wrapped and ran
    if row["pool_hit_cached_tokens"] == LOADABLE:   # the hit loaded from the pool: the load was traced
        assert pool_trace["load_chunks"] >= 1 and pool_trace["load_bytes"] > 0 and pool_trace["transport"], pool_trace


def test_pd_smoke(tiny_model, tmp_path):
    rep = _run("pd", ["--model", tiny_model, "--lengths", str(TOKENS), "--repeats", "1", "--servers-n", "1",
                      "--capacity", "64MiB"], tmp_path / "pd.json")
    (row,) = rep["rows"]
    assert row["tokens"] == TOKENS, row
    for name in ("prefill", "local_hit", "pd"):
        assert row[f"{name}_ms_min"] > 0 and row[f"{name}_ms_median"] > 0, row
    assert 0 <= row["pd_cached_tokens"] <= LOADABLE and row["local_cached_tokens"] == LOADABLE, row
    (p,) = rep["producer"]["samples"]
    assert p["kv_transfer_params"], p   # what the PD proxy hands the consumer
    assert rep["producer"]["counters"]["save_jobs"] > 0, rep["producer"]["counters"]
    (c,) = rep["consumer"]["samples"]
    assert c["pd_s"] > 0 and c["local_s"] > 0, c


def test_gpu_transfer_smoke(tmp_path):
    """The GPU transfer benchmark's cells on host tensors (``--device cpu``; no GPU here): the pool path
    saves and loads, and the loaded blocks are byte-identical to the saved ones."""
    rep = _run("gpu_transfer", ["--device", "cpu", "--layers", "2", "--blocks", "16", "--chunks", "4",
                                "--heads", "2", "--head-size", "16", "--repeat", "1", "--capacity", "16MiB"],
               tmp_path / "gpu_transfer.json")
    assert rep["device_kind"] == "cpu" and rep["bytes_exact_after_load"] is True, rep
    assert set(rep["gbps"]) == {"memcpy-d2h", "memcpy-h2d", "gather", "scatter", "save", "load", "cpu-put",
                                "cpu-get"}, rep
    assert all(v > 0 for v in rep["gbps"].values()), rep
    assert rep["batch_bytes"] == 4 * 2 * rep["page_bytes"] and rep["transport"] not in ("-", "?"), rep


def test_vllm_guard_smoke(tiny_model, tmp_path):
    """The load guard's benchmark at one delay (none), one repeat: four engines (the saving one and one
    per mode). Deterministic: recompute loads nothing; guard off loads every whole chunk of the saved
    prompt; guard on either loads it all or skips it all, and counts what it decided."""
    rep = _run("vllm_guard", ["--model", tiny_model, "--delays", "0", "--length", str(TOKENS), "--repeats", "1",
                              "--warm", "1"], tmp_path / "vllm_guard.json")
    assert set(rep["runs"]) == {"0.0/recompute", "0.0/guard_off", "0.0/guard_on"}, sorted(rep["runs"])
    for name, run in rep["runs"].items():
        assert len(run["ttft_s"]) == 1 and run["ttft_s"][0] > 0, (name, run)
    assert rep["runs"]["0.0/recompute"]["cached"] == [0], rep["runs"]["0.0/recompute"]
    assert rep["runs"]["0.0/guard_off"]["cached"] == [LOADABLE], rep["runs"]["0.0/guard_off"]
    on = rep["runs"]["0.0/guard_on"]
    assert on["cached"] in ([0], [LOADABLE]), on
    assert on["counters"]["loads_guarded"] >= 1, on["counters"]
