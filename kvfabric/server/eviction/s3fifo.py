"""S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, and a ghost FIFO.

After Yang et al., "FIFO queues are all you need for cache eviction" (SOSP
2023). Most blocks of a KV-cache workload are seen once (the unique tail of a
prompt); S3-FIFO lets them leave quickly through the small queue while blocks
that were used again move to the main queue and stay.

* New keys enter the small FIFO ``S`` with frequency 0, unless the ghost FIFO
  ``G`` remembers them (recently evicted from ``S`` without reuse): those
  enter the main FIFO ``M`` directly.
* A hit (``on_access``) raises the key's frequency, capped at 3.
* ``evict``: while ``S`` holds at least ``small_fraction`` of the tracked
  bytes (or ``M`` is empty), take ``S``'s oldest unpinned key: if it was used
  since insertion it moves to ``M`` (frequency reset), otherwise it is the
  victim and its key goes to ``G``. Otherwise take ``M``'s oldest unpinned
  key: with frequency > 0 it is reinserted at ``M``'s tail with frequency - 1,
  else it is the victim.
* ``G`` holds keys only (no bytes), at most as many as are tracked.

The policy never learns the server's capacity: "small" is a fraction of the
bytes it currently tracks, which equals the capacity whenever eviction runs
on a full server. Pinned keys are skipped and keep their place. Each
``evict`` does O(1) amortised queue moves per eviction (every move spends a
frequency unit or promotes a key once), plus a skip over pinned heads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    summary = "S3-FIFO: blocks used once leave fast through a small FIFO"

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        self.small_fraction = small_fraction
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._size: dict[bytes, int] = {}
        self._small_bytes = 0
        self._bytes = 0

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        if key in self._freq:  # re-insert of a tracked key: treat as an access
            self.on_access(key)
            return
        self._freq[key] = 0
        self._size[key] = size
        self._bytes += size
        if self._ghost.pop(key, 0) is None:
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def on_access(self, key: bytes) -> None:
        f = self._freq.get(key)
        if f is not None and f < _MAX_FREQ:
            self._freq[key] = f + 1

    def on_remove(self, key: bytes) -> None:
        if key not in self._freq:
            return
        if self._small.pop(key, 0) is None:
            self._small_bytes -= self._size[key]
        else:
            self._main.pop(key, None)
        self._drop(key)

    def _drop(self, key: bytes) -> None:
        del self._freq[key]
        self._bytes -= self._size.pop(key)

    def evict(self, is_pinned: Callable[[bytes], bool]) -> bytes | None:
        # Each pass either returns, promotes a key S->M, or spends one frequency
        # unit in M; so the loop ends. It gives up when both queues hold only
        # pinned keys.
        while True:
            use_small = self._small and (self._small_bytes >= self.small_fraction * self._bytes or not self._main)
            key = self._first_unpinned(self._small if use_small else self._main, is_pinned)
            if key is None and use_small:
                key, use_small = self._first_unpinned(self._main, is_pinned), False
            elif key is None:
                key, use_small = self._first_unpinned(self._small, is_pinned), True
            if key is None:
                return None
            if use_small:
                del self._small[key]
                self._small_bytes -= self._size[key]
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._freq), 1):
                    self._ghost.popitem(last=False)
                self._drop(key)
                return key
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key]
            self._drop(key)
            return key

    @staticmethod
    def _first_unpinned(queue: OrderedDict[bytes, None], is_pinned: Callable[[bytes], bool]) -> bytes | None:
        for key in queue:
            if not is_pinned(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: bytes) -> bool:
        return key in self._freq
