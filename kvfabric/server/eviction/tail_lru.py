"""Tail-first LRU: least recently used among the blocks no other block builds on.

A block's KV is useless without its parent's (a prefix hit stops at the
first missing block), so evicting a chain's head while its tail stays is the
worst choice LRU can make, and plain LRU makes it all the time: a request
touches its blocks head to tail, so the head is always the least recent.

This policy keeps, for every tracked key, the number of tracked children
(keys whose ``parent`` on insert was it). Only *leaves* (no tracked children)
are eviction candidates, least recently used first; when a leaf goes, its
parent may become a leaf and competes with its own recency. A chain is thus
eaten from its tail. When every unpinned key has children (possible only
when leaves are pinned), it falls back to plain LRU over the unpinned keys.

Parents live in the same policy only when the same server holds them; with
N shards a block's parent is local about 1/N of the time, and a key whose
parent is elsewhere is a root here.

Data structures: ``_last[key]`` = logical access time; a min-heap of
``(time, key)`` entries for leaves with lazy deletion (an entry is live when
its time equals ``_last[key]`` and the key is a leaf), compacted when stale
entries outnumber live keys 4:1. Every operation is O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from .base import EvictionPolicy, pop_unpinned_leaf


class TailLRUPolicy(EvictionPolicy):
    name = "tail-lru"
    summary = "LRU among blocks nothing builds on: a chain goes tail first"

    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[bytes, int] = {}
        self._parent: dict[bytes, bytes] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._heap: list[tuple[int, bytes]] = []

    def _touch(self, key: bytes) -> None:
        self._tick += 1
        self._last[key] = self._tick
        if key not in self._children:
            self._push(key)

    def _push(self, key: bytes) -> None:
        heapq.heappush(self._heap, (self._last[key], key))
        if len(self._heap) > 4 * len(self._last) + 64:
            self._heap = [(t, k) for k, t in self._last.items() if k not in self._children]
            heapq.heapify(self._heap)

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        if key in self._last:  # re-insert of a tracked key: treat as an access
            self._touch(key)
            return
        if parent is not None and parent != key and parent in self._last:
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)
        self._touch(key)

    def on_access(self, key: bytes) -> None:
        if key in self._last:
            self._touch(key)

    def on_remove(self, key: bytes) -> None:
        if key in self._last:
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        del self._last[key]
        for child in self._children.pop(key, ()):
            del self._parent[child]
            self._push(child)  # an orphan is a root, and now a leaf candidate if childless
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._children[parent]
            kids.discard(key)
            if not kids:
                del self._children[parent]
                self._push(parent)

    def evict(self, is_pinned: Callable[[bytes], bool]) -> bytes | None:
        # Leaves in LRU order; when every leaf is pinned, plain LRU over the unpinned keys.
        victim = pop_unpinned_leaf(
            self._heap, lambda it: self._last.get(it[1]) == it[0] and it[1] not in self._children, is_pinned, self._last
        )
        if victim is None:
            return None
        self._forget(victim)
        return victim

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: bytes) -> bool:
        return key in self._last
