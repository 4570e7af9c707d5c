"""The read calls of :class:`kvfabric.Client` (a private part of it): ``get_into``,
``get_into_parts``, ``get`` and the GET they share.

A GET asks each key's owners in replica order, then (during a hand-off) its
previous owners; each object's checksum is checked as it lands (in C on the
native and shm transports, else here) when ``verify_checksums`` is on, in which case
the request says ``client_verifies`` so the server skips its own pass, and a
mismatch is asked once more without it (the server then checks, and drops a
corrupt stored copy). Routing, fan-out and deadlines come from the other
parts of the client (``_routing``, ``_fanout``, ``client``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from . import protocol, transport
from ._shard import _Shard

log = logging.getLogger("kvfabric.client")

_checksum = protocol.checksum  # bound to the key (protocol 2)
_MAX_PARTS = 64  # buffers one object of get_into_parts may be scattered over (the native transport's bound)


def _writable(b: Any) -> memoryview:
    """A writable byte view of ``b``; TypeError otherwise (a programming error)."""
    try:
        v = memoryview(b).cast("B")
    except TypeError as e:
        raise TypeError(f"GET buffers must be contiguous: {e}") from None
    if v.readonly:
        raise TypeError("GET buffers must be writable")
    return v


def _nbytes(v: Any) -> int:
    """Bytes a get destination holds: a view, or a tuple of views (a scatter entry)."""
    return sum(p.nbytes for p in v) if isinstance(v, tuple) else v.nbytes


def _object_checksum(key: bytes, dest: Any, n: int) -> int:
    """Checksum of the ``n``-byte object received into ``dest`` (a view, or a scatter entry's views)."""
    if not isinstance(dest, tuple):
        return _checksum(key, dest[:n])
    pieces = []
    for p in dest:
        if n <= 0:
            break
        pieces.append(p[:n])
        n -= p.nbytes
    return protocol.checksum_parts(key, pieces)


class _Reads:
    """``get_into``, ``get_into_parts``, ``get`` (see the module docstring)."""

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], *, placement: Sequence[bytes] | None = None,
                 timeout_s: float | None = None) -> list[int | None]:
        """Receive each found object straight into ``buffers[i]``; returns its size or None (miss).

        Owners are tried in order (replicas). ``placement[i]``, when given, is
        the key ``keys[i]`` is routed by (as for ``put``; read-repair and
        hand-off are not applied to such calls). A bad checksum is a miss. Raises
        ``TypeError`` for a read-only or non-contiguous buffer and
        ``ValueError`` for one smaller than the object found.
        """
        self._check_open()
        keys = self._keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        route, _ = self._placement(keys, placement)
        return self._get(keys, [_writable(b) for b in buffers], None, timeout_s, route=route)[0]

    def get_into_parts(
        self, keys: Sequence[bytes], parts: Sequence[Sequence[Any]], *, placement: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> list[int | None]:
        """Scatter form of :meth:`get_into`: object ``i`` fills the buffers ``parts[i]`` in order.

        For objects stored as a small header followed by a payload, the
        header lands in one buffer and the payload straight in the caller's
        destination (``parts[i] = (header_buf, payload_buf)``), with no
        staging copy. Buffers past an object's end are left untouched (a
        shorter object fills only the first ones); the caller learns where
        the object ended from the returned size. Returns each object's size,
        or None for a miss; the checksum covers the whole object, as for
        ``get_into``; ``placement`` as for ``get_into``. ``parts[i]`` holds 1..64 buffers. Raises ``TypeError``
        for a read-only or non-contiguous buffer and ``ValueError`` for an
        entry whose buffers together are smaller than the object found (as
        ``get_into``: what the call's other buffers then hold is unspecified).
        Works over every transport (``native`` receives into the parts with
        one ``recvmsg`` per run of objects, ``shm`` copies each piece out of
        the arena, ``tcp`` receives each piece).
        """
        self._check_open()
        keys = self._keys(keys)
        route, _ = self._placement(keys, placement)
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} part lists")
        views: list[Any] = []
        for i, ps in enumerate(parts):
            entry = tuple(_writable(b) for b in ps)
            if not 1 <= len(entry) <= _MAX_PARTS:
                raise ValueError(f"parts[{i}] holds {len(entry)} buffers (1..{_MAX_PARTS})")
            views.append(entry)
        return self._get(keys, views, None, timeout_s, route=route)[0]

    def get(self, keys: Sequence[bytes], *, placement: Sequence[bytes] | None = None,
            timeout_s: float | None = None) -> list[bytes | None]:
        """Convenience form of :meth:`get_into` that allocates: ``bytes`` per hit, None per miss."""
        self._check_open()
        keys = self._keys(keys)
        route, _ = self._placement(keys, placement)
        out: list[bytes | None] = [None] * len(keys)
        self._get(keys, None, out, timeout_s, route=route)
        return out

    def _get(self, keys: list[bytes], views: list[Any] | None, out: list | None, timeout_s: float | None,
             *, background: bool = False, route: list[bytes] | None = None) -> tuple[list[int | None], int]:
        """GET into ``views`` (one memoryview, or a tuple of them: a scatter entry, per key) or, with
        ``views=None``, into new ``bytes`` stored in ``out``: owners in replica order, then previous owners
        (hand-off); returns (sizes, misses). ``background``: a repair's own GET (membership/handoff.py):
        counts no hits or misses. ``route``: what each key is routed by (placement keys) when not the key
        itself; such a GET asks its owners only (no read-repair or hand-off: their puts would not carry
        the groups)."""
        deadline = self._deadline(timeout_s)
        placed = route is not None and route is not keys
        owners = self._owners(route if placed else keys)
        sizes: list[int | None] = [None] * len(keys)
        verify = self.config.verify_checksums
        cap = protocol.MAX_OBJECT_BYTES

        def job_for(shard: _Shard, idx: list[int]):
            def fetch(conn: transport.Connection, chunk: list[int], deadline: float, trust: bool) -> list[int]:
                """One GET of ``chunk``; the keys whose object failed its checksum here.

                ``trust``: the server may send without checking (``client_verifies``), this client checks.
                """
                msg = protocol.GetRequest(keys=[keys[i] for i in chunk], client_verifies=trust)
                bufs = None if views is None else [views[i] for i in chunk]
                # checksums=: a transport that can hashes each object as it lands (no second pass)
                reply = conn.request(msg, recv_buffers=bufs, deadline=deadline, checksums=verify and bufs is not None)
                got = reply.checksums
                bad: list[int] = []
                nbytes = off = 0
                payload = memoryview(reply.payload if reply.payload is not None else b"")
                for j, (i, n, ck) in enumerate(zip(chunk, reply.msg.sizes, reply.msg.checksums)):
                    if n < 0:
                        continue
                    data = payload[off : off + n] if views is None else views[i]
                    off += n
                    nbytes += n
                    if verify and (got[j] if got is not None else _object_checksum(keys[i], data, n)) != ck:
                        bad.append(i)
                        continue
                    if out is not None:
                        out[i] = bytes(data)
                    sizes[i] = n
                self._counters.add(requests=1, bytes_in=nbytes, checksum_failures=len(bad))
                if bad:
                    log.warning("kvfabric: %d objects from %s failed their checksum%s", len(bad), shard.address,
                                "; asking the server to check them" if trust else "")
                return bad

            def job(conn: transport.Connection, deadline: float) -> None:
                weight = (lambda i: min(_nbytes(views[i]), cap)) if views is not None else None
                for chunk in self._chunks(shard, idx, weight):
                    # A verifying client lets the server skip its own pass over the bytes. A mismatch
                    # is asked again without that: the server checks, drops a corrupt stored object
                    # and answers a miss (so one bad copy cannot stay in the pool), or sends the bytes
                    # again (a flip on the way), which are checked again.
                    bad = fetch(conn, chunk, deadline, verify)
                    if bad:
                        fetch(conn, bad, deadline, False)
            return job

        pending = list(range(len(keys)))
        found_at: dict[int, int] = {}  # key -> the replica rank > 0 that had it (read-repair)
        answered: list[set[int]] = []  # per rank: the shards that answered
        for rank in range(self.config.replicas):
            if not pending or time.monotonic() >= deadline:
                break
            done = self._scatter(self._by_owner(owners, rank, pending), job_for, deadline)
            answered.append({s for s, ok in done.items() if ok})
            if rank:
                found_at.update((i, rank) for i in pending if sizes[i] is not None)
            pending = [i for i in pending if sizes[i] is None]
        if not placed and (found_at or self._previous.active()):
            pending = self._after_get(keys, owners, sizes, views, out, pending, found_at, answered, job_for,
                                      deadline, background)
        if not background:
            self._counters.add(hits=len(keys) - len(pending), misses=len(pending))
        return sizes, len(pending)
