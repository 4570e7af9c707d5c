"""The plugin's counters next to LMCache's own metrics.

What LMCache measures of the plugin itself: LMCache wraps every remote
connector, plugins included, in ``InstrumentedRemoteConnector``
(``lmcache/v1/storage_backend/connector/instrumented_connector.py``), which
reports each put's and get's bytes and time to ``LMCStatsMonitor``; its
``PrometheusLogger`` exports them as ``lmcache:num_remote_read_bytes``,
``lmcache:num_remote_write_bytes``, ``lmcache:remote_time_to_get`` ... So the
pool's bytes and latencies are already in LMCache's stats.

What it cannot carry: ``LMCStatsMonitor`` has fixed fields and no hook for a
plugin's own (lookup hits, pool errors, bad values, drops). Those go into the
same place LMCache's Prometheus metrics go, the process's default
``prometheus_client`` registry, which vLLM's ``/metrics`` serves: a collector
registered once per process reads every connector's counters at scrape time
and exports ``kvfabric_lmcache_<name>_total`` (names and meanings:
``kvfabric/metrics.py`` ``LMCACHE``), summed over the process's connectors,
closed ones included (a counter never goes back). Nothing is counted twice:
the connectors keep their own counts, the collector only reads them.

Where vLLM runs Prometheus in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
set) a collector in the worker process is not seen by the API server process;
LMCache's own metrics have the same limit there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvfabric.metrics import LMCACHE, PREFIX

PROM_PREFIX = PREFIX + "lmcache_"

_lock = threading.Lock()
_sources: list[Callable[[], dict[str, int]]] = []
_registered = False


def totals() -> dict[str, int]:
    """Every counter summed over this process's connectors (those alive and those closed)."""
    with _lock:
        sources = list(_sources)
    out = dict.fromkeys(LMCACHE, 0)
    for read in sources:
        for k, v in read().items():
            if k in out:
                out[k] += v
    return out


class LMCacheCounterCollector:
    """A ``prometheus_client`` collector over :func:`totals`."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        for name, value in totals().items():
            yield CounterMetricFamily(PROM_PREFIX + name, LMCACHE[name].help, value=value)

    def describe(self) -> list[Any]:
        return []  # names are fixed, but describing would make the registry collect() at registration


def track(read: Callable[[], dict[str, int]]) -> None:
    """Count ``read()`` (a connector's ``counts``, which must not keep the connector alive: pass a
    function over its counter dict and lock) in :func:`totals`, and register the collector in the
    default registry the first time. Without ``prometheus_client`` only :func:`totals` works."""
    global _registered
    with _lock:
        _sources.append(read)
        if _registered:
            return
        _registered = True
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # kvfabric depends on it; an engine venv without it only loses the export
        return
    REGISTRY.register(LMCacheCounterCollector())
