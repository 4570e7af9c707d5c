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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar


class EvictionPolicy(ABC):
    name: ClassVar[str]

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
