"""Every benchmark under benchmarks/ runs in CI at tiny sizes, so a refactor cannot break one silently.

``SMOKED`` names, for each ``benchmarks/<name>.py``, the test that runs it
small and checks its JSON (here, in the older ``test_bench_*.py`` files, or,
for those that need an engine, under tests/e2e/vllm and tests/e2e/lmcache,
which scripts/ci-vllm.sh and scripts/ci-lmcache.sh run in their own
virtualenvs). A new benchmark without an entry fails
:func:`test_every_benchmark_has_a_smoke_run`. Speed is never asserted: only
that the command completes and reports what its JSON says it does.
"""

from __future__ import annotations

import ast
import json
import runpy
import sys
from pathlib import Path

import pytest

from kvfabric import transport
from kvfabric.bench import keys, redis, shared_tier, vllm_ttft

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "native" in transport.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"the C extension: {transport.unavailable().get('native')}")

#: benchmarks/<name>.py -> the test that runs it small ("path::function", from the repository root)
SMOKED = {
    "get_cpu": "tests/integration/test_bench_get_cpu.py::test_get_cpu_quick_writes_table_and_json",
    "gpu_transfer": "tests/e2e/vllm/test_bench_smoke.py::test_gpu_transfer_smoke",
    "keys": "tests/integration/test_bench_smoke.py::test_keys_smoke",
    "kv_events": "tests/integration/test_bench_smoke.py::test_kv_events_smoke",
    "lmcache_backend": "tests/e2e/lmcache/test_bench_smoke.py::test_lmcache_backend_smoke",
    "lookup": "tests/integration/test_bench_server.py::test_bench_lookup_measures_both_servers_beside_ping",
    "pd": "tests/e2e/vllm/test_bench_smoke.py::test_pd_smoke",
    "placement": "tests/integration/test_bench_placement.py::test_placement_smoke",
    "rag": "tests/integration/test_replay.py::test_rag_main_job_small",
    "ragdata": "tests/unit/test_ragdata.py::test_cli_writes_loadable_traces_byte_for_byte_again",
    "redis": "tests/integration/test_bench_smoke.py::test_redis_smoke",
    "replay": "tests/integration/test_replay.py::test_replay_cli_against_running_servers",
    "serve": "tests/e2e/vllm/test_serve_bench.py::test_serve_bench_smoke",
    "shared_tier": "tests/integration/test_bench_smoke.py::test_shared_tier_smoke",
    "startup": "tests/integration/test_bench_server.py::test_bench_startup_races_a_client_against_a_fresh_server",
    "sweep": "tests/integration/test_replay.py::test_sweep_cli_small",
    "tier": "tests/integration/test_bench_tier.py::test_bench_tier_quick_measures_real_servers",
    "transport": "tests/integration/test_client_bench.py::test_bench_transport_quick_writes_table_and_json",
    "transport_native": "tests/integration/test_bench_server.py::test_bench_transport_native_says_why_redis_is_missing",
    "vllm_guard": "tests/e2e/vllm/test_bench_smoke.py::test_vllm_guard_smoke",
    "vllm_ttft": "tests/e2e/vllm/test_bench_smoke.py::test_vllm_ttft_smoke",
}
WRAPPERS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_has_a_smoke_run():
    assert WRAPPERS == sorted(SMOKED), (
        f"benchmarks/ holds {WRAPPERS}, SMOKED lists {sorted(SMOKED)}: give a new benchmark a tiny run "
        "(a test that calls it with its smallest flags and checks its JSON) and name it in SMOKED")
    for name, where in SMOKED.items():
        path, func = where.split("::")
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert func in defined, f"{name}: {where} names no test function in {path} (defined: {sorted(defined)})"


@pytest.mark.parametrize("name", WRAPPERS)
def test_each_wrapper_is_its_modules_main_and_parses_help(name, monkeypatch, capsys):
    """``benchmarks/<name>.py`` is ``kvfabric bench <name>``: it imports that main and its ``--help`` exits 0."""
    path = ROOT / "benchmarks" / f"{name}.py"
    source = path.read_text()
    assert f"from kvfabric.bench.{name} import main" in source, f"{path} is not a wrapper of kvfabric.bench.{name}"
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(path), run_name="__main__")
    captured = capsys.readouterr()
    assert exc.value.code == 0, f"{path} --help exited {exc.value.code}:\n{captured.out}\n{captured.err}"
    assert "usage:" in captured.out, captured.out


