"""Every metric kvfabric reports, declared once: name, type, help text, labels.

Four producers count things, each in its own process and with its own storage
(C counters in the pool server, a locked dict in the client, per-instance
counters in each connector); this module is where their *names and meanings*
live, so that a counter cannot be added to one producer under a name another
uses for something else, and so that every exporter says the same thing about
it:

- :data:`SERVER`: the pool server's STATS map (``kvfabric/protocol/stats.py``
  holds the keys and their meanings; here they get their Prometheus type and
  label) plus the service-time histogram, exported by ``kvfabric serve
  --metrics-port`` as ``kvfabric_<name>`` (see ``kvfabric/server/metrics.py``);
- :data:`HTTP`: the bounded HTTP server's refusals and drops (``kvfabric/server/httpd.py``), exported
  by the metrics endpoint and the PD example proxy as ``kvfabric_http_<name>``;
- :data:`CLIENT`: ``Client.stats()["client"]`` (``kvfabric/_shard.py``);
- :data:`VLLM`: the vLLM connector's counters (``connectors/kvfabric_vllm/metrics.py``),
  exported through vLLM's own ``/metrics`` as ``kvfabric_vllm_<name>``;
- :data:`LMCACHE`: the LMCache connector's counters (``connectors/kvfabric_lmcache/connector.py``),
  exported into the process's default ``prometheus_client`` registry (the one LMCache's metrics
  use) as ``kvfabric_lmcache_<name>`` (``connectors/kvfabric_lmcache/stats.py``).

Counters are monotonic since the producer started and get Prometheus's
``_total`` suffix; gauges are levels now. Names here are without the
``kvfabric_`` prefix and without ``_total``.

Service time (``kvfabric_request_seconds{op}``): the C server times each GET,
PUT, LOOKUP, EXISTS and DELETE from its request header being received to its
reply being *queued* (not sent: a GET's bytes going out are not included; a
PUT's objects arriving, and a PUT waiting for eviction to free space, are).
STATS carries it as ``lat_<op>_us_buckets`` (a list of :data:`LAT_BUCKETS`
counts; bucket ``i < LAT_BUCKETS - 1`` counts times ``t`` with
``2**(i-1) <= t < 2**i`` microseconds, bucket 0 ``t < 1 us``, the last one
everything from ``2**23`` us, about 8.4 s, up) and ``lat_<op>_us_sum``
(microseconds). Fixed log2 buckets keep recording one increment with no lock
and STATS O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol.stats import SHARED_STATS_FIELDS, SSD_STATS_FIELDS, STATS_FIELDS, STATS_OPTIONAL_KEYS

PREFIX = "kvfabric_"
COUNTER, GAUGE, HISTOGRAM, INFO = "counter", "gauge", "histogram", "info"


@dataclass(frozen=True)
class Metric:
    """One metric family: ``name`` (no ``kvfabric_`` prefix, no ``_total``), ``kind`` (counter, gauge,
    histogram or info), ``help`` (what one unit of it is), ``labels`` (label names, in order)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()


def _table(*metrics: Metric) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for m in metrics:
        if m.name in out:
            raise ValueError(f"metric {m.name!r} declared twice")
        out[m.name] = m
    return out


# ------------------------------------------------------------------ server

#: Operations timed by the server, in the order of the C server's KVF_LAT_* (csrc/kvf_server.h).
LAT_OPS = ("get", "put", "lookup", "exists", "delete")
#: Entries of a ``lat_<op>_us_buckets`` list (csrc/kvf_server.h KVF_LAT_BUCKETS).
LAT_BUCKETS = 25
#: Upper bounds (exclusive, microseconds) of the finite buckets; the last bucket has none.
LAT_BOUNDS_US: tuple[int, ...] = tuple(2**i for i in range(LAT_BUCKETS - 1))

