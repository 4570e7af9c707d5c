"""The STATS -> Prometheus mapping (kvfabric/server/metrics.py), read back with prometheus_client's parser."""

import pytest

pytest.importorskip("prometheus_client", reason="prometheus-client is not installed")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvfabric.server.metrics import StatsCollector  # noqa: E402


def exposition(stats):
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(lambda: stats))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def test_counters_gauges_labels_and_info():
    fams = exposition({
        "objects": 7, "hits": 12, "capacity": 4096, "errors": {"BAD_KEY": 2, "MALFORMED": 1},
        "transports_in_use": {"tcp": 3, "native": 1}, "policy": "lru", "server_id": "a:1",
        "transports": ["tcp", "native"], "zerocopy": True,
    })
    assert fams["kvfabric_objects"].type == "gauge" and fams["kvfabric_objects"].samples[0].value == 7
    hits = fams["kvfabric_hits"]
    assert hits.type == "counter" and hits.samples[0].name == "kvfabric_hits_total" and hits.samples[0].value == 12
    errors = {s.labels["code"]: s.value for s in fams["kvfabric_errors"].samples if s.name.endswith("_total")}
    assert errors == {"BAD_KEY": 2, "MALFORMED": 1}
    tr = {s.labels["transport"]: s.value for s in fams["kvfabric_transports_in_use"].samples if s.name.endswith("_total")}
    assert tr == {"tcp": 3, "native": 1}
    (info,) = fams["kvfabric_server_info"].samples
    assert info.labels == {"policy": "lru", "server_id": "a:1"}
    # lists and booleans are not numbers to export
    assert "kvfabric_transports" not in fams and "kvfabric_zerocopy" not in fams


def test_a_failing_stats_read_yields_nothing_instead_of_raising():
    def broken():
        raise RuntimeError("stopped")

    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(broken))
    assert b"kvfabric_" not in generate_latest(reg)