def test_keys_smoke(tmp_path, capsys):
    out = tmp_path / "keys.json"
    rc = keys.main(["--prompt-tokens", "256", "--block-tokens", "16", "--min-time", "0.01", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    assert report["benchmark"] == "keys" and report["rows"], report
    algorithms = {a.value for a in keys.KeyAlgorithm}
    assert {r["algorithm"] for r in report["rows"]} == algorithms, report
    for r in report["rows"]:
        assert (r["prompt_tokens"], r["block_tokens"]) == (256, 16), r
        assert r["list_mtok_s"] > 0 and r["numpy_mtok_s"] > 0 and r["ceiling_mtok_s"] > 0, r


@needs_native
def test_redis_smoke(tmp_path, capsys):
    """``kvfabric bench redis`` completes with or without Redis installed: a measured row or the reason it is not."""
    out = tmp_path / "redis.json"
    rc = redis.main(["--size", "64KiB", "--duration", "0.05", "--repeat", "1", "--capacity", "16MiB",
                     "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    names = {(r["name"], r["op"]) for r in report["rows"]}
    assert {("native", "get"), ("native", "put")} <= names, report
    why = redis.unavailable()
    if why is None:
        assert ("redis", "get") in names and "redis" not in report["meta"]["skipped"], report
    else:
        assert report["meta"]["skipped"]["redis"] == why and "skipped redis" in text, report


@needs_native
def test_shared_tier_smoke(tmp_path, capsys):
    out = tmp_path / "shared_tier.json"
    rc = shared_tier.main(["--dir", str(tmp_path), "--sizes", "64KiB", "--count", "4", "--fsync", "never",
                           "--token", "off,on", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = json.loads(out.read_text())
    assert [r["token"] for r in rows] == [False, True], rows
    for row in rows:
        assert (row["size"], row["count"], row["fsync"]) == (64 << 10, 4, "never"), row
        assert row["shared_hits"] == 4 and row["shared_write_drops"] == 0 and row["shared_mac_refused"] == 0, row
        assert row["put_mb_s_shared"] > 0 and row["get_mb_s_from_shared"] > 0 and row["get_mb_s_from_dram"] > 0, row
        assert row["hmac_us"] > 0 and row["hmac_us_openssl"] > 0, row
    assert [p.name for p in tmp_path.iterdir()] == ["shared_tier.json"], "the shared directory was left behind"


def test_vllm_ttft_trace_times_the_clients_checksums_where_they_are_now(monkeypatch):
    """The TTFT trace's kvfabric target exists and is the function a verifying GET calls (no vLLM needed:
    the whole trace runs in tests/e2e/vllm/test_bench_smoke.py)."""
    from kvfabric import Client, ClientConfig
    from kvfabric.testing.servers import start_pool

    trace = vllm_ttft._Trace()
    trace.install_client()
    try:
        with start_pool(1, capacity="8MiB") as pool, Client(
                pool.addresses, config=ClientConfig(transport="tcp", verify_checksums=True)) as c:
            key, value = b"k" * 16, bytes(range(256)) * 64
            assert c.put([key], [value]).stored == 1
            buf = bytearray(len(value))
            assert c.get_into([key], [buf]) == [len(value)] and buf == value
    finally:
        trace.remove()
    assert trace.checksum_s > 0, (f"a verifying tcp GET did not call {'.'.join(vllm_ttft._Trace.CHECKSUM)}: the "
                                  "client checks checksums elsewhere now; point _Trace.CHECKSUM there")

    import kvfabric._reads as reads

    monkeypatch.delattr(reads, "_object_checksum")
    with pytest.raises(vllm_ttft.TraceTargetMissing, match=r"kvfabric\._reads\._object_checksum not found"):
        vllm_ttft._Trace().install_client()


@needs_native
def test_kv_events_smoke(tmp_path, capsys):
    """Three real servers (events off, on with a reader, on with a subscriber that never reads): every PUT
    answered, the reader received every event the server published, nothing lost."""
    pytest.importorskip("zmq")
    from kvfabric.bench import kv_events

    out = tmp_path / "kv_events.json"
    assert kv_events.main(["--puts", "300", "--dram-mib", "1", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = {r["config"]: r for r in rep["rows"]}
    assert set(rows) == {"off", "on", "stuck"}, rows
    for r in rows.values():
        assert r["puts"] == 300 and r["dropped"] == 0 and r["evictions"] > 0, r
    assert rows["on"]["received"] == rows["on"]["events"] > 0 and rows["on"]["lost"] == 0, rows["on"]
    assert rows["stuck"]["events"] > 0 and rows["off"]["events"] is None, rows
    assert "vs off" in capsys.readouterr().out
