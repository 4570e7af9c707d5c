"""The server benchmarks (startup, lookup, redis reference) run end to end at tiny settings and write their JSON.

No timing is asserted: only that each benchmark measures what it says, with
real server processes, and reports it in the fields the notes rely on.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvfabric import transport
from kvfabric.bench import lookup, redis, startup, transport_native

NATIVE = "native" in transport.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"the C extension: {transport.unavailable().get('native')}")


@pytest.mark.parametrize("server", ["python", pytest.param("native", marks=needs_native)])
def test_bench_startup_races_a_client_against_a_fresh_server(tmp_path, capsys, server):
    out = tmp_path / "startup.json"
    # generous limits: a machine that stalls (CI once saw a stop take over 30 s while the suite's other part
    # installed vLLM) is not a failure; a server that hangs is, with its threads' states in the error
    rc = startup.main(["--server", server, "--capacities", "8MiB,16MiB", "--trials", "1", "--out", str(out),
                       "--hello-timeout", "600", "--stop-timeout", "600"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["8MiB", "16MiB"]
    for row in report["rows"]:
        assert row["trials"] == 1 and row["ok"] == 1 and row["errors"] == []
        assert 0 < row["accept_p50_s"] <= row["hello_p50_s"] and row["listen_p50_s"] > 0
        assert row["rss_mib_p50"] > 0 and row["stop_p50_s"] is not None
    for cap, trials in report["trials"].items():
        (t,) = trials
        assert t["capacity"] == cap and t["hello_s"] >= t["accept_s"] and t["stalled"] in (True, False)
    assert [f["name"] for f in report["floors"]] == list(startup.FLOORS)
    assert all(f["p50_s"] > 0 for f in report["floors"])
    (target,) = report["targets"]
    assert target["cell"].startswith("first HELLO at 16MiB") and target["value_s"] == report["rows"][1]["hello_max_s"]
    assert "python -m" in report["meta"]["command"] and "HELLO p50" in capsys.readouterr().out


def test_bench_startup_reports_a_server_that_never_listens(tmp_path):
    out = tmp_path / "startup.json"
    rc = startup.main(["--server", "{python} -c 'import sys; sys.exit(3)'", "--capacities", "8MiB", "--trials", "1",
                       "--hello-timeout", "20", "--out", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ok"] == 0 and "status 3" in row["errors"][0]


def test_bench_lookup_measures_both_servers_beside_ping(tmp_path, capsys):
    servers = "native,python" if NATIVE else "python"
    out = tmp_path / "lookup.json"
    rc = lookup.main(["--servers", servers, "--shards", "2", "--tokens", "640", "--lookups", "3", "--warmup", "1",
                      "--get-every", "1", "--capacity", "8MiB", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["meta"]["keys"] == 10 and report["meta"]["skipped"] == {}
    kinds = servers.split(",")
    assert [(r["server"], r["op"]) for r in report["rows"]] == [(k, op) for k in kinds for op in lookup.OPS]
    for r in report["rows"]:
        assert r["n"] == 3 and r["misses"] == 0 and 0 < r["p50_us"] <= r["max_us"]
        assert r["transport"] in transport.names() and r["ratio"]["p50/ping"] > 0
    target, vs_ping = report["targets"]
    assert target["cell"].startswith(f"{kinds[0]} lookup of 10 keys over 2 shards")
    assert target["goal_us"] == lookup.TARGET_P99_US and target["value_us"] > 0
    by = {(r["server"], r["op"]): r for r in report["rows"]}
    assert vs_ping["goal_ratio"] == lookup.PING_P99_RATIO, vs_ping
    assert vs_ping["ratio"] == by[(kinds[0], "lookup")]["p99_us"] / by[(kinds[0], "ping")]["p99_us"], (vs_ping, by)
    assert "lookup-fanout" in capsys.readouterr().out


def test_bench_lookup_reports_a_server_kind_that_does_not_start(tmp_path, capsys):
    out = tmp_path / "lookup.json"
    rc = lookup.main(["--servers", "broken,python", "--cmd", "broken={python} -c pass", "--shards", "1",
                      "--tokens", "128", "--lookups", "1", "--warmup", "0", "--capacity", "8MiB", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert "did not start" in report["meta"]["skipped"]["broken"]
    assert {r["server"] for r in report["rows"]} == {"python"}
    assert "skipped broken" in capsys.readouterr().out


@needs_native
@pytest.mark.skipif(redis.unavailable() is not None, reason=str(redis.unavailable()))
def test_bench_redis_measures_redis_beside_native_and_the_tcp_limit(tmp_path):
    out = tmp_path / "redis.json"
    rc = redis.main(["--size", "64KiB", "--duration", "0.05", "--repeat", "1", "--capacity", "16MiB", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    by = {(r["name"], r["op"]): r for r in report["rows"]}
    for op in ("get", "put"):
        assert by[("redis", op)]["gbps"] > 0 and by[("redis", op)]["ratio"]["c-socket"] > 0
        assert by[("native", op)]["ratio"]["redis"] > 0 and by[("native", op)]["ratio"]["c-socket"] > 0
    assert {(t["cell"], t["vs"]) for t in report["targets"]} >= {("native get", "redis"), ("native put", "redis")}
    assert "redis" not in report["meta"]["skipped"]


@needs_native
def test_bench_transport_native_says_why_redis_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server / redis-benchmark on it
    out = tmp_path / "tn.json"
    rc = transport_native.main(["--paths", "native", "--size", "64KiB", "--duration", "0.05", "--repeat", "1",
                                "--capacity", "16MiB", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert "not found on PATH" in report["meta"]["skipped"]["redis"]
    assert not any(r["name"] == "redis" for r in report["rows"])
    assert ("native", "get") in {(r["name"], r["op"]) for r in report["rows"]}
    assert "skipped redis: redis-server and redis-benchmark not found" in capsys.readouterr().out


def test_page_buffers_start_where_asked():
    """The benchmark's client buffers (``page_buffer``) start ``offset`` bytes past a page boundary, hold ``nbytes``
    and are writable to their last byte."""
    for nbytes, offset in [(1, 0), (4096, 0), (1 << 20, 16), (65536 + 3, 4095), (7, 64)]:
        b = transport_native.page_buffer(nbytes, offset)
        assert b.nbytes == nbytes and b.ctypes.data % 4096 == offset, (nbytes, offset, b.ctypes.data % 4096)
        b[:] = 7
        assert b[-1] == 7


def test_the_cma_ceiling_moves_the_bytes_between_two_processes():
    """The ``cma`` ceiling really copies across processes: a PUT cell writes the local buffer into the forked
    peer's mapping (the same memfd pages this process maps), a GET cell reads the mapping back, and close()
    reaps the peer. Its local buffer starts where asked (``--buffer-offset``)."""
    cma = transport_native.CmaCeiling(64 * 1024, 256 * 1024, offset=16)
    try:
        assert cma._local.ctypes.data % 4096 == 16
        view = np.frombuffer(cma._map, np.uint8)
        view[:] = 0
        cma._local[:] = 0xA5
        gbps, us = cma.measure("put", 0.01)
        assert gbps > 0 and us > 0
        assert (view[:64 * 1024] == 0xA5).all()  # slot 0 was written through the peer's address space
        view[:] = 0x5A
        gbps, us = cma.measure("get", 0.01)
        assert gbps > 0 and (cma._local == 0x5A).all()
        del view
        pid = cma.pid
    finally:
        cma.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)


@needs_native
def test_bench_transport_native_measures_the_client_beside_its_ceilings(tmp_path):
    """The client-* paths go through kvfabric.Client (checksums on) and get issue 20's goals, each
    ratio the quotient of two rows of the same run."""
    out = tmp_path / "tn.json"
    rc = transport_native.main(["--paths", "client-tcp,client-native,client-shm", "--size", "64KiB", "--duration",
                                "0.05", "--repeat", "1", "--capacity", "16MiB", "--no-redis", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    by = {(r["name"], r["op"]): r for r in report["rows"]}
    for name in transport_native.CLIENT:
        for op in ("get", "put"):
            assert by[(name, op)]["gbps"] > 0 and by[(name, op)]["ratio"]["c-socket"] > 0, by[(name, op)]
    targets = {(t["cell"], t["vs"]): t for t in report["targets"]}
    assert {(f"{n} {op}", vs) for n, op, vs, _ in transport_native.CLIENT_GOALS} <= set(targets), targets
    t = targets[("client-shm get", "memcpy-cold")]
    assert t["ratio"] == by[("client-shm", "get")]["gbps"] / by[("memcpy-cold", "get")]["gbps"] and t["goal"] == 0.5
    # the shm goals say what the row's own floor (its round trips and one copy) leaves of the time the goal
    # allows: a GET copies out of a warm slot (the loop reads the same keys), a PUT into a fresh one
    for op, vs, goal, trips, copy in (("get", "memcpy-cold", 0.5, 1, "memcpy"), ("put", "c-socket", 0.9, 2,
                                                                                  "memcpy-cold")):
        t = targets[(f"client-shm {op}", vs)]
        budget_us = 64 * 1024 / (goal * by[(vs, op)]["gbps"] * 1e3)
        least_us = trips * by[("rtt-unix", op)]["p50_us"] + 64 * 1024 / (by[(copy, op)]["gbps"] * 1e3)
        assert abs(least_us - by[("client-shm", op)]["floor_us"]) < 1e-6 * least_us, (least_us, by[("client-shm", op)])
        assert f"the goal leaves {budget_us:.0f} us per call" in t["note"], (t, budget_us)
        assert f"take {least_us:.0f} us" in t["note"] and f"({copy})" in t["note"], (t, least_us)
        assert t["note"].startswith("unreachable here") == (least_us >= budget_us), (t, least_us, budget_us)
