"""The pool server's index: key -> object in the arena, with pins, leases, checksums and eviction.

One ``threading.Lock`` guards everything here (the index, the arena's
allocator, the eviction policy and the counters). Work that touches object
bytes (checksumming) runs outside the lock on pinned objects, so a long send
or a checksum of a large object never blocks other clients' bookkeeping.

Object life cycle
-----------------
PUT is three steps so that a transport can receive straight into the arena:
:meth:`Store.begin_put` reserves a slot (evicting unpinned objects, in the
policy's order, until an extent fits), the transport fills ``slot.view``,
then :meth:`Store.commit_put` verifies the checksum the client sent and
inserts the object, or :meth:`Store.abort_put` gives the slot back (the
connection broke mid-payload). A reserved slot is not in the index, so it can
be neither read nor evicted while it is being filled.

GET pins each found object (:meth:`Store.acquire`), verifies its checksum
outside the lock, and hands back views that stay valid until the caller calls
``release()``. A pinned object is never evicted or overwritten; a DELETE (or a
checksum drop) of a pinned object takes it out of the index at once, so later
requests miss, and frees its bytes when the last pin is released.

Groups (issue 23; the same rules as the C store, csrc/kvf_store.c): the parts
of a PUT group are reserved and verified one by one (:meth:`Store.verify_put`)
and indexed together by :meth:`Store.commit_group`. The policy sees one entry
per group, named by its representative (the first part stored) with the
group's bytes; an access to any part is an access to it; evicting it evicts
every part and it is pinned while any part is; a DELETE or a checksum drop of
any part removes the whole group.

LOOKUP may take a lease (``lease_ms``) on the leading objects it found: until
the lease expires the policy skips them when choosing victims. Leases expire
by themselves (they are compared with the clock); a DELETE still removes a
leased object at once, since a lease protects against eviction only. Leases
are capped at ``max_lease_ms``.

Namespaces (issue 27; the C store's rules, csrc/kvf_ns.h): a PUT may tag its objects
with a namespace tag; each tag has a generation, and an object records the one it was
stored under (``Entry.ns``). :meth:`Store.retire` bumps it: every older object is a
miss from then on, dropped from the index (its whole group) by whatever lookup finds it
and counted in ``retired_objects_freed``; the rest leave with eviction. At most
``ns_max`` tags are known (a new one past that is refused, :class:`NamespaceTableFull`).

Checksums bind the key to the bytes (protocol 2,
``kvfabric.protocol.checksum(key, value)``). A PUT whose checksum does not
match its key and bytes is refused and counted in ``checksum_rejects``: nothing
is stored, so a frame whose key was altered on the wire, or a client that sends
one key's bytes and checksum under another key, plants nothing. (A writer that
computes the checksum over bytes of its own choosing is not stopped by this:
that is what auth and keyed key derivation are for.) A stored object whose bytes no longer match its key is
dropped, counted in ``checksum_failures`` and reported as a miss; it is never
served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...protocol import PutStatus, checksum
from ...server.eviction import EvictionPolicy, make_policy
from ...server.config import DEFAULT_MAX_LEASE_MS
from .arena import Arena, pages_for


class Group:
    """The parts of one stored group: their keys (the first, ``rep``, names the group to the policy)."""

    __slots__ = ("key", "parts", "members", "bytes")

    def __init__(self, key: bytes, parts: int) -> None:
        self.key = key
        self.parts = parts
        self.members: list[bytes] = []
        self.bytes = 0

    @property
    def rep(self) -> bytes:
        return self.members[0]


class Entry:
    """One stored object. ``live`` turns False when it leaves the index while still pinned."""

    __slots__ = ("offset", "size", "checksum", "pins", "lease_until", "live", "group", "ns")

    def __init__(self, offset: int, size: int, csum: int, group: Group | None = None,
                 ns: tuple[bytes, int] | None = None) -> None:
        self.ns = ns  # (namespace tag, generation when stored), None untagged
        self.offset = offset
        self.size = size
        self.checksum = csum
        self.pins = 0
        self.lease_until = 0.0
        self.live = True
        self.group = group


@dataclass(slots=True)
class Slot:
    """Arena space reserved by :meth:`Store.begin_put`, to be filled through ``view``."""

    offset: int
    size: int
    view: memoryview
    done: bool = False


@dataclass(slots=True)
class Acquired:
    """Result of :meth:`Store.acquire`: per key, a size (-1 = miss), a checksum and a view.

    ``views`` (and ``offsets``, their places in the arena) hold only the
    found objects, in key order. The views stay valid
    (the objects pinned) until ``release()`` is called; call it exactly once,
    after the bytes have been sent. Calling it again is a no-op.
    """

    sizes: list[int]
    checksums: list[int]
    views: list[memoryview]
    offsets: list[int] = field(default_factory=list)  # arena offsets of the found objects (for native/shm planes)
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        fn, self._release = self._release, None
        if fn is not None:
            fn()

    @property
    def payload_len(self) -> int:
        return sum(s for s in self.sizes if s > 0)


class NamespaceTableFull(Exception):
    """A new namespace tag past the store's ``ns_max`` (the C server answers BUSY)."""


