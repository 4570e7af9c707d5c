"""Where members live in etcd, how a member is encoded, and a server's registration under a lease.

Layout: one key per server, ``/kvfabric/clusters/<cluster>/members/<server_id>``,
whose value is a JSON object::

    {"server_id": "s1", "addresses": {"tcp": "10.0.0.5:7070", "native": "10.0.0.5:7070"},
     "capacity": 4294967296, "transports": ["tcp", "native"], "hostname": "...",
     "pid": 1234, "version": "0.1.0", "started_unix": 1764550000.0, "lease": 7587...,
     "proof": "<64 hex digits>"}

attached to a lease of ``ttl_s`` seconds (the ``lease`` field).

Signed records: a server with a pool token (``--auth-token``) adds ``proof``,
the hex HMAC-SHA256 keyed by the token's UTF-8 bytes over
``b"kvfabric-member-v1\0"`` + the canonical JSON of the record without
``proof`` (``json.dumps(doc, sort_keys=True, separators=(",", ":"))``,
:func:`member_proof`). A reader with the token (:func:`read_member`) accepts a
record only when its proof matches (constant-time compare), the ``server_id``
it names is the one its key is stored under, and the ``lease`` it names is
the lease etcd has the key attached to, so that someone who can write to etcd
but lacks the token can neither forge a record, nor move a real one to
another id, nor replay one after its server's lease is gone. Without a token
records are unsigned and every well-formed one is trusted (anyone who can
write to etcd then decides where clients send keys and reads); the key must
still match the id.

A server watches its own key (:class:`Registration`): a value that is not
its own record, or a delete it did not make, is logged as an ERROR naming
what was found and the record is put back under its lease at once. The key is named by the server id,
so a server that restarts on another address replaces its own entry instead
of adding a second one, and two servers that claim one id overwrite each
other (an operator error, visible in ``kvfabric cluster ls`` as one member
whose address flips).

:class:`Registration` is the server side: ``start()`` grants the lease and
puts the key (one attempt; when etcd is unreachable it logs and keeps
trying in the background: the server serves either way), a daemon thread
refreshes the lease every ``ttl_s / 3`` seconds and re-registers when the
lease was lost (etcd restarted, or the process stalled past the TTL), and
``stop()`` revokes the lease, which deletes the key at once. A process that
dies without ``stop()`` disappears when the lease expires, ``ttl_s`` seconds
after its last refresh at the latest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from .etcd import EtcdClient, EtcdError, WatchEvent, shutdown_connection
from . import Member

__all__ = ["Registration", "member_prefix", "member_key", "encode_member", "decode_member", "read_member",
           "member_proof", "check_cluster_name", "PROOF_CONTEXT"]

log = logging.getLogger("kvfabric.membership")

KEY_ROOT = "/kvfabric/clusters/"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_cluster_name(name: str) -> str:
    """``name`` if it is 1..64 of ``[A-Za-z0-9._-]``; ValueError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"cluster name must be 1..64 characters of A-Z a-z 0-9 . _ -, got {name!r}")
    return name


def member_prefix(cluster: str) -> bytes:
    """The etcd key prefix under which every member of ``cluster`` is registered."""
    return f"{KEY_ROOT}{check_cluster_name(cluster)}/members/".encode()


def member_key(cluster: str, server_id: str) -> bytes:
    if not server_id or "/" in server_id:
        raise ValueError(f"server id must be non-empty and contain no '/', got {server_id!r}")
    return member_prefix(cluster) + server_id.encode("utf-8")


#: What a member record's proof is computed over, before the record's canonical JSON (module docstring).
PROOF_CONTEXT = b"kvfabric-member-v1\0"
#: A member record larger than this is refused unread (a real one is ~300 bytes).
MAX_RECORD_BYTES = 64 << 10


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def member_proof(doc: Mapping[str, Any], token: str) -> str:
    """The hex HMAC-SHA256 of a record ``doc`` (without ``proof``) under the pool ``token``."""
    return hmac.new(token.encode("utf-8"), PROOF_CONTEXT + _canonical(doc), hashlib.sha256).hexdigest()


def encode_member(member: Member, token: str | None = None) -> bytes:
    """The record of ``member`` as stored in etcd; signed (``proof``) when ``token`` is given."""
    doc: dict[str, Any] = dict(member.info)
    doc.pop("proof", None)
    doc.update(server_id=member.server_id, addresses=dict(member.addresses), capacity=member.capacity)
    if token:
        doc["proof"] = member_proof(doc, token)
    return _canonical(doc)


def _parse_record(value: bytes) -> tuple[Member, dict[str, Any]]:
    """The member a record describes and the whole record; ValueError/TypeError/KeyError when it is not one."""
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(value)} bytes, over {MAX_RECORD_BYTES}")
    doc = json.loads(value)
    if not isinstance(doc, dict):
        raise TypeError("not a JSON object")
    info = dict(doc)
    server_id = info.pop("server_id")
    addresses = info.pop("addresses")
    capacity = info.pop("capacity", 0)
    info.pop("proof", None)
    if not isinstance(server_id, str) or not server_id or not isinstance(addresses, Mapping):
        raise ValueError("server_id or addresses missing")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"bad capacity {capacity!r}")
    address = addresses.get("tcp")
    if not isinstance(address, str) or ":" not in address:
        raise ValueError("no tcp address")
    member = Member(server_id=server_id, address=address, addresses=dict(addresses), capacity=capacity, info=info)
    return member, doc


