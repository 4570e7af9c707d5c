"""Prometheus metrics of a pool server: ``kvfabric serve --metrics-port PORT``.

The exposition is a view of STATS, read when Prometheus scrapes (no second set
of counters to keep in step): every number in the server's STATS map becomes
a sample, named ``kvfabric_<key>``. Counters (monotonic since start) get the
``_total`` suffix and the Prometheus counter type; levels (objects, bytes in
use, connections, ...) are gauges. A nested map of numbers (``errors`` by
code, ``transports_in_use`` by transport, ...) becomes one family with a
label (``code``, ``transport``, or ``kind``). Strings (policy, data plane,
server id) are labels of ``kvfabric_server_info``. A STATS key added to the
server appears in the exposition without a change here; its type, label and
help text come from the one registry, ``kvfabric/metrics.py``. The service-time
histograms (``lat_<op>_us_buckets`` / ``lat_<op>_us_sum`` in STATS) become one
histogram family, ``kvfabric_request_seconds{op=get|put|lookup|exists|delete}``
with ``_bucket`` / ``_sum`` / ``_count``.

The exposition is ``prometheus_client``'s (imported only when a metrics port
is asked for, so engines' virtualenvs that run a pool server for tests need
not install it); the HTTP server is :mod:`kvfabric.server.httpd`'s bounded one,
not ``prometheus_client.start_http_server`` (a thread per connection, kept for
as long as the client likes): at most ``--metrics-max-connections`` scrapes at
once, one thread each (the next connection is answered 503 and closed by the
accepting thread), a request head of at most 16 KiB that must arrive within
``--metrics-timeout`` seconds (half-sent requests are dropped then; so are
idle keep-alive connections), no request body (a request with one is answered
413 and closed), and a client that stops reading its answer is dropped after
the same timeout. So the endpoint's threads are at most 1 + the cap and its
memory :func:`kvfabric.server.memory.metrics_bytes`. What it refused or dropped
is exported beside STATS (:class:`HttpCollector`): ``kvfabric_http_connections_refused_total``,
``kvfabric_http_timeouts_total``, ``kvfabric_http_error_answers_total{status}`` and
``kvfabric_http_connections`` (declared in :data:`kvfabric.metrics.HTTP`). It binds loopback unless
``--metrics-host`` says otherwise; the metrics carry no keys or values, only
counts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..metrics import HTTP, LAT_KEYS, LAT_OPS, SERVER, SERVER_PROM_NAMES, lat_histogram
from ..metrics import SERVER_GAUGES as GAUGES
from ..metrics import SERVER_LABELS as LABELS
from .httpd import BoundedHandler, BoundedHTTPServer, Limits

log = logging.getLogger("kvfabric.server.metrics")

PREFIX = "kvfabric_"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _help(key: str, default: str) -> str:
    m = SERVER.get(SERVER_PROM_NAMES.get(key, key))
    return m.help if m is not None else default


def families(stats: Mapping[str, Any]) -> Iterator[Any]:
    """Prometheus metric families for one STATS map (see the module docstring)."""
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                        InfoMetricFamily)

    info = {k: str(v) for k, v in stats.items() if isinstance(v, str)}
    if info:
        yield InfoMetricFamily(PREFIX + "server", SERVER["server"].help, value=info)
    hist = None
    for op in LAT_OPS:
        buckets, total = stats.get(f"lat_{op}_us_buckets"), stats.get(f"lat_{op}_us_sum")
        if isinstance(buckets, list) and _is_number(total):
            if hist is None:
                hist = HistogramMetricFamily(PREFIX + "request_seconds", SERVER["request_seconds"].help,
                                             labels=["op"])
            hist.add_metric([op], lat_histogram(buckets), sum_value=total / 1e6)
    if hist is not None:
        yield hist
    for key in sorted(stats):
        if key in LAT_KEYS:
            continue
        value = stats[key]
        name = PREFIX + SERVER_PROM_NAMES.get(key, key)
        if _is_number(value):
            if key in GAUGES:
                yield GaugeMetricFamily(name, _help(key, f"STATS {key}"), value=value)
            else:
                yield CounterMetricFamily(name, _help(key, f"STATS {key}") + " (since start)", value=value)
        elif isinstance(value, Mapping) and value and all(_is_number(v) for v in value.values()):
            label = LABELS.get(key, "kind")
            fam = (GaugeMetricFamily if key in GAUGES else CounterMetricFamily)(
                name, _help(key, f"STATS {key} by {label}"), labels=[label])
            for sub, v in sorted(value.items()):
                fam.add_metric([str(sub)], v)
            yield fam


class StatsCollector:
    """A ``prometheus_client`` collector that reads ``stats_fn()`` at each scrape."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats_fn

    def collect(self) -> Iterator[Any]:
        try:
            stats = self._stats()
        except Exception as e:  # noqa: BLE001 - a scrape must not take the server down
            log.warning("metrics: reading STATS failed: %s", e)
            return
        yield from families(stats)