#: The C server's default table size (kvf_ns.h KVF_NS_MAX_SLOTS).
DEFAULT_NS_MAX = 65535


class Store:
    """Key -> object index over one :class:`Arena`; thread-safe.

    ``policy`` is an :class:`EvictionPolicy` or a name for ``make_policy``.
    ``clock`` returns seconds (monotonic); tests pass a fake one to expire
    leases without sleeping. Raises ``ValueError`` for an unknown policy name
    and :class:`~kvfabric.testing.reference.arena.ArenaError` for a capacity under 4 KiB.
    """

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy | str = "lru",
        *,
        memfd: bool = False,
        clock: Callable[[], float] = time.monotonic,
        max_lease_ms: int = DEFAULT_MAX_LEASE_MS,
        ns_max: int = DEFAULT_NS_MAX,
    ) -> None:
        self.ns_max = ns_max
        self._ns: dict[bytes, int] = {}  # namespace tag -> generation
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.arena = Arena(capacity, memfd=memfd)
        self.capacity = self.arena.capacity
        self._clock = clock
        self.max_lease_ms = max_lease_ms
        self._lock = threading.Lock()
        self._index: dict[bytes, Entry] = {}
        self._index_pages = 0  # pages held by indexed objects (pinned or not)
        self.bytes_used = 0  # object bytes of indexed objects (not page-rounded)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "hits", "misses", "puts", "put_exists", "put_too_large", "put_no_space",
                "checksum_rejects", "evictions", "evicted_bytes", "checksum_failures",
                "deletes", "lookups", "lookup_keys", "lookup_hits", "exists_keys",
                "groups_stored", "groups_refused", "groups_torn", "retires", "retired_objects_freed",
            ),
            0,
        )
        self._groups: set[Group] = set()  # indexed groups (by identity)

    # ------------------------------------------------------------------ PUT

    def begin_put(self, key: bytes, size: int) -> PutStatus | Slot:
        """Reserve arena space for ``key``; returns a :class:`Slot` or the final status.

        ``PutStatus.EXISTS`` when the key is already held (nothing is
        reserved), ``TOO_LARGE`` when the object could never fit in the arena,
        ``NO_SPACE`` when it cannot fit without evicting pinned objects or
        space reserved by other in-progress PUTs. Evicts unpinned objects in
        the policy's order until an extent fits.
        """
        need = pages_for(size)
        with self._lock:
            if self._find(key) is not None:
                self.counters["put_exists"] += 1
                return PutStatus.EXISTS
            if need > self.arena.npages:
                self.counters["put_too_large"] += 1
                return PutStatus.TOO_LARGE
            # Even evicting every indexed object could not make room: say so
            # without evicting anything (the rest is reserved by other PUTs).
            if need > self.arena.npages - self.arena.used_pages + self._index_pages:
                self.counters["put_no_space"] += 1
                return PutStatus.NO_SPACE
            offset = self._alloc_evicting(size)
            if offset is None:
                self.counters["put_no_space"] += 1
                return PutStatus.NO_SPACE
        return Slot(offset, size, self.arena.view(offset, size))

    def commit_put(self, key: bytes, slot: Slot, csum: int, parent: bytes | None = None,
                   ns: tuple[bytes, int] | None = None) -> PutStatus:
        """Verify the filled slot against ``csum`` and insert it under ``key``.

        Returns ``STORED``; ``CHECKSUM_MISMATCH`` (slot freed, counted in
        ``checksum_rejects``) when ``csum`` is not ``checksum(key, bytes)``;
        ``EXISTS`` (slot freed) when another client stored the same key
        meanwhile.
        """
        self._finish(slot)
        ok = checksum(key, slot.view) == csum
        slot.view.release()
        with self._lock:
            if not ok:
                self.arena.free(slot.offset, slot.size)
                self.counters["checksum_rejects"] += 1
                return PutStatus.CHECKSUM_MISMATCH
            if self._find(key) is not None:
                self.arena.free(slot.offset, slot.size)
                self.counters["put_exists"] += 1
                return PutStatus.EXISTS
            self._index[key] = Entry(slot.offset, slot.size, csum, None, ns)
            self._index_pages += pages_for(slot.size)
            self.bytes_used += slot.size
            self.counters["puts"] += 1
            self.policy.on_insert(key, slot.size, parent)
        return PutStatus.STORED

    def group_too_large(self, sizes: Sequence[int]) -> bool:
        """Could a group of objects of ``sizes`` never fit in the arena whole? (Counted as refused.)"""
        if sum(pages_for(s) for s in sizes) <= self.arena.npages:
            return False
        with self._lock:
            self.counters["put_too_large"] += len(sizes)
        return True

    def verify_put(self, key: bytes, slot: Slot, csum: int) -> bool:
        """A group part's filled slot matches ``csum``? The slot is kept for :meth:`commit_group`
        when it does; freed and counted in ``checksum_rejects`` when it does not."""
        ok = checksum(key, slot.view) == csum
        if not ok:
            self.abort_put(slot)
            with self._lock:
                self.counters["checksum_rejects"] += 1
        return ok

    def commit_group(self, parts: Sequence[tuple[bytes, Slot, int]], group: bytes, group_parts: int,
                     parent: bytes | None = None, ns: tuple[bytes, int] | None = None) -> list[PutStatus]:
        """Index verified group parts ``(key, slot, checksum)`` as one group: a status per part,
        ``STORED`` or ``EXISTS`` (held already, that slot freed; it stays where it is)."""
        out: list[PutStatus] = []
        with self._lock:
            g = Group(group, group_parts)
            for key, slot, csum in parts:
                self._finish(slot)
                slot.view.release()
                if self._find(key) is not None:
                    self.arena.free(slot.offset, slot.size)
                    self.counters["put_exists"] += 1
                    out.append(PutStatus.EXISTS)
                    continue
                self._index[key] = Entry(slot.offset, slot.size, csum, g, ns)
                self._index_pages += pages_for(slot.size)
                self.bytes_used += slot.size
                self.counters["puts"] += 1
                g.members.append(key)
                g.bytes += slot.size
                out.append(PutStatus.STORED)
            if g.members:
                self._groups.add(g)
                self.counters["groups_stored"] += 1
                pe = self._find(parent) if parent is not None else None
                self.policy.on_insert(g.rep, g.bytes, pe.group.rep if pe is not None and pe.group else parent)
        return out

    def refuse_group(self, slots: Sequence[Slot]) -> None:
        """A group refused whole (or torn): give its kept slots back and count it."""
        for slot in slots:
            self.abort_put(slot)
        with self._lock:
            self.counters["groups_refused"] += 1

    def count(self, name: str) -> None:
        """Count one ``name`` event (a counter of this store's STATS)."""
        with self._lock:
            self.counters[name] += 1

    def abort_put(self, slot: Slot) -> None:
        """Give back a slot that will not be committed (e.g. the sender disconnected)."""
        self._finish(slot)
        slot.view.release()
        with self._lock:
            self.arena.free(slot.offset, slot.size)

    def put(self, key: bytes, data: Any, csum: int | None = None, parent: bytes | None = None) -> PutStatus:
        """Store ``data`` (any buffer) under ``key`` by copying it in; ``csum`` defaults to its checksum."""
        src = memoryview(data).cast("B")
        res = self.begin_put(key, src.nbytes)
        if not isinstance(res, Slot):
            return res
        res.view[:] = src
        return self.commit_put(key, res, checksum(key, src) if csum is None else csum, parent)

    # ------------------------------------------------------------------ GET

    def acquire(self, keys: Sequence[bytes], max_bytes: int | None = None, verify: bool = True) -> Acquired:
        """Pin and verify the objects for ``keys``; count hits and misses.

        An object whose checksum fails is dropped (``checksum_failures``) and
        reported as a miss; ``verify=False`` (a GET whose client verifies
        itself) skips that check. Found objects beyond ``max_bytes`` in total (the
        reply's payload limit) are reported as misses too. The caller must
        ``release()`` the result.
        """
        budget = max_bytes if max_bytes is not None else 1 << 62
        with self._lock:
            found = [self._pin(k) for k in keys]
        verified = [e is not None and (not verify or checksum(k, self.arena.view(e.offset, e.size)) == e.checksum)
                    for k, e in zip(keys, found)]
        sizes: list[int] = []
        sums: list[int] = []
        views: list[memoryview] = []
        pinned: list[Entry] = []
        with self._lock:
            for key, e, ok in zip(keys, found, verified):
                if e is not None and not ok:
                    self._drop_corrupt(key, e)
                    self._unpin(e)
                    e = None
                elif e is not None and e.size > budget:
                    self._unpin(e)
                    e = None
                if e is None:
                    self.counters["misses"] += 1
                    sizes.append(-1)
                    sums.append(0)
                    continue
                self.counters["hits"] += 1
                budget -= e.size
                if e.live:
                    self._access(key, e)
                sizes.append(e.size)
                sums.append(e.checksum)
                pinned.append(e)
        views = [self.arena.view(e.offset, e.size) for e in pinned]

        def release() -> None:
            for v in views:
                v.release()
            with self._lock:
                for e in pinned:
                    self._unpin(e)

        return Acquired(sizes, sums, views, [e.offset for e in pinned], release)

    # ------------------------------------------------------- LOOKUP / EXISTS / DELETE

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        """How many leading ``keys`` are held; optionally lease those against eviction."""
        lease_ms = min(max(lease_ms, 0), self.max_lease_ms)
        with self._lock:
            until = self._clock() + lease_ms / 1000.0
            count = 0
            for key in keys:
                e = self._find(key)
                if e is None:
                    break
                count += 1
                self._access(key, e)
                if lease_ms and until > e.lease_until:
                    e.lease_until = until
            self.counters["lookups"] += 1
            self.counters["lookup_keys"] += len(keys)
            self.counters["lookup_hits"] += count
        return count

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self.counters["exists_keys"] += len(keys)
            return [self._find(k) is not None for k in keys]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys``; returns how many objects left (a grouped key takes its whole group).
        Pinned ones are freed when unpinned."""
        n = 0
        with self._lock:
            for key in keys:
                e = self._find(key)
                if e is None:
                    continue
                n += self._remove_unit(key, e)
            self.counters["deletes"] += n
        return n

    # ------------------------------------------------------------------ namespaces (issue 27)

    def ns_ref(self, tag: bytes) -> tuple[bytes, int]:
        """The (tag, generation) an object stored now under ``tag`` records; raises
        :class:`NamespaceTableFull` for a new tag past ``ns_max``."""
        with self._lock:
            return tag, self._ns_intern(tag)

    def retire(self, tag: bytes) -> int:
        """Bump ``tag``'s generation (interned if new): every object stored under it before is a
        miss from now on. Returns the new generation; :class:`NamespaceTableFull` as ns_ref."""
        with self._lock:
            gen = self._ns_intern(tag) + 1
            self._ns[tag] = gen
            self.counters["retires"] += 1
            return gen

    def namespaces(self) -> int:
        with self._lock:
            return len(self._ns)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """A snapshot of the store's part of the STATS map (see docs/ARCHITECTURE.md)."""
        with self._lock:
            now = self._clock()
            pinned = sum(1 for e in self._index.values() if e.pins)
            leased = sum(1 for e in self._index.values() if e.lease_until > now)
            out = {
                "objects": len(self._index),
                "bytes_used": self.bytes_used,
                "bytes_allocated": self.arena.used_bytes,
                "capacity": self.capacity,
                "free_extents": self.arena.free_extents,
                "pinned": pinned,
                "leased": leased,
                "groups": len(self._groups),
                "group_objects": sum(len(g.members) for g in self._groups),
                "groups_incomplete": sum(1 for g in self._groups if len(g.members) < g.parts),
                "policy": self.policy.name,
            }
            out.update(self.counters)
        return out

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def entry(self, key: bytes) -> Entry | None:
        """The index entry for ``key`` (tests use it to corrupt bytes in place)."""
        return self._index.get(key)

    def check(self) -> None:
        """Assert invariants between index, policy and arena (tests call this)."""
        with self._lock:
            self.arena.check()
            units = sum(1 for e in self._index.values() if e.group is None) + len(self._groups)
            assert len(self.policy) == units, (len(self.policy), units)
            for g in self._groups:  # a group is whole in the index, or absent
                assert g.members and all(self._index.get(k) is not None and self._index[k].group is g
                                         for k in g.members), g.key
            assert self._index_pages == sum(pages_for(e.size) for e in self._index.values())
            assert self.bytes_used == sum(e.size for e in self._index.values())
            assert all(e.live and e.pins >= 0 for e in self._index.values())

    def close(self) -> None:
        self.arena.close()

    # ----------------------------------------------------------------- private (lock held)

    def _is_pinned_at(self, now: float) -> Callable[[bytes], bool]:
        index = self._index

        def is_pinned(key: bytes) -> bool:
            e = index[key]
            if e.group is None:
                return e.pins > 0 or e.lease_until > now
            return any(index[k].pins > 0 or index[k].lease_until > now for k in e.group.members)

        return is_pinned

    def _alloc_evicting(self, size: int) -> int | None:
        offset = self.arena.alloc(size)
        if offset is not None:
            return offset
        is_pinned = self._is_pinned_at(self._clock())
        while True:
            victim = self.policy.evict(is_pinned)
            if victim is None:
                return None
            e = self._index.get(victim)
            if e is None or is_pinned(victim):
                raise RuntimeError(f"eviction policy {self.policy.name!r} returned an unknown or pinned key")
            for key, ent in self._unit(victim, e):
                self._unindex(key, ent)
                self.counters["evictions"] += 1
                self.counters["evicted_bytes"] += ent.size
            self._groups.discard(e.group)
            offset = self.arena.alloc(size)
            if offset is not None:
                return offset

    def _unindex(self, key: bytes, e: Entry) -> None:
        """Take ``e`` out of the index; free its bytes now, or at its last unpin."""
        del self._index[key]
        self._index_pages -= pages_for(e.size)
        self.bytes_used -= e.size
        e.live = False
        if e.pins == 0:
            self.arena.free(e.offset, e.size)

    def _ns_intern(self, tag: bytes) -> int:
        gen = self._ns.get(tag)
        if gen is None:
            if len(self._ns) >= self.ns_max:
                raise NamespaceTableFull(f"namespace tag table full ({self.ns_max} tags)")
            gen = self._ns[tag] = 0
        return gen

    def _find(self, key: bytes) -> Entry | None:
        """The live entry of ``key``; one of a retired namespace generation is removed (its whole
        group, as a DELETE would) and counted freed, and the caller sees a miss."""
        e = self._index.get(key)
        if e is not None and e.ns is not None and self._ns.get(e.ns[0]) != e.ns[1]:
            self.counters["retired_objects_freed"] += self._remove_unit(key, e)
            return None
        return e

    def _pin(self, key: bytes) -> Entry | None:
        e = self._find(key)
        if e is not None:
            e.pins += 1
        return e

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        assert e.pins >= 0, "unbalanced unpin"
        if e.pins == 0 and not e.live:
            self.arena.free(e.offset, e.size)

    def _drop_corrupt(self, key: bytes, e: Entry) -> None:
        if e.live and self._index.get(key) is e:
            self.counters["checksum_failures"] += 1
            self._remove_unit(key, e)  # a group with a corrupt part goes whole

    def _unit(self, key: bytes, e: Entry) -> list[tuple[bytes, Entry]]:
        """The objects that leave with ``key``: its group's, or itself."""
        if e.group is None:
            return [(key, e)]
        return [(k, self._index[k]) for k in e.group.members]

    def _access(self, key: bytes, e: Entry) -> None:
        self.policy.on_access(key if e.group is None else e.group.rep)

    def _remove_unit(self, key: bytes, e: Entry) -> int:
        """DELETE or a checksum drop: ``key``'s object, or its whole group, leaves the index and the
        policy. Returns how many objects left."""
        unit = self._unit(key, e)
        for k, ent in unit:
            self._unindex(k, ent)
        if e.group is not None:
            self._groups.discard(e.group)
        self.policy.on_remove(key if e.group is None else e.group.rep)
        return len(unit)

    @staticmethod
    def _finish(slot: Slot) -> None:
        if slot.done:
            raise RuntimeError("slot already committed or aborted")
        slot.done = True
