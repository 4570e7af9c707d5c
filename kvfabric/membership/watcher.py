"""A client's view of an etcd cluster: read every member once, then follow a watch.

:class:`EtcdMembership` reads ``/kvfabric/clusters/<cluster>/members/`` in
:meth:`~EtcdMembership.start` (one attempt, bounded by ``timeout_s``: when
etcd is unreachable the client starts with no members, every call is a miss,
and the thread keeps trying), delivers the members to ``on_change``, and then
runs one daemon thread that watches the prefix from the revision it read.
Each batch of events produces one ``on_change`` with the whole new member
tuple. When the stream breaks, etcd cancels it (compaction), or it has been
silent for ``idle_s`` seconds, the thread reads the whole prefix again and
watches from there, so a missed event can delay a change but never lose it;
a failed read is retried with backoff (0.1 s doubling to 2 s). ``on_change``
is only called when the member tuple differs from the last one delivered.

The members a client is given are never older than etcd's view by more than
the time an event takes to arrive (a watch), so a server's leave is seen as
soon as its key is deleted: at once for a ``SIGTERM`` (the server revokes its
lease), at the lease's expiry for a crash.

Which records are used (``registry.read_member``): with the pool ``token``,
only records whose proof verifies, stored under their own id's key and lease.
A record that fails is ignored: the key keeps the member it had before (a
forged overwrite of a real server's key changes nothing here, and the server
puts its record back at once), or stays absent. Each refused record is
counted (``count(member_records_refused=1)``) and logged as a WARNING once per
key and revision, with the key and why. Without a token records are unsigned
and every well-formed one is trusted; :meth:`start` logs that once. An etcd
answer that is malformed or over the size cap (``EtcdBadAnswer``) leaves the
members as they were: counted (``etcd_bad_answers``), logged once per kind
of error, and the thread re-reads with backoff. Nothing here raises out of
:meth:`start` for an etcd problem.
"""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Callable

from . import Member, Membership, OnChange
from .etcd import EtcdBadAnswer, EtcdClient, EtcdError, shutdown_connection
from .registry import member_prefix, read_member

__all__ = ["EtcdMembership"]

log = logging.getLogger("kvfabric.membership")