def decode_member(value: bytes) -> Member | None:
    """The member a record describes, or None (logged) when it is not one. Checks nothing else: readers
    that route use :func:`read_member`."""
    try:
        return _parse_record(value)[0]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        log.warning("kvfabric: ignoring a malformed member entry in etcd (%s): %r", e, value[:200])
        return None


def read_member(key: bytes, value: bytes, token: str | None, lease: int = 0) -> tuple[Member | None, str]:
    """``(member, "")`` when the record ``value`` stored under etcd ``key`` (attached to ``lease``) may be
    routed to, else ``(None, why)``: malformed, stored under another id's key, and with ``token``: no
    proof, a wrong proof, or another lease than the one it was signed with (module docstring). Logs
    nothing: callers log once per key and revision."""
    try:
        member, doc = _parse_record(value)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return None, f"malformed ({type(e).__name__}: {e})"
    claimed = key.rsplit(b"/", 1)[-1].decode("utf-8", "replace")
    if member.server_id != claimed:
        return None, f"claims server id {member.server_id[:64]!r} under the key of {claimed[:64]!r}"
    if not token:
        return member, ""
    proof = doc.pop("proof", None)
    if not isinstance(proof, str) or not proof:
        return None, "unsigned (no proof)"
    if not hmac.compare_digest(proof.encode("ascii", "replace"), member_proof(doc, token).encode()):
        return None, "wrong proof (not signed with this pool's token)"
    if doc.get("lease") != lease:
        return None, f"signed for lease {doc.get('lease')!r} but stored under lease {lease}"
    return member, ""