#: STATS keys that are levels (go up and down); every other number is a counter.
SERVER_GAUGES = frozenset({
    "objects", "bytes_used", "bytes_allocated", "capacity", "free_bytes", "pinned", "leased", "connections",
    "uptime_s", "reserved_bytes", "reply_bytes", "request_bytes", "shm_leases", "shm_reservations",
    "ssd_capacity", "ssd_objects", "ssd_bytes", "ssd_queue_bytes",
    "groups", "group_objects", "groups_incomplete",  # issue 23: indexed groups now
})
#: STATS keys that are maps of numbers -> the label of their keys.
SERVER_LABELS = {"errors": "code", "transports_in_use": "transport", "drops": "reason", "kv_events": "kind"}
#: STATS keys exported under another name: a counter's family must not end in _total (Prometheus
#: adds it) nor clash with a gauge (``connections`` is the gauge of open connections).
SERVER_PROM_NAMES = {"connections_total": "connections_accepted"}
#: STATS keys carried by the histogram rather than exported one by one.
LAT_KEYS = frozenset(f"lat_{op}_us_{part}" for op in LAT_OPS for part in ("buckets", "sum"))
#: STATS keys whose strings become labels of ``kvfabric_server_info``.
SERVER_INFO_KEYS = ("server_id", "policy", "data_plane", "ucx_transports")

_OPTIONAL_HELP = {
    "events_dropped": "eviction events lost to a full ring (the policy was resynchronised)",
    "zc_sends": "GET reply sends with IORING_OP_SEND_ZC",
    "copy_sends": "GET reply sends copied by the kernel (SENDMSG)",
    "zc_copied_notifs": "zero-copy sends the kernel copied after all",
    "client_verified_sends": "GET objects sent without the server's checksum pass: their client verifies them",
    "transports_in_use": "connections accepted, by the transport they said at HELLO",
    "shm_refused": "unix peers refused by the SO_PEERCRED check",
    "shm_leases_expired": "shm leases dropped at --max-lease-ms",
    "shm_reservations_expired": "shm reservations freed uncommitted",
    "drops": "connections dropped without an error reply, by reason",
}


def _server_metrics() -> list[Metric]:
    out = [Metric("server", INFO, "identity of this pool server", SERVER_INFO_KEYS),
           Metric("request_seconds", HISTOGRAM,
                  "service time: request header received -> reply queued (log2 buckets from 1 us)", ("op",)),
           Metric("kv_events", COUNTER, "the KV events publisher (--kv-events, kvfabric/server/kv_events.py): "
                                        "batches, events published, resets (AllBlocksCleared after a loss), "
                                        "lost events, replays served, bad replay requests", ("kind",))]
    # the product server's keys (the test reference's own extras are not exported by anything)
    keys = {**STATS_FIELDS, **SSD_STATS_FIELDS, **SHARED_STATS_FIELDS}
    for k in STATS_OPTIONAL_KEYS["native"]:
        keys.setdefault(k, _OPTIONAL_HELP.get(k, f"STATS {k}"))
    for key, meaning in keys.items():
        if key in SERVER_INFO_KEYS or key == "transports" or key in LAT_KEYS or key == "data_plane":
            continue
        labels = (SERVER_LABELS[key],) if key in SERVER_LABELS else ()
        out.append(Metric(SERVER_PROM_NAMES.get(key, key), GAUGE if key in SERVER_GAUGES else COUNTER, meaning,
                          labels))
    return out


#: The pool server's metric families (``kvfabric serve --metrics-port``).
SERVER: dict[str, Metric] = _table(*_server_metrics())

# ------------------------------------------------------------------ bounded HTTP servers

#: The bounded HTTP server's counts (``BoundedHTTPServer.limit_counts``, kvfabric/server/httpd.py),
#: exported as ``kvfabric_<name>`` by the metrics endpoint (``kvfabric serve --metrics-port``: the
#: endpoint's own connections) and by the PD example proxy's ``/metrics`` (its clients' connections).
HTTP: dict[str, Metric] = _table(
    Metric("http_connections_refused", COUNTER, "HTTP connections over the connection cap, answered 503 and "
                                                "closed by the accepting thread"),
    Metric("http_timeouts", COUNTER, "HTTP connections dropped because a request head or body did not arrive "
                                     "within its deadline (half-sent, trickled, idle keep-alive)"),
    Metric("http_error_answers", COUNTER, "HTTP answers with a status of 400 or more, by status (refusals: 400 "
                                          "bad Content-Length, 411, 413 over the body cap, 431 over the head cap, "
                                          "501, 503 no body budget; and 404, 502, ...)", ("status",)),
    Metric("http_connections", GAUGE, "HTTP connections being served now (at most the connection cap)"),
)