class EtcdMembership(Membership):
    """Members of ``cluster`` in etcd at ``endpoints`` (one URL or a comma-separated list)."""

    #: (key, mod_revision) of refused records remembered so each is counted and logged once; past this
    #: many the memory is cleared (a record refused again is then logged again, never more than once a
    #: revision in a row)
    MAX_REMEMBERED = 4096

    def __init__(self, endpoints: str | EtcdClient, cluster: str, *, timeout_s: float = 5.0, idle_s: float = 30.0,
                 token: str | None = None, count: Callable[..., None] | None = None) -> None:
        self.etcd = endpoints if isinstance(endpoints, EtcdClient) else EtcdClient(endpoints, timeout_s=timeout_s)
        self.cluster = cluster
        self.prefix = member_prefix(cluster)
        self.idle_s = idle_s
        self._token = token or None
        self._count = count or (lambda **kw: None)
        self._refused: set[tuple[bytes, int]] = set()
        self._on_change: OnChange | None = None
        self._by_key: dict[bytes, Member] = {}
        self._delivered: tuple[Member, ...] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._loop, name="kvfabric-etcd-watch", daemon=True)
        self.revision = 0
        self.resyncs = 0  # full reads after the first (stream broke, idle, compaction)
        self.last_error = ""

    @property
    def dynamic(self) -> bool:
        return True

    @property
    def verifies(self) -> bool:
        return self._token is not None

    def members(self) -> tuple[Member, ...]:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> tuple[Member, ...]:
        return tuple(self._by_key[k] for k in sorted(self._by_key))

    def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        if self._token is None:
            log.warning("kvfabric: cluster %s in etcd %s is followed without an auth token: member entries are "
                        "unsigned and any entry is trusted (whoever can write to etcd decides where this client "
                        "sends keys and reads); set auth_token / KVFABRIC_AUTH_TOKEN to accept signed ones only",
                        self.cluster, self.etcd.url)
        try:
            self._read_all()
        except EtcdError as e:
            self._failed(e)
            log.warning("kvfabric: cannot read cluster %s from etcd %s (%s); starting with no members, retrying",
                        self.cluster, self.etcd.url, e)
        self._publish()
        self._thread.start()

    def _failed(self, e: EtcdError) -> None:
        if isinstance(e, EtcdBadAnswer):
            self._count(etcd_bad_answers=1)
        self.last_error = str(e)

    def _accept(self, key: bytes, value: bytes, mod_revision: int, lease: int) -> Member | None:
        """The member of a record, or None (counted, and logged once per key and revision) when it is refused."""
        member, why = read_member(key, value, self._token, lease)
        if member is None:
            with self._lock:
                new = (key, mod_revision) not in self._refused
                if new:
                    if len(self._refused) >= self.MAX_REMEMBERED:
                        self._refused.clear()
                    self._refused.add((key, mod_revision))
            if new:
                self._count(member_records_refused=1)
                log.warning("kvfabric: ignoring member entry %s (mod_revision %d) in etcd %s: %s; not routed to",
                            key.decode("utf-8", "replace")[:300], mod_revision, self.etcd.url, why)
        return member

    def _read_all(self) -> None:
        kvs, revision = self.etcd.range_prefix(self.prefix)
        accepted = {kv.key: self._accept(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in kvs}
        with self._lock:
            # a refused record leaves its key as it was: a forged overwrite does not unseat the real member
            self._by_key = {k: m if m is not None else self._by_key[k] for k, m in accepted.items()
                            if m is not None or k in self._by_key}
            self.revision = revision

    def _publish(self) -> None:
        with self._lock:
            snap = self._snapshot()
            if snap == self._delivered:
                return
            self._delivered = snap
        if self._on_change is not None:
            try:
                self._on_change(snap)
            except Exception:  # the watcher must outlive a bug in a subscriber; it is logged loudly
                log.exception("kvfabric: membership subscriber failed")

    def _keep_conn(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conn = conn
        if self._stop.is_set():
            self._shutdown_conn()

    def _shutdown_conn(self) -> None:
        with self._lock:
            conn = self._conn
        shutdown_connection(conn)

    def _loop(self) -> None:
        backoff = 0.1
        need_read = self.revision == 0
        while not self._stop.is_set():
            try:
                if need_read:
                    self._read_all()
                    self.resyncs += 1
                    self._publish()
                need_read = True
                for events in self.etcd.watch_prefix(self.prefix, self.revision + 1, self._stop,
                                                     idle_timeout_s=self.idle_s, on_open=self._keep_conn):
                    accepted = [(ev, None if ev.kind == "DELETE" else
                                 self._accept(ev.key, ev.value, ev.mod_revision, ev.lease)) for ev in events]
                    with self._lock:
                        for ev, m in accepted:
                            if ev.kind == "DELETE":
                                self._by_key.pop(ev.key, None)
                            elif m is not None:
                                self._by_key[ev.key] = m
                            self.revision = max(self.revision, ev.mod_revision)
                    self._publish()
                    backoff = 0.1
            except EtcdError as e:
                if self._stop.is_set():
                    return
                quiet = "timed out" in str(e)  # an idle stream: re-read and watch again, nothing is wrong
                if not quiet:
                    if str(e) != self.last_error:
                        log.warning("kvfabric: etcd watch of cluster %s: %s; members unchanged, re-reading",
                                    self.cluster, e)
                    self._failed(e)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug here must not end the watch: the members stay as they were, loudly
                log.exception("kvfabric: etcd watch of cluster %s failed; members unchanged, re-reading", self.cluster)
                need_read = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def close(self) -> None:
        self._stop.set()
        self._shutdown_conn()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def __repr__(self) -> str:
        return f"<EtcdMembership {self.etcd.url} cluster={self.cluster} members={len(self._by_key)}>"
