"""Prefix-LFU: frequency with dynamic aging, a remembered history, and tail-first eviction.

A combination of two ideas for prefix KV workloads:

* **Frequency with aging (LFU-DA).** Each key has a priority ``L + f``, where
  ``f`` counts its uses and ``L`` is the priority of the last victim. The
  victim is the lowest priority; since ``L`` only grows, a key that stops
  being used is eventually overtaken by fresh keys (aging) while a popular
  document or system prompt stays. Equal priorities go least recently used
  first.
* **History.** The frequency of an evicted key is remembered (keys only, a
  bounded FIFO of ``history_factor`` x the tracked keys); when the key comes
  back its count continues. Reuse gaps in real traces are often longer than
  any affordable cache's residency, so without memory the second and later
  uses of a popular prefix would always look like first uses.
* **Tail first.** As in ``tail-lru``, only keys without tracked children are
  candidates, so a chain is eaten from its tail and its head, which every
  continuation needs, stays. When every unpinned key has children (only when
  leaves are pinned) it falls back to the lowest priority among unpinned keys.

A block's priority is never below its children's in a prefix workload (every
use of a child in a prompt is also a use of its parent), so "leaves only"
rarely overrides the frequency order; it decides ties and corrects the
cases where a parent's frequency was forgotten.

Data structures: dicts for frequency, priority and children; a min-heap of
``(priority, time, key)`` over leaves with lazy deletion, compacted when
stale entries outnumber live keys 4:1. Operations are O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy, pop_unpinned_leaf


class PrefixLFUPolicy(EvictionPolicy):
    name = "prefix-lfu"
    summary = "LFU with aging and a frequency history, chain tails first"

    def __init__(self, history_factor: float = 8.0, min_history: int = 1024) -> None:
        if not history_factor >= 0:
            raise ValueError(f"history_factor must be >= 0, got {history_factor!r}")
        self.history_factor = history_factor
        self.min_history = int(min_history)
        self._tick = 0
        self._aging = 0.0  # L: priority of the last victim
        self._freq: dict[bytes, int] = {}
        self._prio: dict[bytes, tuple[float, int]] = {}
        self._parent: dict[bytes, bytes] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._history: OrderedDict[bytes, int] = OrderedDict()
        self._heap: list[tuple[float, int, bytes]] = []

    # ------------------------------------------------------------ bookkeeping

    def _touch(self, key: bytes) -> None:
        self._tick += 1
        self._prio[key] = (self._aging + self._freq[key], self._tick)
        if key not in self._children:
            self._push(key)

    def _push(self, key: bytes) -> None:
        p, t = self._prio[key]
        heapq.heappush(self._heap, (p, t, key))
        if len(self._heap) > 4 * len(self._prio) + 64:
            self._heap = [(p, t, k) for k, (p, t) in self._prio.items() if k not in self._children]
            heapq.heapify(self._heap)

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        if key in self._freq:  # re-insert of a tracked key: treat as an access
            self.on_access(key)
            return
        self._freq[key] = self._history.pop(key, 0) + 1
        if parent is not None and parent != key and parent in self._freq:
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)
        self._touch(key)

    def on_access(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] += 1
            self._touch(key)

    def on_remove(self, key: bytes) -> None:
        if key in self._freq:
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        del self._prio[key]
        del self._freq[key]
        for child in self._children.pop(key, ()):
            del self._parent[child]
            self._push(child)
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._children[parent]
            kids.discard(key)
            if not kids:
                del self._children[parent]
                self._push(parent)

    def _remember(self, key: bytes, freq: int) -> None:
        limit = max(self.min_history, int(self.history_factor * len(self._freq)))
        if limit <= 0:
            return
        self._history[key] = freq
        self._history.move_to_end(key)
        while len(self._history) > limit:
            self._history.popitem(last=False)

    # ------------------------------------------------------------ eviction

    def evict(self, is_pinned: Callable[[bytes], bool]) -> bytes | None:
        victim = pop_unpinned_leaf(
            self._heap, lambda it: self._prio.get(it[2]) == it[:2] and it[2] not in self._children, is_pinned, self._prio
        )
        if victim is None:
            return None
        self._aging = max(self._aging, self._prio[victim][0])
        freq = self._freq[victim]
        self._forget(victim)
        self._remember(victim, freq)
        return victim

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: bytes) -> bool:
        return key in self._freq