# ------------------------------------------------------------------ client

#: ``Client.stats()["client"]``: counters of one client object, since it was made.
CLIENT: dict[str, Metric] = _table(
    Metric("hits", COUNTER, "keys a GET (get / get_into) returned"),
    Metric("misses", COUNTER, "keys a GET did not return (absent, failed checksum, shard down or late)"),
    Metric("lookup_hits", COUNTER, "keys of the leading run a lookup() found (not fetched; not in hits)"),
    Metric("lookup_misses", COUNTER, "keys a lookup() asked about past the leading run"),
    Metric("checksum_failures", COUNTER, "objects received whose bytes did not match their checksum (a miss)"),
    Metric("puts_stored", COUNTER, "objects a put() stored"),
    Metric("puts_existed", COUNTER, "objects a put() found already stored"),
    Metric("dropped_puts", COUNTER, "objects a put() could not store (shard down, full, late, refused)"),
    Metric("replica_puts_dropped", COUNTER, "replica copies a put() could not store"),
    Metric("shard_errors", COUNTER, "requests to a shard that failed (connection, protocol, server error)"),
    Metric("timeouts", COUNTER, "requests to a shard that missed the call's deadline"),
    Metric("skipped_down", COUNTER, "requests not sent because their shard was marked down"),
    Metric("reconnects", COUNTER, "connections re-established to a shard"),
    Metric("servers_refused", COUNTER, "connection attempts refused by this client: the server did not prove it "
           "holds the pool token (or needs one this client lacks); nothing was sent to it"),
    Metric("bytes_in", COUNTER, "object bytes received"),
    Metric("bytes_out", COUNTER, "object bytes sent"),
    Metric("requests", COUNTER, "requests answered by a server"),
    Metric("buffer_registrations", COUNTER, "caller buffers registered with the native transport"),
    Metric("buffer_registration_failures", COUNTER, "buffer registrations refused (the copy path is used)"),
    Metric("membership_changes", COUNTER, "member-list changes applied (etcd)"),
    Metric("handoff_hits", COUNTER, "keys found on a previous owner after a membership change, by GET or LOOKUP"),
    Metric("handoff_repairs", COUNTER, "of those, keys re-put to their new owner"),
    Metric("read_repairs", COUNTER, "keys re-put to a replica that lacked them"),
    Metric("repairs_dropped", COUNTER, "repairs that did not fit the repair queue"),
    Metric("member_records_refused", COUNTER, "etcd member records not routed to: malformed, under another id's "
                                              "key, or (with a token) unsigned, wrongly signed or re-leased"),
    Metric("member_id_mismatches", COUNTER, "servers whose HELLO reported another id than their verified etcd "
                                            "record (not routed to)"),
    Metric("etcd_bad_answers", COUNTER, "etcd answers that were malformed or over the size cap (membership "
                                        "left unchanged)"),
)

# ------------------------------------------------------------------ vLLM connector

