"""The eviction-policy interface every pool-server policy implements.

Policies are pure bookkeeping: no I/O, no locks, no clocks unless passed in.
The store calls them under its own lock, in this order of events:

* ``on_insert(key, size, parent)`` after an object is stored (``parent`` is the
  key of the previous block of the same prompt when the client sent it, so
  prefix-aware policies can evict a chain's tail before its head);
* ``on_access(key)`` on a GET hit or a LOOKUP hit;
* ``on_remove(key)`` when the object leaves for a reason other than eviction
  (DELETE, a checksum failure);
* ``evict(is_pinned)`` when the store needs space: the policy picks a victim
  that ``is_pinned`` says is free to go, forgets it and returns its key, or
  returns ``None`` when every key it tracks is pinned. Pinned keys keep their
  place in the policy's order.

Groups (issue 23, docs/notes/groups.md): the parts of a PUT group reach a policy
as ONE key, the group's representative (its first part stored), inserted once
with the group's bytes as its size; an access or removal of any part arrives as
that key's, ``is_pinned`` says whether any part is pinned, and the store evicts
every part when the policy returns it. A policy needs nothing group-specific.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


class EvictionPolicy(ABC):
    name: ClassVar[str]
    #: One line for ``kvfabric serve --help``: what the policy evicts first.
    summary: ClassVar[str]

    @abstractmethod
    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None: ...

    @abstractmethod
    def on_access(self, key: bytes) -> None: ...

    @abstractmethod
    def on_remove(self, key: bytes) -> None: ...

    @abstractmethod
    def evict(self, is_pinned: Callable[[bytes], bool]) -> bytes | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: bytes) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


def pop_unpinned_leaf(
    heap: list[tuple[Any, ...]],
    is_live: Callable[[tuple[Any, ...]], bool],
    is_pinned: Callable[[bytes], bool],
    rank: Mapping[bytes, Any],
) -> bytes | None:
    """The victim of a leaf-first policy kept as a lazy-deletion heap.

    ``heap`` holds ``(*rank, key)`` entries, smallest first; an entry is
    stale unless ``is_live(entry)`` (its key is still a leaf with that rank).
    Pops until the smallest live, unpinned entry and returns its key; pinned
    entries are pushed back so they keep their place. When every live leaf
    is pinned, falls back to the smallest-ranked unpinned key of ``rank``
    (a parent may go before its pinned child); ``None`` when all are pinned.
    The caller forgets the returned key.
    """
    skipped: list[tuple[Any, ...]] = []
    victim = None
    while heap:
        item = heapq.heappop(heap)
        if not is_live(item):
            continue
        if is_pinned(item[-1]):
            skipped.append(item)
            continue
        victim = item[-1]
        break
    for item in skipped:
        heapq.heappush(heap, item)
    if victim is None:
        free = [(r, k) for k, r in rank.items() if not is_pinned(k)]
        if not free:
            return None
        victim = min(free)[1]
    return victim
