"""Hand-off and read-repair for :class:`kvfabric.Client` (private): keys find their way to new owners.

When the members change, rendezvous hashing moves ~1/N of the keys to
another owner, and that owner does not hold them yet. Without help every
such key is a miss until someone puts it again. Two repairs close the gap,
both lazy (driven by the engine's own reads, no background scan):

* **Hand-off from the previous owner.** On every change of the routing view
  the client keeps the view it replaces for ``ClientConfig.handoff_s``
  seconds (:class:`PreviousViews`, at most :data:`MAX_PREVIOUS_VIEWS`). A key
  that misses on all its current owners is then asked of its owners under
  each kept view, newest first, where those differ from the current ones and
  are still members and up (a server that left is never asked: its shard is
  retired). A hit is returned to the caller (``handoff_hits``) and re-put to
  the current owners that answered "miss" (``handoff_repairs``). ``lookup``
  does the same with EXISTS: when its run stops at a key, the rest of the
  prompt is asked of current and previous owners at once, the run extends
  over keys found on a previous owner, and those are copied to their new
  owner in the background (GET from the old, PUT to the new). ``exists``
  asks previous owners for the keys no current owner holds, the same way.
* **Read-repair between replicas** (``replicas > 1``): a key a GET found only
  at replica rank ``r > 0`` is re-put to the owners of lower rank that
  answered "miss" (a returning, replacing or emptied server; ``read_repairs``).
  Within the grace period after a change, a key a GET found is also offered
  to its owners of higher rank (not asked by that GET) that are new since the
  oldest kept view: a server that joined or replaced another (a new address
  under the same id counts) gets its secondary copies too. Every repair asks
  EXISTS first and PUTs only what the target lacks.

Repairs run on one background thread per client (:class:`Repairer`, started
on first use) under the client's ``timeout_s``, so they never delay the call
that found them. Its queue is bounded (:data:`MAX_QUEUED_ITEMS` batches,
:data:`MAX_QUEUED_BYTES` of values); a repair that does not fit is dropped
and counted (``repairs_dropped``): the next put or read fixes that key.
Nothing here raises out of the client's calls.

Not done (see docs/notes/membership.md): no proactive re-replication (a
returning server is refilled only by the reads that miss on it and by new
puts).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import protocol

if TYPE_CHECKING:  # pragma: no cover
    from .._routing import _View
    from ..client import Client

log = logging.getLogger("kvfabric.client")

MAX_PREVIOUS_VIEWS = 8
MAX_QUEUED_ITEMS = 64
MAX_QUEUED_BYTES = 64 << 20
MAX_CLAIMS = 1 << 16  # (key, shard) repairs remembered, so a hot key is not queued again on every read



def _received(dest: Any, n: int) -> bytes:
    """The ``n`` bytes a GET put into ``dest``: a view, or a scatter entry's views filled in order
    (``Client.get_into_parts``)."""
    if not isinstance(dest, tuple):
        return bytes(dest[:n])
    out = bytearray()
    for part in dest:
        out += part[: n - len(out)]
    return bytes(out)

class PreviousViews:
    """Routing views replaced within the last ``handoff_s`` seconds, newest first (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: list[tuple[_View, float]] = []  # (view, monotonic expiry), newest first

    def push(self, view: _View, until: float) -> None:
        with self._lock:
            self._views.insert(0, (view, until))
            del self._views[MAX_PREVIOUS_VIEWS:]

    def active(self) -> list[_View]:
        """The views still in their grace period (expired ones are dropped here); ``[]`` cheaply when none."""
        if not self._views:
            return []
        now = time.monotonic()
        with self._lock:
            self._views = [(v, t) for v, t in self._views if t > now]
            return [v for v, _ in self._views]

    def clear(self) -> None:
        with self._lock:
            self._views = []


class Repairer:
    """One daemon thread that runs a client's repairs (see the module docstring)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[Callable[[], None], int]] = collections.deque()
        self._bytes = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._claims: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()

    def claim(self, key: bytes, shards: list[int]) -> list[int]:
        """The ``shards`` that ``key`` was not queued for lately (they are remembered now; the oldest of
        :data:`MAX_CLAIMS` are forgotten)."""
        out = []
        with self._cond:
            for s in shards:
                if (key, s) in self._claims:
                    continue
                self._claims[(key, s)] = None
                out.append(s)
            while len(self._claims) > MAX_CLAIMS:
                self._claims.popitem(last=False)
        return out

    def submit(self, run: Callable[[], None], nbytes: int, nkeys: int) -> bool:
        """Queue ``run`` (``nbytes`` of values held); False (counted as ``nkeys`` dropped) when full."""
        with self._cond:
            if self._closed:
                return False
            if len(self._queue) >= MAX_QUEUED_ITEMS or self._bytes + nbytes > MAX_QUEUED_BYTES:
                self._client._counters.add(repairs_dropped=nkeys)
                return False
            self._queue.append((run, nbytes))
            self._bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvfabric-repair", daemon=True)
                self._thread.start()
            self._cond.notify()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                run, nbytes = self._queue.popleft()
            try:
                run()
            except Exception:  # a repair is an optimisation: never fatal, but say what broke
                if not self._client.closed:
                    log.exception("kvfabric: a background repair failed")
            finally:
                with self._cond:
                    self._bytes -= nbytes

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)


class HandOff:
    """The hand-off half of :class:`kvfabric.Client` (a base class, like ``_fanout._FanOut``: it uses the
    client's ``config``, ``_counters``, ``_by_index``, ``_owners``, ``_scatter``, ``_talk``, ``_chunks``,
    ``_previous`` (:class:`PreviousViews`) and ``_repairer`` (:class:`Repairer`))."""

    def _live(self, index: int) -> bool:
        shard = self._by_index.get(index)
        return shard is not None and not shard.retired and not shard.down_until

    def _previous_owners(self, keys: list[bytes], idx: Sequence[int], current: list[list[int]],
                         view: _View) -> dict[int, list[int]]:
        """Key index -> its owners under ``view`` that are not among its ``current`` owners and are live."""
        table = self._owners([keys[i] for i in idx], view)
        out: dict[int, list[int]] = {}
        for i, row in zip(idx, table):
            cand = [s for s in row if s not in current[i] and self._live(s)]
            if cand:
                out[i] = cand
        return out

    def _after_get(self, keys: list[bytes], owners: list[list[int]], sizes: list[int | None],
                   views: list[Any] | None, out: list | None, pending: list[int],
                   found_at: dict[int, int], answered: list[set[int]], job_for: Callable, deadline: float,
                   background: bool) -> list[int]:
        """After a GET's own owners: ask previous owners for what is still ``pending`` and repair.

        ``found_at``: key index -> replica rank > 0 that had it; ``answered[r]``: shards that answered at
        rank ``r``. Returns the keys still missing. ``background``: this GET is itself a repair (on the
        repairer's thread): store inline, count nothing as the caller's hits.
        """
        repairs: dict[int, list[int]] = {}  # key index -> shards to re-put it to
        kinds: dict[int, str] = {}
        prev_views = self._previous.active()
        # owners that joined (or replaced a server) within the grace period, at a rank a hit did not reach
        fresh = set(self._view.index) - set(prev_views[-1].index) if prev_views and self.config.replicas > 1 else set()
        for i in (range(len(keys)) if fresh else found_at):
            if sizes[i] is None:
                continue
            r = found_at.get(i, 0)
            t = [owners[i][q] for q in range(r) if owners[i][q] in answered[q]]
            t = self._repairer.claim(keys[i], t + [s for s in owners[i][r + 1:] if s in fresh])
            if t:
                repairs[i], kinds[i] = t, "read_repairs"
        handed = 0
        for view in prev_views:
            if not pending or time.monotonic() >= deadline:
                break
            prev = self._previous_owners(keys, pending, owners, view)
            for rank in range(max((len(c) for c in prev.values()), default=0)):
                groups: dict[int, list[int]] = {}
                for i, cand in prev.items():
                    if rank < len(cand) and sizes[i] is None:
                        groups.setdefault(cand[rank], []).append(i)
                if groups and time.monotonic() < deadline:
                    self._scatter(groups, job_for, deadline)
            still = []
            for i in pending:
                if sizes[i] is None:
                    still.append(i)
                    continue
                handed += 1
                t = [s for q, s in enumerate(owners[i]) if q < len(answered) and s in answered[q]]
                t = t if background else self._repairer.claim(keys[i], t)
                if t:
                    repairs[i], kinds[i] = t, "handoff_repairs"
            pending = still
        if handed and not background:
            self._counters.add(handoff_hits=handed)
        if repairs:
            idx = sorted(repairs)
            vals = [out[i] if views is None else _received(views[i], sizes[i]) for i in idx]
            self._repair_put([keys[i] for i in idx], vals, [repairs[i] for i in idx], [kinds[i] for i in idx],
                             inline=background)
        return pending

    def _repair_put(self, keys: list[bytes], values: list[Any], targets: list[list[int]], kinds: list[str],
                    *, inline: bool) -> None:
        def run() -> None:
            stored = self._store(keys, values, targets, time.monotonic() + self.config.timeout_s)
            counts = collections.Counter(k for k, ok in zip(kinds, stored) if ok)
            if counts:
                self._counters.add(**counts)

        if inline:
            run()
        else:
            self._repairer.submit(run, sum(memoryview(v).nbytes for v in values), len(keys))

    def _store(self, keys: list[bytes], values: list[Any], targets: list[list[int]], deadline: float) -> list[bool]:
        """PUT ``values[i]`` on those of the shards ``targets[i]`` that do not hold it (EXISTS first; no
        parents); per key: whether some shard stored it now."""
        mv = [memoryview(v).cast("B") for v in values]
        sums = [protocol.checksum(k, v) for k, v in zip(keys, mv)]
        ok = [False] * len(keys)
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(targets):
            for s in t:
                groups.setdefault(s, []).append(i)

        def job_for(shard, idx: list[int]):
            def job(conn, deadline: float) -> None:
                absent = []
                for chunk in self._chunks(shard, idx):
                    reply = conn.request(protocol.ExistsRequest(keys=[keys[i] for i in chunk]), deadline=deadline).msg
                    if len(reply.present) != len(chunk):
                        raise protocol.ProtocolError(protocol.ErrorCode.MALFORMED, "EXISTS reply length mismatch")
                    absent += [i for i, p in zip(chunk, reply.present) if not p]
                    self._counters.add(requests=1)
                fits = [i for i in absent if mv[i].nbytes <= shard.limits.max_object_bytes]
                for chunk in self._chunks(shard, fits, lambda i: mv[i].nbytes):
                    msg = protocol.PutRequest(keys=[keys[i] for i in chunk], sizes=[mv[i].nbytes for i in chunk],
                                              checksums=[sums[i] for i in chunk], parents=None)
                    reply = conn.request(msg, [mv[i] for i in chunk], deadline=deadline).msg
                    for i, st in zip(chunk, reply.status):
                        if st == protocol.PutStatus.STORED:
                            ok[i] = True
                    self._counters.add(requests=1, bytes_out=msg.payload_len())
            return job

        self._scatter(groups, job_for, deadline)
        return ok

    def _handoff_exists(self, keys: list[bytes], present: list[bool], deadline: float) -> None:
        """``exists``: keys no current owner holds are asked of their previous owners; found ones are marked
        present (``handoff_hits``) and copied to their new owner in the background."""
        prev_views = self._previous.active()
        missing = [i for i, p in enumerate(present) if not p]
        if not prev_views or not missing or time.monotonic() >= deadline:
            return
        current = self._owners(keys)
        groups: dict[int, list[int]] = {}
        for view in prev_views:
            for i, cand in self._previous_owners(keys, missing, current, view).items():
                for s in cand:
                    if i not in groups.get(s, ()):
                        groups.setdefault(s, []).append(i)
        if not groups:
            return
        for idx in groups.values():
            idx.sort()
        found: set[int] = set()

        def talk_for(shard, idx: list[int]):
            def talk():
                for chunk in self._chunks(shard, idx):
                    reply = (yield protocol.ExistsRequest(keys=[keys[i] for i in chunk])).msg
                    if len(reply.present) != len(chunk):
                        raise protocol.ProtocolError(protocol.ErrorCode.MALFORMED, "EXISTS reply length mismatch")
                    self._counters.add(requests=1)
                    found.update(i for i, p in zip(chunk, reply.present) if p)
            return talk

        self._talk(groups, talk_for, keys, deadline)
        if not found:
            return
        for i in found:
            present[i] = True
        self._counters.add(handoff_hits=len(found))
        self._queue_copies([keys[i] for i in sorted(found)], [current[i] for i in sorted(found)])

    def _queue_copies(self, keys: list[bytes], current: list[list[int]]) -> None:
        """Copy ``keys`` (held by a previous owner) to their current primary owner, in the background."""
        sub = [k for k, c in zip(keys, current) if self._repairer.claim(k, c[:1])]

        def copy() -> None:  # a GET through the hand-off path fetches from the old owner and re-puts
            self._get(sub, None, [None] * len(sub), None, background=True)

        if sub:
            self._repairer.submit(copy, 0, len(sub))

    def _handoff_run(self, keys: list[bytes], run: int, deadline: float) -> int:
        """``lookup``'s run, extended over keys a previous owner still holds (module docstring)."""
        prev_views = self._previous.active()
        if not prev_views or run >= len(keys) or time.monotonic() >= deadline:
            return run
        tail = list(range(run, len(keys)))
        current = self._owners(keys)
        extra: dict[int, list[int]] = {}
        for view in prev_views:
            for i, cand in self._previous_owners(keys, tail, current, view).items():
                extra.setdefault(i, []).extend(s for s in cand if s not in extra.get(i, ()))
        if run not in extra:  # the first missing key has nowhere else to be
            return run
        groups: dict[int, list[int]] = {}
        for i in tail:
            for s in current[i] + extra.get(i, []):
                groups.setdefault(s, []).append(i)
        present_at: dict[int, set[int]] = collections.defaultdict(set)

        def talk_for(shard, idx: list[int]):
            def talk():
                for chunk in self._chunks(shard, idx):
                    reply = (yield protocol.ExistsRequest(keys=[keys[i] for i in chunk])).msg
                    if len(reply.present) != len(chunk):
                        raise protocol.ProtocolError(protocol.ErrorCode.MALFORMED, "EXISTS reply length mismatch")
                    self._counters.add(requests=1)
                    for i, p in zip(chunk, reply.present):
                        if p:
                            present_at[i].add(shard.index)
            return talk

        self._talk(groups, talk_for, keys, deadline)
        end = run
        while end < len(keys) and present_at[end]:
            end += 1
        moved = [i for i in range(run, end) if not present_at[i] & set(current[i])]
        if not moved:
            return end
        self._counters.add(handoff_hits=len(moved))
        self._queue_copies([keys[i] for i in moved], [current[i] for i in moved])
        return end
