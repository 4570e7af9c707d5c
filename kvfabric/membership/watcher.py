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
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading

from . import Member, Membership, OnChange
from .etcd import EtcdClient, EtcdError
from .registry import decode_member, member_prefix

__all__ = ["EtcdMembership"]

log = logging.getLogger("kvfabric.membership")


class EtcdMembership(Membership):
    """Members of ``cluster`` in etcd at ``endpoints`` (one URL or a comma-separated list)."""

    def __init__(self, endpoints: str, cluster: str, *, timeout_s: float = 5.0, idle_s: float = 30.0) -> None:
        self.etcd = EtcdClient(endpoints, timeout_s=timeout_s)
        self.cluster = cluster
        self.prefix = member_prefix(cluster)
        self.idle_s = idle_s
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

    def members(self) -> tuple[Member, ...]:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> tuple[Member, ...]:
        return tuple(self._by_key[k] for k in sorted(self._by_key))

    def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        try:
            self._read_all()
        except EtcdError as e:
            self.last_error = str(e)
            log.warning("kvfabric: cannot read cluster %s from etcd %s (%s); starting with no members, retrying",
                        self.cluster, self.etcd.url, e)
        self._publish()
        self._thread.start()

    def _read_all(self) -> None:
        kvs, revision = self.etcd.range_prefix(self.prefix)
        found = {}
        for kv in kvs:
            m = decode_member(kv.value)
            if m is not None:
                found[kv.key] = m
        with self._lock:
            self._by_key = found
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
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

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
                    with self._lock:
                        for ev in events:
                            if ev.kind == "DELETE":
                                self._by_key.pop(ev.key, None)
                            else:
                                m = decode_member(ev.value)
                                if m is None:
                                    self._by_key.pop(ev.key, None)
                                else:
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
                        log.warning("kvfabric: etcd watch of cluster %s: %s; re-reading", self.cluster, e)
                    self.last_error = str(e)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)

    def close(self) -> None:
        self._stop.set()
        self._shutdown_conn()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def __repr__(self) -> str:
        return f"<EtcdMembership {self.etcd.url} cluster={self.cluster} members={len(self._by_key)}>"
