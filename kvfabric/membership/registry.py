"""Where members live in etcd, how a member is encoded, and a server's registration under a lease.

Layout: one key per server, ``/kvfabric/clusters/<cluster>/members/<server_id>``,
whose value is a JSON object::

    {"server_id": "s1", "addresses": {"tcp": "10.0.0.5:7070", "native": "10.0.0.5:7070"},
     "capacity": 4294967296, "transports": ["tcp", "native"], "hostname": "...",
     "pid": 1234, "version": "0.1.0", "started_unix": 1764550000.0}

attached to a lease of ``ttl_s`` seconds. The key is named by the server id,
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

import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from .etcd import EtcdClient, EtcdError
from . import Member

__all__ = ["Registration", "member_prefix", "member_key", "encode_member", "decode_member", "check_cluster_name"]

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


def encode_member(member: Member) -> bytes:
    doc: dict[str, Any] = dict(member.info)
    doc.update(server_id=member.server_id, addresses=dict(member.addresses), capacity=member.capacity)
    return json.dumps(doc, sort_keys=True).encode()


def decode_member(value: bytes) -> Member | None:
    """The member a registration value describes, or None (logged) when it is not one."""
    try:
        doc = json.loads(value)
        server_id = doc.pop("server_id")
        addresses = doc.pop("addresses")
        capacity = int(doc.pop("capacity", 0))
        if not isinstance(server_id, str) or not server_id or not isinstance(addresses, Mapping):
            raise ValueError("server_id or addresses missing")
        address = addresses.get("tcp")
        if not isinstance(address, str) or ":" not in address:
            raise ValueError("no tcp address")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("kvfabric: ignoring a malformed member entry in etcd (%s): %r", e, value[:200])
        return None
    return Member(server_id=server_id, address=address, addresses=dict(addresses), capacity=capacity, info=doc)


class Registration:
    """A server's entry in etcd, kept alive under a lease (see the module docstring)."""

    def __init__(self, etcd: EtcdClient, cluster: str, member: Member, ttl_s: int = 10) -> None:
        if not 1 <= int(ttl_s) <= 3600:
            raise ValueError(f"etcd lease TTL must be in 1..3600 seconds, got {ttl_s!r}")
        self.etcd = etcd
        self.cluster = check_cluster_name(cluster)
        self.member = member
        self.key = member_key(cluster, member.server_id)
        self.ttl_s = int(ttl_s)
        self.lease = 0
        self.registrations = 0  # how many times the key was (re)put
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvfabric-etcd-lease", daemon=True)

    def start(self) -> bool:
        """Register once now, then keep the lease alive in the background; True when the first try worked."""
        ok = self._register()
        self._thread.start()
        return ok

    def _register(self) -> bool:
        try:
            lease = self.etcd.lease_grant(self.ttl_s)
            info = dict(self.member.info, lease=lease)
            value = encode_member(Member(self.member.server_id, self.member.address, self.member.addresses,
                                         self.member.capacity, info))
            self.etcd.put(self.key, value, lease=lease)
        except EtcdError as e:
            log.warning("kvfabric: cannot register %s in etcd %s (%s); retrying", self.member.server_id, self.etcd.url, e)
            self.lease = 0
            return False
        self.lease = lease
        self.registrations += 1
        log.info("kvfabric: registered %s as %s in cluster %s (lease %x, ttl %ds)",
                 self.member.address, self.member.server_id, self.cluster, lease, self.ttl_s)
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

    def stop(self, timeout_s: float = 2.0) -> None:
        """Leave the cluster now: stop refreshing and revoke the lease (its key goes with it). Idempotent;
        when etcd cannot be reached the entry disappears at the lease's expiry instead."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + self.etcd.timeout_s)
        if self.lease:
            t0 = time.monotonic()
            try:
                self.etcd.lease_revoke(self.lease, timeout_s=timeout_s)
                log.info("kvfabric: left cluster %s (%.3fs)", self.cluster, time.monotonic() - t0)
            except EtcdError as e:
                log.warning("kvfabric: cannot deregister from etcd (%s); the entry expires in %ds", e, self.ttl_s)
            self.lease = 0
