"""``kvfabric.Client``: routing, batching, parallel fan-out, deadlines, degrade-to-miss.

How a call runs:

1. Every key is routed with rendezvous hashing (``sharding``, in C when the
   extension is built) to its owner servers (``replicas`` of them, best first),
   or, with ``placement=``, by its placement key: the keys of one group (a KV
   chunk's layer objects) share their owners, a PUT carries each group whole
   in one frame (``groups``/``group_parts``) and lookups count whole groups.
2. Keys are grouped per shard, in the caller's order, and each shard gets one
   job: its requests (split only where the key count or payload exceeds the
   server's advertised limits) run back to back on one pooled connection.
3. Jobs run in parallel, one in the calling thread and the rest on a shared
   thread pool, all under one deadline (``timeout_s`` from the call's start).
   At the deadline, jobs that have not started are cancelled and running ones
   stop at their next socket operation, so nothing writes into the caller's
   buffers after the call returns. ``lookup`` and ``exists`` (small requests,
   tiny replies) instead send every shard's request from the calling thread
   and read the replies as they arrive, over the shards' idle pooled
   connections (:meth:`Client._converse`); only shards that need a connect
   or a wait for a busy connection go to the pool. Same deadline, same
   degrade-to-miss.

Degrade-to-miss: when a shard is dead, refuses connections, breaks a
connection, sends garbage or misses the deadline, its keys become misses (its
puts counted drops) for that call, the shard is marked down, and a background
thread reconnects it with exponential backoff (``reconnect_backoff_s`` doubling
up to ``reconnect_backoff_max_s``). While a shard is down, calls skip it at
once instead of waiting. None of this raises out of ``put``, ``get_into``,
``get``, ``exists``, ``lookup``, ``delete``, ``stats`` or ``ping``.

What does raise: programming errors (``TypeError``/``ValueError``: keys that
are not 1..64 bytes, a buffer that is read-only, not contiguous or too small
for the object found, mismatched lengths, an object larger than
``protocol.MAX_OBJECT_BYTES``), using a closed client, and, when the client is
built, a forced transport that is unavailable or a server that rejects the
auth token or protocol version, or that this client refuses because it does
not prove it holds the token (protocol 3: ``AuthError``; such a server is
counted in ``servers_refused`` and never sent a key).

Membership and ownership: the servers come from a static list
(``Client(servers)``) or from etcd (``Client(etcd=URL, cluster=NAME)``,
``kvfabric/membership/``), which reports joins and leaves while the client
runs. Keys are routed over server *ids*, never over address strings: a shard
routes under the id its server reported in HELLO; before its first HELLO,
under the id etcd published for it or, for a static entry, under its
address as configured (``"127.0.0.1:7070"``, which is also a server's
default id when it listens there). So two clients that list the same
servers in a different order or spelling (``localhost`` vs ``127.0.0.1``)
route every key identically once connected, and a server that moves to a
new address keeps its keys. Each change of members or of a learned id
builds a new routing view (ids and shards, swapped in one assignment);
a call routes with the view it started with, and keys routed to a shard
that left meanwhile are misses for that call. Two entries whose servers
report the same id are one shard for routing (the first listed). With a
dynamic membership (etcd), a shard marked down also leaves the view until
it reconnects (its keys go to the next server in rendezvous order), and
for ``handoff_s`` after any change a key that misses on its owner is asked
of its previous owner and re-put (``kvfabric/membership/handoff.py``).

Thread safety: one client may be shared by many threads; each shard keeps up
to ``connections_per_server`` connections and a thread waits (until its
deadline) when all of them are busy.

Who owns what: this module holds the ``Client`` (routing, batching, fan-out,
deadlines, degrade-to-miss); ``kvfabric/_plan.py`` the pure helpers it is
built from (``plan_chunks``, ``leading_run``, ``combine_puts``, ``PutResult``;
unit tested without sockets, re-exported here); ``kvfabric/_reads.py`` the GET calls and their
checksum checks; ``kvfabric/_routing.py`` the membership side (first
contact, following joins and leaves, the routing view, key -> owner tables). ``kvfabric/_shard.py`` holds the per-shard
connection pool, the up/down state, the background reconnector and the
client's counters; ``kvfabric/transport/`` moves the bytes.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import protocol, sharding, transport
from ._fanout import Conversation, _FanOut, _small
from ._shard import _Counters, _Reconnector, _Registration, _Shard
from .config import ClientConfig
from .transport import ucx_info
from .errors import ConfigError, ConnectionClosed, ErrorCode, KVFabricError, RetireError
from .keys import BlockKey, KeyHasher, Namespace, namespace_tag
from .membership import Membership, StaticMembership
from .membership.handoff import HandOff, PreviousViews, Repairer
from ._plan import (LookupRun, PutResult, check_contiguous_groups, combine_puts, leading_run, plan_chunks, plan_groups,
                    whole_group_run, whole_groups)
from ._reads import _Reads
from ._routing import _Routing, _View
from .protocol import PutStatus

__all__ = ["Client", "LookupRun", "PutResult", "plan_chunks", "leading_run", "combine_puts"]

log = logging.getLogger("kvfabric.client")

try:  # the key check in one C pass; a client-only install (no extension) runs the loop
    from ._native import check_keys as _c_check_keys
except ImportError:  # pragma: no cover - depends on the build
    _c_check_keys = None

_checksum = protocol.checksum  # bound to the key (protocol 2)


def _group_fields(group: list[bytes] | None, chunk: list[int]) -> dict[str, Any]:
    """PUT's ``groups``/``group_parts`` fields for the keys ``chunk`` (none without groups): each key's
    group and its group's part count, which is the length of the group's run in ``chunk``
    (``plan_groups`` puts every key of a group in the call in one request, consecutively)."""
    if group is None:
        return {}
    names = [group[i] for i in chunk]
    runs = Counter(names)
    return {"groups": names, "group_parts": [runs[g] for g in names]}


class Client(_Routing, _FanOut, _Reads, HandOff):
    """A sharded client over a list of pool servers (see the module docstring).

    ``servers`` are ``"host:port"`` strings (``config.servers`` when empty);
    or ``etcd=URL, cluster=NAME`` (``config.etcd``/``config.cluster``) follow
    a cluster's members in etcd instead. Construction connects to every server
    in parallel; servers that cannot be reached start out down (misses) and
    are retried in the background. An etcd that cannot be read starts the
    client with no members (every call a miss) while it keeps trying. Raises
    ``ConfigError`` for a bad server list or replica count, or both a list and
    etcd, ``TransportUnavailable`` for a forced transport that cannot be used,
    and ``RemoteError`` naming the server when a server rejects the auth token
    or protocol version, or does not prove it holds the token. With ``allow_rejects=True`` such servers instead
    start out down (logged as an error with their address, shown in
    ``stats()["client"]["shards"][address]["last_error"]``) and are retried in
    the background like unreachable ones, so a fixed token or an upgraded
    server joins later; the constructor then raises only when every server
    rejects (an engine plugin that must stay up with the servers that accept
    it passes True).
    """

    def __init__(
        self,
        servers: Sequence[str] = (),
        *,
        namespace: Namespace | None = None,
        config: ClientConfig | None = None,
        etcd: str | None = None,
        cluster: str | None = None,
        membership: Membership | None = None,
        allow_rejects: bool = False,
    ) -> None:
        config = config or ClientConfig()
        if servers:
            config = config.with_(servers=tuple(servers))
        if etcd is not None or cluster is not None:
            config = config.with_(etcd=config.etcd if etcd is None else etcd, cluster=cluster or config.cluster)
        if config.etcd and config.servers:
            raise ConfigError("give a Client servers or etcd=URL, not both")
        self._counters = _Counters()
        if membership is None:
            if config.etcd:
                from .membership.etcd import EtcdClient, EtcdError
                from .membership.watcher import EtcdMembership

                try:
                    etcd_client = EtcdClient(config.etcd, timeout_s=config.timeout_s, ca_file=config.etcd_ca,
                                             cert_file=config.etcd_cert, key_file=config.etcd_key)
                except EtcdError as e:  # a bad URL or TLS file: configuration, not an etcd outage
                    raise ConfigError(str(e)) from None
                membership = EtcdMembership(etcd_client, config.cluster, token=config.auth_token,
                                            count=self._counters.add)
            elif config.servers:
                membership = StaticMembership(config.servers)
            else:
                raise ConfigError("a Client needs at least one server ('host:port') or etcd=URL")
        if not membership.dynamic and config.replicas > len(membership.members()):
            raise ConfigError(f"replicas={config.replicas} but only {len(membership.members())} servers")
        self.config = config
        self.namespace = namespace
        self._hasher = KeyHasher(config.key_algorithm, config.key_secret)
        self._closed = False
        self._reconnector = _Reconnector(lambda: self._closed, join_timeout_s=config.connect_timeout_s + config.timeout_s + 1)
        self._registration = _Registration(self._counters)
        # Membership state, changed under _members_lock by _apply_members / _on_identity only:
        # _shards: the current members' shards (rebound, never mutated); _view: what keys route over;
        # _by_index: shard.index -> shard, for every shard a view may still name (weak: retired ones go).
        self._membership = membership
        self._members_lock = threading.Lock()
        self._next_index = 0
        self._shards: list[_Shard] = []
        self._by_index: weakref.WeakValueDictionary[int, _Shard] = weakref.WeakValueDictionary()
        self._view = _View.of((), ())
        self._previous = PreviousViews()  # replaced views kept for hand-off (membership/handoff.py)
        self._repairer = Repairer(self)
        self.servers: tuple[str, ...] = ()
        self._started = False
        n = 64 if membership.dynamic else len(membership.members())
        self._pool = ThreadPoolExecutor(
            max_workers=min(64, n * config.connections_per_server),
            thread_name_prefix="kvfabric-fanout",
        )
        try:
            membership.start(self._apply_members)
            self._initial_connect(allow_rejects)
        except BaseException:
            self.close()
            raise
        self._started = True
        self._reconnector.start(lambda: self._shards)

    # ------------------------------------------------------------------ lifecycle

    def register_buffers(self, buffers: Sequence[Any], *, max_buffers: int = 64, max_bytes: int = 4 << 30) -> None:
        """Register receive buffers the caller reuses (an engine's staging buffer) on every native connection.

        ``get_into`` objects whose buffer lies inside one of them (the buffer or
        any slice) are then received with io_uring ``READ_FIXED`` instead of
        ``recvmsg`` (see ``NativeConnection.register_buffers``); on ``nixl``
        connections they are registered with NIXL once, and READs into them
        register nothing per call (``NixlConnection.register_buffers``). Each pooled
        ``native`` or ``nixl`` connection registers the current set the next time it is
        used; ``tcp`` and ``shm`` connections ignore it. Replaces an earlier
        set. Limits are checked now (ValueError, nothing changed); a connection
        that cannot register later keeps recvmsg, logged and counted in
        ``stats()["client"]["buffer_registration_failures"]``. The buffers stay
        exported (a bytearray cannot be resized) while any connection holds
        them: after :meth:`unregister_buffers` or a replacement, until each
        connection is next used, and at the latest until ``close``.
        """
        self._check_open()
        from .transport.native import check_registration

        self._registration.set(check_registration(buffers, max_buffers=max_buffers, max_bytes=max_bytes))

    def unregister_buffers(self) -> None:
        """Drop the registered set; each native or nixl connection unregisters when next used."""
        self._registration.set(None)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every connection and stop background threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._membership.close()
        self._reconnector.wake()
        self._repairer.close(self.config.timeout_s + 1)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._previous.clear()
        for s in self._shards:
            s.close()
        self._registration.set(None)
        self._reconnector.join()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fan-out core

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosed("the client is closed")

    def _deadline(self, timeout_s: float | None) -> float:
        t = self.config.timeout_s if timeout_s is None else timeout_s
        if not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"timeout_s must be > 0, got {t!r}")
        return time.monotonic() + t

    def _scatter(self, groups: dict[int, list[int]], make_job: Callable[[_Shard, list[int]], Any], deadline: float) -> dict[int, bool]:
        """One job per shard of ``groups`` (``make_job(shard, key_indices)``), run by :meth:`_fan_out`."""
        if len(groups) == 1:  # one shard (the common call): run here, without the fan-out's bookkeeping
            (s, idx), = groups.items()
            shard = self._by_index.get(s)  # a shard gone since routing: its keys miss
            return {s: shard is not None and self._on_shard(shard, deadline, make_job(shard, idx))}
        shards = {s: self._by_index.get(s) for s in groups}
        order = [s for s in groups if shards[s] is not None]  # a shard gone since routing: its keys miss
        jobs = [(shards[s], make_job(shards[s], groups[s])) for s in order]
        done = dict.fromkeys(groups, False)
        done.update(zip(order, self._fan_out(jobs, deadline)))
        return done

    def _talk(self, groups: dict[int, list[int]], make_talk: Callable[[_Shard, list[int]], Callable[[], Conversation]],
              keys: list[bytes], deadline: float) -> dict[int, bool]:
        """One conversation per shard of ``groups`` (``make_talk(shard, key_indices)``), run by
        :meth:`_converse`; a shard's requests count as small when their keys fit ``_fanout._SMALL_REQUEST_BYTES``."""
        shards = {s: self._by_index.get(s) for s in groups}
        order = [s for s in groups if shards[s] is not None]  # a shard gone since routing: its keys miss
        talks = [(shards[s], make_talk(shards[s], groups[s]), _small(keys, groups[s])) for s in order]
        done = dict.fromkeys(groups, False)
        done.update(zip(order, self._converse(talks, deadline)))
        return done

    @staticmethod
    def _by_owner(owners: list[list[int]], rank: int | None = None, idx: Sequence[int] | None = None) -> dict[int, list[int]]:
        """Key indices per shard, in key order: the owner at ``rank``, or every owner (``rank=None``)."""
        groups: dict[int, list[int]] = {}
        for i in range(len(owners)) if idx is None else idx:
            for s in owners[i] if rank is None else owners[i][rank : rank + 1]:
                groups.setdefault(s, []).append(i)
        return groups

    def _chunks(self, shard: _Shard, idx: list[int], nbytes: Callable[[int], int] | None = None) -> list[list[int]]:
        max_keys = min(self.config.max_batch_keys, shard.limits.max_keys_per_batch)
        return plan_chunks(idx, max_keys, shard.limits.max_payload_bytes, nbytes)

    # ------------------------------------------------------------------ validation

    @staticmethod
    def _keys(keys: Sequence[bytes]) -> list[bytes]:
        if isinstance(keys, (bytes, bytearray, str)):
            raise TypeError("keys must be a sequence of keys, not a single key")
        out = list(keys)
        if _c_check_keys is not None and _c_check_keys(out, protocol.MAX_KEY_BYTES):
            return out  # all good, checked in one C pass; otherwise the loop names the first bad key
        for k in out:
            if type(k) is not bytes:
                raise TypeError(f"a key must be bytes, got {type(k).__name__}")
            if not 1 <= len(k) <= protocol.MAX_KEY_BYTES:
                raise ValueError(f"a key must be 1..{protocol.MAX_KEY_BYTES} bytes, got {len(k)}")
        return out

    def _placement(self, keys: list[bytes], placement: Sequence[bytes] | None,
                   groups: Sequence[bytes] | None = None) -> tuple[list[bytes], list[bytes] | None]:
        """``(route, group)`` of a call: what each key is routed by (its placement key, or the key itself)
        and its group key (``groups[i]``, default its placement key; None without ``placement``).
        Placement and group keys are checked like keys (1..64 bytes); every key of a group must share
        one placement key (else its parts would be stored on different servers)."""
        if placement is None:
            if groups is not None:
                raise ValueError("groups= needs placement= (a group is placed by its placement key)")
            return keys, None
        route = self._keys(sharding.route_keys(keys, placement))
        if groups is None:
            return route, route
        if isinstance(groups, (bytes, bytearray, str)):
            raise TypeError("groups must be a sequence of keys (one per key), not a single key")
        group = self._keys(groups)
        if len(group) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(group)} group keys")
        placed: dict[bytes, bytes] = {}
        for i, (g, r) in enumerate(zip(group, route)):
            if placed.setdefault(g, r) != r:
                raise ValueError(f"key {i}: group {g.hex()[:32]} has two placement keys (a group is placed whole)")
        return route, group

    # ------------------------------------------------------------------ public API

    def prefix_keys(self, tokens: Any) -> list[BlockKey]:
        """Block keys of ``tokens`` under this client's namespace, algorithm and secret."""
        if self.namespace is None:
            raise ConfigError("prefix_keys needs a Client built with namespace=...")
        return self._hasher.prefix_keys(self.namespace, tokens)

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        parents: Sequence[bytes | None] | None = None,
        placement: Sequence[bytes] | None = None,
        groups: Sequence[bytes] | None = None,
        ns_tag: bytes | None = None,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Store ``values[i]`` (any contiguous buffer) under ``keys[i]`` on all its owners.

        ``parents[i]``, when given, is the key of the block before ``keys[i]``
        in its prompt (prefix-aware eviction uses it). ``placement[i]``, when
        given, is the key ``keys[i]`` is routed by (its group's placement key:
        every key that shares it has the same owners), and ``groups[i]`` the
        group it is stored in (default: its placement key; give it when one
        placement key places several groups, e.g. the chunks of a segment).
        A group's keys (all of them in this call) go to each owner in one
        request, never split: a group that alone exceeds a server's request
        limits, or holds one object over its object limit, is refused whole
        (counted dropped). ``ns_tag`` (16 bytes, :func:`kvfabric.keys.namespace_tag`)
        tags every object so that :meth:`retire` of the tag drops them pool-wide; such
        PUTs travel as frames on the socket even on shm and nixl connections. Never
        raises for a failing shard: those keys count as dropped.
        """
        self._check_open()
        keys = self._keys(keys)
        if ns_tag is not None and (type(ns_tag) is not bytes or len(ns_tag) != protocol.NS_TAG_BYTES):
            raise ValueError(f"ns_tag must be {protocol.NS_TAG_BYTES} bytes (kvfabric.keys.namespace_tag)")
        route, group = self._placement(keys, placement, groups)
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        views = []
        for v in values:
            try:
                view = memoryview(v).cast("B")
            except TypeError as e:
                raise TypeError(f"values must be contiguous buffers: {e}") from None
            if view.nbytes > protocol.MAX_OBJECT_BYTES:
                raise ValueError(f"object of {view.nbytes} bytes exceeds MAX_OBJECT_BYTES={protocol.MAX_OBJECT_BYTES}")
            views.append(view)
        deadline = self._deadline(timeout_s)
        sums = [_checksum(k, v) for k, v in zip(keys, views)]
        owners = self._owners(route)
        status: list[list[int]] = [[-1] * self.config.replicas for _ in keys]  # -1: not stored by that owner

        def job_for(shard: _Shard, idx: list[int]):
            def job(conn: transport.Connection, deadline: float) -> None:
                big = {i for i in idx if views[i].nbytes > shard.limits.max_object_bytes}
                if group is not None:  # one object over the limit refuses its whole group
                    big_groups = {group[i] for i in big}
                    big = {i for i in idx if group[i] in big_groups}
                    max_keys = min(self.config.max_batch_keys, shard.limits.max_keys_per_batch)
                    chunks, refused = plan_groups([i for i in idx if i not in big], group.__getitem__, max_keys,
                                                  shard.limits.max_payload_bytes, lambda i: views[i].nbytes)
                    big.update(refused)
                else:
                    chunks = self._chunks(shard, [i for i in idx if i not in big], lambda i: views[i].nbytes)
                for i in big:
                    status[i][owners[i].index(shard.index)] = PutStatus.TOO_LARGE
                for chunk in chunks:
                    msg = protocol.PutRequest(
                        keys=[keys[i] for i in chunk],
                        sizes=[views[i].nbytes for i in chunk],
                        checksums=[sums[i] for i in chunk],
                        parents=None if parents is None else [parents[i] for i in chunk],
                        **_group_fields(group, chunk),
                        ns=ns_tag,
                    )
                    reply = conn.request(msg, [views[i] for i in chunk], deadline=deadline).msg
                    if len(reply.status) != len(chunk):
                        raise protocol.ProtocolError(ErrorCode.MALFORMED, "PUT reply status count mismatch")
                    for i, st in zip(chunk, reply.status):
                        status[i][owners[i].index(shard.index)] = st
                    self._counters.add(requests=1, bytes_out=msg.payload_len())
            return job

        self._scatter(self._by_owner(owners), job_for, deadline)
        result, replica_drops = combine_puts(status)
        self._counters.add(puts_stored=result.stored, puts_existed=result.existed, dropped_puts=result.dropped,
                           replica_puts_dropped=replica_drops)
        return result

    def exists(self, keys: Sequence[bytes], *, placement: Sequence[bytes] | None = None,
               groups: Sequence[bytes] | None = None, timeout_s: float | None = None) -> list[bool]:
        """Which keys some owner holds (all owners asked at once). Failing shards answer False.

        With ``placement`` (and ``groups``, as for :meth:`put`) keys are routed by
        their placement keys and a key counts present only when every key of its
        group in this call is present (on one owner or another)."""
        self._check_open()
        keys = self._keys(keys)
        route, group = self._placement(keys, placement, groups)
        present = [False] * len(keys)
        deadline = self._deadline(timeout_s)
        self._presence(keys, present, deadline, route)
        if group is None:
            self._handoff_exists(keys, present, deadline)
        else:
            whole_groups(present, group)
        return present

    def _presence(self, keys: list[bytes], present: list[bool], deadline: float,
                  route: list[bytes] | None = None) -> None:
        def talk_for(shard: _Shard, idx: list[int]) -> Callable[[], Conversation]:
            def talk() -> Conversation:
                for chunk in self._chunks(shard, idx):
                    reply = (yield protocol.ExistsRequest(keys=list(map(keys.__getitem__, chunk)))).msg
                    if len(reply.present) != len(chunk):
                        raise protocol.ProtocolError(ErrorCode.MALFORMED, "EXISTS reply length mismatch")
                    self._counters.add(requests=1)
                    for i, p in zip(chunk, reply.present):
                        if p:
                            present[i] = True
            return talk

        self._talk(self._by_owner(self._owners(keys if route is None else route)), talk_for, keys, deadline)

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0, *, placement: Sequence[bytes] | None = None,
               groups: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        """Length of the longest leading run of ``keys`` that the pool holds (details: :meth:`lookup_media`,
        which also says how many of them are on a server's SSD tier)."""
        return self.lookup_media(keys, lease_ms, placement=placement, groups=groups, timeout_s=timeout_s,
                                 media=False).count

    def lookup_media(self, keys: Sequence[bytes], lease_ms: int = 0, *, placement: Sequence[bytes] | None = None,
                     groups: Sequence[bytes] | None = None, timeout_s: float | None = None,
                     media: bool = True) -> LookupRun:
        """The longest leading run of ``keys`` that the pool holds, and how many of them are on SSD.

        One LOOKUP per shard, in parallel: shard ``s`` gets its keys in prompt
        order and answers how many of them it holds from the start, so its
        first missing key is its ``count``-th; the run ends at the earliest
        first-missing key over all shards. ``lease_ms`` asks each server to
        pin what it found for that long. A failing shard's keys count as
        missing. With ``replicas > 1`` presence is asked with EXISTS from every
        owner instead (no leases are taken).

        The requests are small, so they normally go out from this thread, all
        shards' at once, and the replies are read as they arrive (see
        :meth:`_converse`); routing runs in C (``sharding.group_by_owner``).

        With ``placement`` (and ``groups``, as for :meth:`put`) keys are routed
        by their placement keys, each group's keys must be consecutive
        (chunk-major: every part of chunk 0, then of chunk 1, ...; else
        ``ValueError``), and the run ends at the start of the first group not
        held whole: a chunk counts only when all its parts are present. Keys of
        one placement key go to one shard, so a prompt's lookup is one request
        per shard holding its placement keys (more only past a server's
        request limits). Hand-off (a membership change) is not applied to
        placement-routed calls.

        ``media`` (issue 26 part 3): each server says where every key it counted
        is and reads nothing from its SSD tier for the lookup (no prefetch into
        DRAM, no lease on those keys; the shared tier is not consulted);
        :attr:`LookupRun.on_ssd` is how many keys of the run only an SSD tier
        holds, for a caller that weighs loading them against recomputing. A GET
        of them then streams from the disk. ``on_ssd`` is None without
        ``media``, and with ``replicas > 1`` (presence then comes from EXISTS,
        which does not say the medium).
        """
        self._check_open()
        keys = self._keys(keys)
        route, group = self._placement(keys, placement, groups)
        if group is not None:
            check_contiguous_groups(group)
        if type(lease_ms) is not int or not 0 <= lease_ms <= protocol.MAX_LEASE_MS:
            raise ValueError(f"lease_ms must be an int in 0..{protocol.MAX_LEASE_MS}, got {lease_ms!r}")
        if not keys:
            return LookupRun(0, 0 if media else None)
        deadline = self._deadline(timeout_s)
        if self.config.replicas > 1:
            present = [False] * len(keys)
            self._presence(keys, present, deadline, route)
            run = next((i for i, p in enumerate(present) if not p), len(keys))
            run = self._handoff_run(keys, run, deadline) if group is None else whole_group_run(run, group)
            self._counters.add(lookup_hits=run, lookup_misses=len(keys) - run)
            return LookupRun(run, None)
        shard_keys = self._primary_groups(route)
        if not shard_keys:  # no members: nothing is held
            self._counters.add(lookup_misses=len(keys))
            return LookupRun(0, 0 if media else None)
        first_missing: dict[int, int] = {}  # shard -> global index of its first missing key
        on_ssd: set[int] = set()             # with media: global indexes a server counted from its SSD tier

        def talk_for(shard: _Shard, idx: list[int]) -> Callable[[], Conversation]:
            def talk() -> Conversation:
                for chunk in self._chunks(shard, idx):
                    msg = protocol.LookupRequest(keys=list(map(keys.__getitem__, chunk)), lease_ms=lease_ms,
                                                 media=media)
                    reply = (yield msg).msg
                    count = reply.count
                    self._counters.add(requests=1)
                    if media:
                        if reply.media is None:  # a server that ignored the flag: the media are unknown
                            raise protocol.ProtocolError(ErrorCode.MALFORMED, "LOOKUP media: the reply has none")
                        on_ssd.update(i for i, m in zip(chunk, reply.media) if m == protocol.MEDIUM_SSD)
                    if count < len(chunk):
                        first_missing[shard.index] = chunk[count]
                        return
            return talk

        for s, good in self._talk(shard_keys, talk_for, keys, deadline).items():
            if not good:  # a failing shard holds nothing, as far as this call knows
                first_missing[s] = shard_keys[s][0]
        run = leading_run(len(keys), list(first_missing.values()))
        run = self._handoff_run(keys, run, deadline) if group is None else whole_group_run(run, group)
        self._counters.add(lookup_hits=run, lookup_misses=len(keys) - run)
        return LookupRun(run, sum(1 for i in on_ssd if i < run) if media else None)

    def delete(self, keys: Sequence[bytes], *, placement: Sequence[bytes] | None = None,
               timeout_s: float | None = None) -> int:
        """Delete ``keys`` from all their owners (routed by ``placement`` when given, as for :meth:`put`);
        returns the number of stored objects removed (a key held by two replicas counts twice).
        Failing shards remove nothing."""
        self._check_open()
        keys = self._keys(keys)
        route, _ = self._placement(keys, placement)
        deadline = self._deadline(timeout_s)
        deleted: Counter[int] = Counter()

        def job_for(shard: _Shard, idx: list[int]):
            def job(conn: transport.Connection, deadline: float) -> None:
                for chunk in self._chunks(shard, idx):
                    reply = conn.request(protocol.DeleteRequest(keys=[keys[i] for i in chunk]), deadline=deadline)
                    deleted[shard.index] += reply.msg.deleted
                    self._counters.add(requests=1)
            return job

        self._scatter(self._by_owner(self._owners(route)), job_for, deadline)
        return sum(deleted.values())

    def retire(self, namespace: Namespace | bytes, *, timeout_s: float | None = None) -> dict[str, int]:
        """Retire a namespace pool-wide (issue 27): one RETIRE to every member server, in parallel.

        ``namespace``: a 16-byte tag as PUT with ``ns_tag`` (bytes of another length are hashed
        with :func:`~kvfabric.keys.namespace_tag`, as is a :class:`~kvfabric.keys.Namespace`).
        Each server bumps the tag's generation: every object stored under it before, in DRAM
        and on its SSD tier, is a miss from its reply on (O(1) per server; the space is freed
        lazily). Returns ``{address: generation}``. Raises :class:`~kvfabric.errors.RetireError`
        (with every server's result) when any server did not answer or refused, after all were
        tried: a retirement that some server missed is never reported as done.
        """
        self._check_open()
        if isinstance(namespace, (bytes, bytearray)) and len(namespace) == protocol.NS_TAG_BYTES:
            tag = bytes(namespace)
        else:
            tag = namespace_tag(namespace)
        deadline = self._deadline(timeout_s)
        answers: dict[str, int] = {}
        errors: dict[str, str] = {}  # a server's own refusal (BUSY: its tag table is full), said as it said it
        shards = self._shards

        def job_for(shard: _Shard):
            def job(conn: transport.Connection, deadline: float) -> None:
                try:
                    reply = conn.request(protocol.RetireRequest(ns=tag), deadline=deadline)
                except KVFabricError as e:
                    errors[shard.address] = str(e)
                    raise
                answers[shard.address] = reply.msg.generation
                self._counters.add(requests=1)
            return job

        ok = self._fan_out([(s, job_for(s)) for s in shards], deadline)
        results: dict[str, int | str] = {
            s.address: answers[s.address] if good else (errors.get(s.address) or s.last_error or "unreachable")
            for s, good in zip(shards, ok)}
        failed = [a for a, r in results.items() if isinstance(r, str)]
        if failed:
            for a in failed:
                log.error("RETIRE of namespace tag %s not applied on %s: %s", tag.hex(), a, results[a])
            raise RetireError(f"namespace tag {tag.hex()} not retired on {len(failed)} of {len(shards)} servers: "
                              + "; ".join(f"{a}: {results[a]}" for a in failed), results)
        return answers

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``{"client": {counters, "shards": {address: state}}, "servers": {address: STATS map}}``.

        A server that cannot answer appears as ``{"error": "..."}``.
        """
        self._check_open()
        deadline = self._deadline(timeout_s)
        servers: dict[str, Any] = {}
        shards, routed = self._shards, set(self._view.shards)

        def job_for(shard: _Shard):
            def job(conn: transport.Connection, deadline: float) -> None:
                servers[shard.address] = conn.request(protocol.StatsRequest(), deadline=deadline).msg.stats
            return job

        ok = self._fan_out([(s, job_for(s)) for s in shards], deadline)
        for s, good in zip(shards, ok):
            if not good:
                servers[s.address] = {"error": s.last_error or "unreachable"}
        client: dict[str, Any] = self._counters.snapshot()
        client["shards"] = {
            s.address: {
                "up": not s.down_until,
                "transport": s.transport,
                "server_id": s.server_id,
                "route_id": s.route_id,
                "routed": s in routed,
                "last_error": s.last_error,
            }
            for s in shards
        }
        client["members"] = list(self._view.ids)
        client["transports"] = sorted({s.transport for s in self._shards if s.transport})
        if "nixl" in client["transports"]:  # what UCX may carry it over in this process
            client["ucx_transports"] = ucx_info.describe()
        client["registered_buffers"] = self._registration.stats()
        return {"client": client, "servers": {s.address: servers[s.address] for s in shards}}

    def ping(self, *, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """One PING to every server, in parallel, on a pooled connection: ``{address: {"rtt_s", "server_id",
        "server", "version", "transport"}}`` (``server``: the name and version its HELLO reported, ``version``:
        its wire protocol, ``rtt_s``: the PING's round trip alone, the connect and HELLO not counted). A
        server that cannot answer appears as ``{"error": "..."}`` (the shard's last error), as in :meth:`stats`."""
        self._check_open()
        deadline = self._deadline(timeout_s)
        answers: dict[str, dict[str, Any]] = {}
        shards = self._shards

        def job_for(shard: _Shard):
            def job(conn: transport.Connection, deadline: float) -> None:
                t0 = time.perf_counter()
                conn.request(protocol.PingRequest(), deadline=deadline)
                rtt = time.perf_counter() - t0
                self._counters.add(requests=1)
                answers[shard.address] = {"rtt_s": rtt, "server_id": conn.hello.server_id, "server": conn.hello.server,
                                          "version": conn.hello.version, "transport": conn.name}
            return job

        ok = self._fan_out([(s, job_for(s)) for s in shards], deadline)
        return {s.address: answers[s.address] if good else {"error": s.last_error or "unreachable"}
                for s, good in zip(shards, ok)}

    @property
    def transports(self) -> dict[str, str | None]:
        """The transport each shard's connections use (None before the first connect)."""
        return {s.address: s.transport for s in self._shards}

    def __repr__(self) -> str:
        up = sum(1 for s in self._shards if not s.down_until)
        return f"<kvfabric.Client {up}/{len(self._shards)} servers up, replicas={self.config.replicas}>"
