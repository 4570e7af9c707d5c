"""`kvfabric serve --metrics-port` exposes STATS as Prometheus metrics that a real parser reads."""

from __future__ import annotations

import re
import urllib.request

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.testing import start_server, wait_for

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is not installed")
pytest.importorskip("kvfabric._native", reason="the C extension is not built")


def scrape(url: str) -> dict[str, dict]:
    """family name -> {"type": ..., "samples": {(name, frozenset(labels)): value}}."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        out[fam.name] = {"type": fam.type,
                         "samples": {(s.name, frozenset(s.labels.items())): s.value for s in fam.samples}}
    return out


def test_metrics_follow_the_servers_stats():
    with start_server("16MiB", extra_args=["--metrics-port", "0"]) as srv:
        url = wait_for(lambda: (re.search(r"metrics on (http://\S+)", srv.stderr_text()) or [None, None])[1])
        with Client([srv.address], config=ClientConfig(transport="tcp", timeout_s=10)) as c:
            keys = [bytes([i]) * 16 for i in range(3)]
            assert c.put(keys, [b"x" * 5000] * 3).stored == 3
            assert c.get(keys + [b"\xff" * 16])[:3] == [b"x" * 5000] * 3
            stats = c.stats()["servers"][srv.address]
        m = scrape(url)
        assert m["kvfabric_objects"]["type"] == "gauge"
        assert m["kvfabric_objects"]["samples"][("kvfabric_objects", frozenset())] == 3
        assert m["kvfabric_hits"]["type"] == "counter"
        assert m["kvfabric_hits"]["samples"][("kvfabric_hits_total", frozenset())] == stats["hits"] == 3
        assert m["kvfabric_misses"]["samples"][("kvfabric_misses_total", frozenset())] == stats["misses"] == 1
        assert m["kvfabric_capacity"]["samples"][("kvfabric_capacity", frozenset())] == 16 << 20
        info = m["kvfabric_server_info"]["samples"]
        ((_, labels),) = info.keys()
        assert dict(labels)["server_id"] == srv.address and dict(labels)["policy"] == "lru"


def test_metrics_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="exited with status 2"):
            start_server("16MiB", extra_args=["--metrics-port", str(port)], timeout_s=30)


def test_service_time_histograms_and_error_counters():
    """GET/PUT/LOOKUP/EXISTS/DELETE service times are Prometheus histograms that agree with STATS; error
    replies are counted by code."""
    import socket

    from kvfabric.metrics import LAT_BUCKETS, LAT_OPS

    with start_server("16MiB", extra_args=["--metrics-port", "0"]) as srv:
        url = wait_for(lambda: (re.search(r"metrics on (http://\S+)", srv.stderr_text()) or [None, None])[1])
        with Client([srv.address], config=ClientConfig(transport="tcp", timeout_s=30)) as c:
            keys = [bytes([i]) * 16 for i in range(4)]
            assert c.put(keys, [b"y" * 3000] * 4).stored == 4
            assert c.get(keys) == [b"y" * 3000] * 4
            assert c.lookup(keys) == 4
            assert c.exists(keys) == [True] * 4
            assert c.delete(keys[:1]) == 1
            host, port = srv.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as raw:
                raw.sendall(b"\0" * 32)  # not a kvfabric frame: answered BAD_MAGIC, then closed
                while raw.recv(4096):
                    pass
            stats = c.stats()["servers"][srv.address]
        m = scrape(url)
    fam = m["kvfabric_request_seconds"]
    assert fam["type"] == "histogram"
    for op in LAT_OPS:
        buckets = stats[f"lat_{op}_us_buckets"]
        assert len(buckets) == LAT_BUCKETS and sum(buckets) >= 1, (op, buckets)
        labels = frozenset({"op": op}.items())
        count = fam["samples"][("kvfabric_request_seconds_count", labels)]
        assert count == sum(buckets)
        inf = fam["samples"][("kvfabric_request_seconds_bucket", frozenset({"op": op, "le": "+Inf"}.items()))]
        assert inf == count
        # cumulative and monotonic over the finite bounds
        finite = sorted((float(dict(lb)["le"]), v) for (n, lb), v in fam["samples"].items()
                        if n.endswith("_bucket") and dict(lb)["op"] == op and dict(lb)["le"] != "+Inf")
        assert len(finite) == LAT_BUCKETS - 1 and finite[0][0] == 1e-6
        assert all(a[1] <= b[1] for a, b in zip(finite, finite[1:]))
        assert fam["samples"][("kvfabric_request_seconds_sum", labels)] >= 0
    # the server counted at least what this client asked (the stats() call itself is not timed)
    assert sum(stats["lat_put_us_buckets"]) >= 1 and sum(stats["lat_get_us_buckets"]) >= 1
    assert stats["errors"]["BAD_MAGIC"] == 1
    assert m["kvfabric_errors"]["samples"][("kvfabric_errors_total", frozenset({"code": "BAD_MAGIC"}.items()))] == 1
    # names follow the registry: one family per name, counters never end in _total_total
    assert m["kvfabric_connections_accepted"]["type"] == "counter" and m["kvfabric_connections"]["type"] == "gauge"
    assert m["kvfabric_transports_in_use"]["samples"][
        ("kvfabric_transports_in_use_total", frozenset({"transport": "tcp"}.items()))] >= 1
    assert not [n for fam in m.values() for (n, _) in fam["samples"] if n.endswith("_total_total")]
    assert m["kvfabric_server_info"]["samples"] and any(
        dict(lb).get("data_plane", "").startswith("io_uring") for (_, lb) in m["kvfabric_server_info"]["samples"])