#: The vLLM connector's counters (per connector instance; summed per process).
VLLM: dict[str, Metric] = _table(
    # scheduler side
    Metric("lookups", COUNTER, "pool lookups started (one per request, again after each preemption)"),
    Metric("relookups", COUNTER, "lookups after a preemption"),
    Metric("lookup_timeouts", COUNTER, "lookups that missed their deadline (answered: no hit)"),
    Metric("lookup_errors", COUNTER, "lookups that raised (answered: no hit)"),
    Metric("lookup_hit_tokens", COUNTER, "loadable tokens the pool held beyond vLLM's local hit (exists)"),
    Metric("scheduled_load_tokens", COUNTER, "tokens vLLM accepted to load from the pool"),
    Metric("loads_guarded", COUNTER, "hits the load guard weighed with both rates measured (kvfabric_vllm.guard)"),
    Metric("loads_skipped_slower", COUNTER, "of those, loads cut or skipped: loading was predicted slower than "
                                            "recomputing (the tokens were recomputed)"),
    Metric("skipped_load_tokens", COUNTER, "tokens of pool hits recomputed because loading them was predicted "
                                           "slower"),
    Metric("ssd_load_tokens", COUNTER, "tokens of async loads with a chunk on a server's SSD tier (load guard on: "
                                       "its lookup says the medium)"),
    Metric("ssd_load_us", COUNTER, "microseconds during which such a load was in flight (the scheduler's clock; "
                                   "with ssd_load_tokens: the SSD loads' cost per token, which kvfabric route reads)"),
    Metric("save_known_chunks", COUNTER, "prompt chunks not saved because the lookup found them in the pool"),
    Metric("save_unchecked_jobs", COUNTER, "saves sent before their lookup answered (may re-send held chunks)"),
    Metric("pd_waits", COUNTER, "PD consumer: requests that found fewer chunks than the producer reported, "
                                "and waited"),
    Metric("pd_relookups", COUNTER, "PD consumer: lookups repeated while waiting for the producer's chunks"),
    Metric("pd_wait_timeouts", COUNTER, "PD consumer: waits that ran out (pd_wait_ms); the missing chunks are "
                                        "recomputed"),
    Metric("pd_pool_down", COUNTER, "PD consumer: waits ended at once because every server owning the first "
                                    "missing chunk is down; the missing chunks are recomputed"),
    Metric("held_requests", COUNTER, "finished requests whose blocks are kept until their saves are acknowledged"),
    Metric("weights_updates", COUNTER, "live weight versions bound into the keys after a measurement "
                                       "(kvfabric_vllm.weights)"),
    Metric("weights_retires", COUNTER, "weights_retire: previous weights' namespaces retired pool-wide (Client.retire)"),
    Metric("weights_retire_errors", COUNTER, "weights_retire: retires some server did not apply (the old KV ages "
                                             "out by eviction there; never loaded: its keys are not asked for)"),
    Metric("weights_unversioned", COUNTER, "times the weights the workers hold became unknown (pool off for new "
                                           "requests until refresh_weights_version)"),
    # worker side
    Metric("load_chunks", COUNTER, "chunks copied into paged KV blocks"),
    Metric("load_tokens", COUNTER, "tokens copied into paged KV blocks (loaded)"),
    Metric("load_failed_chunks", COUNTER, "chunks that missed or were malformed (recomputed)"),
    Metric("load_errors", COUNTER, "whole load steps that raised (recomputed)"),
    Metric("async_loads", COUNTER, "loads run between steps (load_kv_async)"),
    Metric("save_jobs", COUNTER, "put jobs queued (one per request per step that completed chunks)"),
    Metric("save_jobs_done", COUNTER, "put jobs finished, whatever their outcome"),
    Metric("save_chunks", COUNTER, "chunks handed to the pool (stored or already there)"),
    Metric("save_dropped_chunks", COUNTER, "chunks the pool did not take (down, full, slow)"),
    Metric("save_skipped_chunks", COUNTER, "chunks not even sent (pending-save bound reached)"),
    Metric("save_errors", COUNTER, "save jobs that raised"),
    Metric("held_released", COUNTER, "of held_requests: reported in get_finished's finished_sending (blocks "
                                     "freed)"),
    Metric("save_abandoned_jobs", COUNTER, "save jobs still pending when the shutdown drain bound ran out"),
    Metric("client_errors", COUNTER, "the kvfabric client could not be built (pool off)"),
    Metric("transfer_buffer_bytes", COUNTER, "host memory allocated for the transfer buffer (KV on a GPU: "
                                             "pinned; once, at start)"),
    Metric("save_no_buffer_chunks", COUNTER, "chunks not saved: the transfer buffer had no room (transfer_buffer_mb)"),
    Metric("load_no_buffer_chunks", COUNTER, "chunks recomputed: the transfer buffer had no room for their load"),
    Metric("weights_refused_chunks", COUNTER, "chunks of loads (recomputed) and saves (dropped) refused: planned "
                                              "under other weights than the rank holds"),
    # worker side, through vLLM's KV-connector stats (per step, aggregated by vLLM)
    Metric("load_bytes", COUNTER, "KV bytes loaded from the pool into paged blocks"),
    Metric("save_bytes", COUNTER, "KV bytes handed to the pool"),
    Metric("load_seconds", HISTOGRAM, "time of one load (a step's or an async load's pool reads and copies)"),
    Metric("save_seconds", HISTOGRAM, "time of one save job (gather + put)"),
)
#: The vLLM connector's plain counters (those kept in ``Counters``), in declaration order.
VLLM_COUNTERS: tuple[str, ...] = tuple(
    n for n, m in VLLM.items() if m.kind == COUNTER and n not in ("load_bytes", "save_bytes"))

