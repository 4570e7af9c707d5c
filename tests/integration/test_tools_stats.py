"""`kvfabric stats` and `kvfabric top` against real pool servers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from kvfabric import Client, ClientConfig
from kvfabric.testing import start_pool, start_server
from kvfabric.tools.stats import rate_rows, stats_main, top_main


def test_stats_table_and_json_for_live_and_dead_servers():
    with start_pool(2, capacity="16MiB") as pool:
        with Client(pool.addresses, config=ClientConfig(transport="tcp", timeout_s=10)) as c:
            keys = [bytes([i]) * 16 for i in range(8)]
            assert c.put(keys, [b"v" * 3000] * 8).stored == 8
        out = io.StringIO()
        assert stats_main([*pool.addresses, "127.0.0.1:1", "--timeout", "10"], out=out) == 0
        lines = out.getvalue().splitlines()
        assert lines[0].split()[:3] == ["server", "objects", "used"]
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert sum(int(rows[a][1]) for a in pool.addresses) == 8
        refused = "unreachable: connection refused (is a server listening there?)"
        assert " ".join(rows["127.0.0.1:1"][1:]) == refused, lines
        out = io.StringIO()
        assert stats_main([pool.addresses[0], "--json"], out=out) == 0
        st = json.loads(out.getvalue())[pool.addresses[0]]
        assert st["capacity"] == 16 << 20 and st["policy"] == "lru"


def test_stats_exits_1_when_no_server_answers():
    assert stats_main(["127.0.0.1:1", "--timeout", "2"], out=io.StringIO()) == 1


def test_top_refreshes_with_rates():
    with start_server(capacity="16MiB") as srv:
        out = io.StringIO()
        assert top_main([srv.address, "--count", "2", "--interval", "0.2"], out=out) == 0
        text = out.getvalue()
        assert text.count("kvfabric top") == 2 and srv.address in text and "GB/s in" in text


def test_rate_rows_are_differences_over_time():
    before = {"a:1": {"bytes_in": 0, "bytes_out": 1_000_000_000, "hits": 10, "objects": 1}}
    after = {"a:1": {"bytes_in": 2_000_000_000, "bytes_out": 3_000_000_000, "hits": 30, "objects": 2},
             "b:2": {"error": "down"}}
    before["a:1"]["lat_get_us_buckets"] = [0] * 25
    after["a:1"]["lat_get_us_buckets"] = [0] * 10 + [99, 1] + [0] * 13  # 99 GETs < 1.024 ms, one < 2.048 ms
    rows = {r[0]: r for r in rate_rows(before, after, 2.0)}
    assert rows["a:1"][4:7] == ("1.000", "1.000", "10")
    assert rows["a:1"][9] == "<1.024"  # p99: the bucket of the 99th of 100 GETs
    assert "unreachable" in rows["b:2"][1]


def test_version_and_usage_from_the_command():
    out = subprocess.run([sys.executable, "-m", "kvfabric", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("kvfabric ") and "wire protocol" in out.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    out = subprocess.run([sys.executable, "-m", "kvfabric", "stats"], capture_output=True, text=True, timeout=60,
                         env=env)
    # no address and no KVFABRIC_SERVERS: a usage error that says how to give one
    assert out.returncode == 2 and "KVFABRIC_SERVERS" in out.stderr and "Traceback" not in out.stderr, out
    out = subprocess.run([sys.executable, "-m", "kvfabric", "stats", "--bogus"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2 and "usage" in out.stderr, out


def test_stats_and_top_default_to_kvfabric_servers():
    with start_pool(2, capacity="16MiB") as pool:
        env = {"KVFABRIC_SERVERS": ",".join(pool.addresses), "KVFABRIC_TIMEOUT_S": "30"}
        out = io.StringIO()
        assert stats_main([], out=out, environ=env) == 0, out.getvalue()
        rows = [line.split()[0] for line in out.getvalue().splitlines()[1:]]
        assert rows == pool.addresses, out.getvalue()
        out = io.StringIO()
        assert top_main(["--count", "1", "--interval", "0.1"], out=out, environ=env) == 0, out.getvalue()
        assert all(a in out.getvalue() for a in pool.addresses), out.getvalue()


def test_stats_one_line_per_server_on_stderr_when_none_answers(capsys):
    assert stats_main(["127.0.0.1:1,127.0.0.2:1", "--timeout", "30"], out=io.StringIO(), environ={}) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["kvfabric stats: 127.0.0.1:1: connection refused (is a server listening there?)",
                   "kvfabric stats: 127.0.0.2:1: connection refused (is a server listening there?)"], err