def http_families(counts: Mapping[str, Any]) -> Iterator[Any]:
    """Prometheus families for one :meth:`BoundedHTTPServer.limit_counts` snapshot (kvfabric/server/httpd.py):
    ``kvfabric_http_connections_refused_total``, ``kvfabric_http_timeouts_total``,
    ``kvfabric_http_error_answers_total{status}`` and the gauge ``kvfabric_http_connections``; names, types
    and help from :data:`kvfabric.metrics.HTTP`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for key in ("connections_refused", "timeouts"):
        m = HTTP["http_" + key]
        yield CounterMetricFamily(PREFIX + m.name, m.help, value=counts[key])
    m = HTTP["http_error_answers"]
    fam = CounterMetricFamily(PREFIX + m.name, m.help, labels=list(m.labels))
    for status, n in sorted(counts["error_answers"].items()):
        fam.add_metric([str(status)], n)
    yield fam
    m = HTTP["http_connections"]
    yield GaugeMetricFamily(PREFIX + m.name, m.help, value=counts["connections"])


class HttpCollector:
    """A ``prometheus_client`` collector of a :class:`BoundedHTTPServer`'s refusals and drops."""

    def __init__(self, httpd: BoundedHTTPServer) -> None:
        self._httpd = httpd

    def collect(self) -> Iterator[Any]:
        yield from http_families(self._httpd.limit_counts())


#: Scrapes served at once (Prometheus scrapes one target with one connection; a few more leave room
#: for a second Prometheus, an agent and a person with curl), and how long a request may take to
#: arrive; docs/operations.md.
DEFAULT_MAX_CONNECTIONS = 8
DEFAULT_TIMEOUT_S = 10.0
#: A scrape's request line and headers (Prometheus sends ~300 bytes).
MAX_HEADER_BYTES = 16 << 10


def limits(max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = DEFAULT_TIMEOUT_S) -> Limits:
    """The endpoint's limits (ValueError unless both are > 0). It reads no body, so the body limits
    only have to be valid."""
    return Limits(max_connections=max_connections, header_timeout_s=timeout_s, body_timeout_s=timeout_s,
                  max_header_bytes=MAX_HEADER_BYTES, max_body_bytes=1)


class _Handler(BoundedHandler):
    server: _HTTPServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
            self.refuse(413, "the metrics endpoint takes no request body")
        elif self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.refuse(404, "not found: the metrics are at /metrics")
        else:
            encode, ctype = self.server.choose_encoder(self.headers.get("Accept", ""))
            self.reply(200, encode(self.server.registry), ctype)


class _HTTPServer(BoundedHTTPServer):
    registry: Any
    choose_encoder: Callable[[str], tuple[Callable[[Any], bytes], str]]


class MetricsServer:
    """The ``/metrics`` HTTP endpoint, served by one thread (plus one per scrape in progress, at most
    ``max_connections``); ``close()`` stops it. Raises ImportError (with what to install) when
    prometheus_client is missing, OSError when the port cannot be bound, ValueError for a limit
    that is not > 0."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]], host: str = "127.0.0.1", port: int = 0, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import choose_encoder
        except ImportError as e:
            raise ImportError(f"--metrics-port needs the prometheus-client package (pip install prometheus-client): {e}") from e
        lim = limits(max_connections, timeout_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(stats_fn))
        self._httpd = _HTTPServer((host, port), _Handler, lim)
        self.registry.register(HttpCollector(self._httpd))   # the endpoint's own refusals and drops
        self._httpd.registry, self._httpd.choose_encoder = self.registry, choose_encoder
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvfabric-metrics", daemon=True)
        self._thread.start()
        self.host, self.port = self._httpd.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