# ------------------------------------------------------------------ LMCache connector

#: The LMCache connector's counters (per connector instance).
LMCACHE: dict[str, Metric] = _table(
    Metric("lookups", COUNTER, "batched_contains lookups asked (one pool LOOKUP each)"),
    Metric("lookup_hits", COUNTER, "keys of the leading runs those lookups found"),
    Metric("gets", COUNTER, "objects asked for"),
    Metric("get_hits", COUNTER, "objects returned"),
    Metric("get_misses", COUNTER, "objects not returned"),
    Metric("get_copies", COUNTER, "hits that took a copy (shorter chunks, the older format) instead of landing in place"),
    Metric("bad_values", COUNTER, "objects returned whose layout did not match (dropped, a miss)"),
    Metric("alloc_failures", COUNTER, "objects LMCache could not allocate memory for (a miss)"),
    Metric("puts", COUNTER, "objects offered to the pool"),
    Metric("puts_stored", COUNTER, "objects stored"),
    Metric("puts_existed", COUNTER, "objects already stored"),
    Metric("puts_dropped", COUNTER, "objects the pool did not take"),
    Metric("pool_errors", COUNTER, "pool calls that raised (degraded to a miss)"),
)


def names(table: dict[str, Metric], kind: str | None = None) -> tuple[str, ...]:
    """The names declared in ``table`` (of ``kind`` only, when given), in declaration order."""
    return tuple(n for n, m in table.items() if kind is None or m.kind == kind)


def lat_histogram(buckets: list[int]) -> list[tuple[str, int]]:
    """Cumulative Prometheus buckets ``[(le in seconds, count), ..., ("+Inf", total)]`` from one
    ``lat_<op>_us_buckets`` list (per-bucket counts, see the module docstring)."""
    if len(buckets) != LAT_BUCKETS:
        raise ValueError(f"expected {LAT_BUCKETS} buckets, got {len(buckets)}")
    out, total = [], 0
    for bound, n in zip(LAT_BOUNDS_US, buckets):
        total += int(n)
        out.append((repr(bound / 1e6), total))
    out.append(("+Inf", total + int(buckets[-1])))
    return out


def lat_quantile(buckets: list[int], q: float) -> float | None:
    """Upper bound (seconds) of the bucket holding quantile ``q`` of one ``lat_<op>_us_buckets`` list (or of
    the difference of two); None when it counts nothing, ``inf`` when the quantile is in the last bucket."""
    total = sum(buckets)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for bound, n in zip(LAT_BOUNDS_US, buckets):
        seen += n
        if seen >= rank:
            return bound / 1e6
    return float("inf")


__all__ = ["CLIENT", "HTTP", "LAT_BOUNDS_US", "LAT_BUCKETS", "LAT_OPS", "LMCACHE", "Metric", "SERVER", "VLLM",
           "lat_histogram", "lat_quantile", "names"]
