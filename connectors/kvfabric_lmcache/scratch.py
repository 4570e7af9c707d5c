"""Reusable staging buffers for the connector's gets and puts.

A stored chunk is header + bytes (:mod:`.value`), so it cannot be received
straight into LMCache's memory object nor sent from it without one staging
copy. A fresh staging buffer per chunk (32 MiB for an 8B model) is a fresh
``mmap`` whose pages fault in on every call, which on the measured path cost
about as much as the network itself; buffers taken from this pool are
already faulted in. The pool keeps at most ``retain`` buffers; a burst that
needs more allocates them and drops the extras when they come back, so the
memory it holds stays bounded by ``retain * buf_bytes``.
"""

from __future__ import annotations

import threading

import numpy as np


class ScratchPool:
    """Thread-safe free list of ``buf_bytes``-sized uint8 arrays (see the module docstring)."""

    def __init__(self, buf_bytes: int, retain: int) -> None:
        if buf_bytes <= 0 or retain < 0:
            raise ValueError(f"buf_bytes must be > 0 and retain >= 0, got {buf_bytes}, {retain}")
        self.buf_bytes = buf_bytes
        self.retain = retain
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[np.ndarray]:
        """``n`` buffers for the caller's exclusive use until :meth:`give`."""
        with self._lock:
            k = min(n, len(self._free))
            got = [self._free.pop() for _ in range(k)]
        got.extend(np.empty(self.buf_bytes, dtype=np.uint8) for _ in range(n - k))
        return got

    def give(self, bufs: list[np.ndarray]) -> None:
        """Return buffers taken with :meth:`take` (the caller must not touch them afterwards)."""
        with self._lock:
            room = self.retain - len(self._free)
            if room > 0:
                self._free.extend(b for b in bufs[:room] if b.size == self.buf_bytes)

    @property
    def retained(self) -> int:
        with self._lock:
            return len(self._free)


__all__ = ["ScratchPool"]
