"""The plugin in LMCache's own stats and in the Prometheus registry LMCache exports through.

Real LMCache engines, real pool servers: a store and a retrieve through the plugin show up as
LMCache's remote read/write bytes (``LMCStatsMonitor``, filled by LMCache's
``InstrumentedRemoteConnector`` around the plugin) and, in the same ``/metrics`` text LMCache's
``PrometheusLogger`` writes to, as ``kvfabric_lmcache_*`` counters (connectors/kvfabric_lmcache/stats.py),
read back with prometheus_client's own parser.
"""

from __future__ import annotations

import pytest
import torch
from lmcache.observability import LMCStatsMonitor, PrometheusLogger
from lmcache_helpers import metadata
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_engine import CHUNKS, TOKENS, kvfabric_connector, pool_engine, prompt, store_and_wait

pytestmark = pytest.mark.lmcache


def scrape() -> dict[str, float]:
    """Every sample of the default registry, by sample name (summed over label sets)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_store_and_retrieve_show_in_lmcache_stats_and_its_prometheus_registry(pool, engines) -> None:
    prom = PrometheusLogger.GetOrCreate(metadata())
    prom.log_prometheus(LMCStatsMonitor.GetOrCreate().get_stats_and_clear())  # earlier tests', out of the way
    before = scrape()

    _, e1 = pool_engine(engines, pool)
    tokens, kv = prompt(seed=21)
    store_and_wait(e1, tokens, kv)
    # LMCache's own stats: its wrapper around the plugin counted the bytes put in the pool
    # (the monitor is a per-process singleton that building an engine may replace: ask for it now)
    stored = LMCStatsMonitor.GetOrCreate().get_stats_and_clear()
    kv_bytes = kv.numel() * kv.element_size()
    assert stored.interval_remote_write_bytes >= kv_bytes
    prom.log_prometheus(stored)

    _, e2 = pool_engine(engines, pool)  # no local CPU cache: its hits come from the pool
    assert e2.lookup(tokens) == TOKENS
    out = torch.zeros_like(kv)
    assert int(e2.retrieve(tokens, kv=out).sum()) == TOKENS
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    loaded = LMCStatsMonitor.GetOrCreate().get_stats_and_clear()
    assert loaded.interval_remote_read_bytes >= kv_bytes
    prom.log_prometheus(loaded)
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # LMCache's metrics and the plugin's, in one registry (one /metrics under vLLM)
    assert delta("lmcache:num_remote_write_bytes_total") == stored.interval_remote_write_bytes
    assert delta("lmcache:num_remote_read_bytes_total") == loaded.interval_remote_read_bytes
    assert delta("kvfabric_lmcache_puts_stored_total") == CHUNKS
    assert delta("kvfabric_lmcache_get_hits_total") == CHUNKS
    assert delta("kvfabric_lmcache_lookup_hits_total") >= CHUNKS
    assert delta("kvfabric_lmcache_pool_errors_total") == 0
    assert delta("kvfabric_lmcache_bad_values_total") == 0
    # read from the connectors' own counters at scrape time (the live ones included)
    assert after["kvfabric_lmcache_get_hits_total"] >= kvfabric_connector(e2).counts()["get_hits"]
