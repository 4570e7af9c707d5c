"""`kvfabric stats` and `kvfabric top` against real pool servers."""

from __future__ import annotations

import io
import json
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
        assert "unreachable" in " ".join(rows["127.0.0.1:1"])
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
    out = subprocess.run([sys.executable, "-m", "kvfabric", "stats"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
