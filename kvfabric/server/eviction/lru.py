"""Least-recently-used: the baseline every peer system ships.

An ``OrderedDict`` keeps keys from least to most recently used; an access
moves a key to the end in O(1). ``evict`` walks from the cold end past pinned
keys, so a pinned key keeps its place and is considered again next time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"
    summary = "least recently used first, as engines' own prefix caches (default)"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, is_pinned: Callable[[bytes], bool]) -> bytes | None:
        for key in self._order:
            if not is_pinned(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order