class Registration:
    """A server's entry in etcd, kept alive under a lease and defended (see the module docstring).

    ``token``: the pool token the record is signed with (None: unsigned). Two daemon threads: the lease
    keeper (refresh every ``ttl_s / 3``, re-register when the lease was lost) and the key guard, which
    watches the server's own key and puts the record back at once when it finds it overwritten or
    deleted (``hijacks`` counts those).
    """

    #: the key guard logs at most LOG_BURST ERRORs (each naming what it found) per LOG_WINDOW_S seconds;
    #: the others are counted in the next one, so an attacker rewriting the key in a loop cannot flood the log
    LOG_BURST = 10
    LOG_WINDOW_S = 60.0
    #: the first put-back is at once; while the key keeps being taken (within REPEAT_S of the last time)
    #: each one waits twice as long, up to MAX_DELAY_S: two servers started with one --server-id (an
    #: operator error) take turns every few seconds instead of rewriting etcd in a hot loop
    REPEAT_S = 30.0
    MAX_DELAY_S = 5.0

    def __init__(self, etcd: EtcdClient, cluster: str, member: Member, ttl_s: int = 10,
                 token: str | None = None) -> None:
        if not 1 <= int(ttl_s) <= 3600:
            raise ValueError(f"etcd lease TTL must be in 1..3600 seconds, got {ttl_s!r}")
        self.etcd = etcd
        self.cluster = check_cluster_name(cluster)
        self.member = member
        self.key = member_key(cluster, member.server_id)
        self.ttl_s = int(ttl_s)
        self.lease = 0
        self.registrations = 0  # how many times the key was (re)put
        self.hijacks = 0  # foreign values or deletes of our key found and undone
        self._token = token or None
        self._lock = threading.Lock()
        self._mine: list[tuple[bytes, int]] = []  # (value, lease) we put lately, newest last: never foreign
        self._revision = 0  # etcd revision of our latest put: the guard watches from after it
        self._window = (0.0, 0)  # (start of the current log window, ERRORs logged in it)
        self._last_hijack = -1e9  # monotonic time of the last foreign value or delete
        self._delay = 0.0  # wait before the next put-back (see REPEAT_S)
        self._unlogged = 0
        self._stop = threading.Event()
        self._conn: Any = None  # the guard's watch connection, shut down by stop()
        self._thread = threading.Thread(target=self._loop, name="kvfabric-etcd-lease", daemon=True)
        self._guard = threading.Thread(target=self._guard_loop, name="kvfabric-etcd-guard", daemon=True)

    def start(self) -> bool:
        """Register once now, then keep the lease alive and guard the key in the background; True when the
        first try worked."""
        ok = self._register()
        self._thread.start()
        self._guard.start()
        return ok

    def _value(self, lease: int) -> bytes:
        info = dict(self.member.info, lease=lease)
        return encode_member(Member(self.member.server_id, self.member.address, self.member.addresses,
                                    self.member.capacity, info), self._token)

    def _put(self, lease: int) -> None:
        """Put our record under ``lease`` (EtcdError when etcd refuses or cannot be reached)."""
        value = self._value(lease)
        with self._lock:
            self._mine = (self._mine + [(value, lease)])[-4:]
        revision = self.etcd.put(self.key, value, lease=lease)
        with self._lock:
            self._revision = max(self._revision, revision)

    def _register(self) -> bool:
        try:
            lease = self.etcd.lease_grant(self.ttl_s)
            self._put(lease)
        except EtcdError as e:
            log.warning("kvfabric: cannot register %s in etcd %s (%s); retrying", self.member.server_id, self.etcd.url, e)
            self.lease = 0
            return False
        self.lease = lease
        self.registrations += 1
        log.info("kvfabric: registered %s as %s in cluster %s (lease %x, ttl %ds%s)",
                 self.member.address, self.member.server_id, self.cluster, lease, self.ttl_s,
                 ", signed" if self._token else ", unsigned: no --auth-token")
        return True

    def _loop(self) -> None:
        period = max(self.ttl_s / 3.0, 0.2)
        while not self._stop.wait(period if self.lease else 1.0):
            if not self.lease:
                self._register()
                continue
            try:
                ttl = self.etcd.lease_keepalive(self.lease)
            except EtcdError as e:
                log.warning("kvfabric: etcd lease refresh failed (%s); retrying", e)
                continue  # the next refresh (or re-registration once the lease is gone) fixes it
            if ttl <= 0:
                log.warning("kvfabric: etcd lease of %s was lost; registering again", self.member.server_id)
                self._register()

    # -- the key guard ---------------------------------------------------

    def _keep_conn(self, conn: Any) -> None:
        self._conn = conn
        if self._stop.is_set():
            shutdown_connection(conn)

    def _guard_loop(self) -> None:
        """Watch our key from after our latest put; check it again after every broken watch."""
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if not self.lease:
                    self._stop.wait(0.5)  # the lease keeper registers first
                    continue
                kvs, revision = self.etcd.range(self.key)
                found = kvs[0] if kvs else None
                self._check(WatchEvent("PUT", self.key, found.value, found.mod_revision, found.lease) if found
                            else WatchEvent("DELETE", self.key, b"", revision))
                for events in self.etcd.watch(self.key, None, revision + 1, self._stop, idle_timeout_s=30.0,
                                              on_open=self._keep_conn):
                    for ev in events:
                        self._check(ev)
                    backoff = 0.1
            except EtcdError as e:
                if self._stop.is_set():
                    return
                if "timed out" not in str(e):  # an idle watch is normal: check and watch again
                    log.debug("kvfabric: guard of %s: %s", self.member.server_id, e)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)

    def _check(self, ev: WatchEvent) -> None:
        """``ev`` is the state of our key: put our record back when it is not ours (nothing once stopping)."""
        if self._stop.is_set() or not self.lease:
            return
        with self._lock:
            ours = ev.kind == "PUT" and (ev.value, ev.lease) in self._mine
            if ours:
                return
            self.hijacks += 1
            now = time.monotonic()
            start, logged = self._window
            if now - start >= self.LOG_WINDOW_S:
                start, logged = now, 0
            loud = logged < self.LOG_BURST
            self._window = (start, logged + loud)
            if loud:
                unlogged, self._unlogged = self._unlogged, 0
            else:
                self._unlogged += 1
            repeated = now - self._last_hijack < self.REPEAT_S
            self._delay = min(max(self._delay * 2, 0.05), self.MAX_DELAY_S) if repeated else 0.0
            self._last_hijack, delay = now, self._delay
        if loud:
            found = "deleted" if ev.kind == "DELETE" else f"overwritten with {ev.value[:200]!r} (lease {ev.lease:x})"
            log.error("kvfabric: our member key %s in etcd %s was %s at mod_revision %d; putting our record back "
                      "under lease %x%s", self.key.decode("utf-8", "replace"), self.etcd.url, found, ev.mod_revision,
                      self.lease, f" ({unlogged} more such changes since the last report)" if unlogged else "")
        if delay and self._stop.wait(delay):
            return
        try:
            self._put(self.lease)
        except EtcdError as e:  # a lease that is gone: the keeper registers again; else the next event retries
            log.warning("kvfabric: cannot put back %s (%s)", self.member.server_id, e)
            if "lease not found" in str(e):
                self.lease = 0

    def stop(self, timeout_s: float = 2.0) -> None:
        """Leave the cluster now: stop refreshing and guarding and revoke the lease (its key goes with it).
        Idempotent; when etcd cannot be reached the entry disappears at the lease's expiry instead."""
        if self._stop.is_set():
            return
        self._stop.set()  # first: the guard must not put back the key the revoke deletes
        shutdown_connection(self._conn)
        for t in (self._thread, self._guard):
            if t.is_alive():
                t.join(timeout_s + self.etcd.timeout_s)
        if self.lease:
            t0 = time.monotonic()
            try:
                self.etcd.lease_revoke(self.lease, timeout_s=timeout_s)
                log.info("kvfabric: left cluster %s (%.3fs)", self.cluster, time.monotonic() - t0)
            except EtcdError as e:
                log.warning("kvfabric: cannot deregister from etcd (%s); the entry expires in %ds", e, self.ttl_s)
            self.lease = 0

