"""The server's object memory: one preallocated arena and a page-granular extent allocator.

Algorithm
---------
The arena is one anonymous ``mmap`` of ``capacity`` bytes (rounded down to a
whole number of 4 KiB pages), made once at start. Objects live in it; the
server never holds object bytes in Python ``bytes``. Sockets receive straight
into, and send straight from, ``memoryview`` slices of it (:meth:`Arena.view`).

Space is handed out in runs of whole pages ("extents"). Free extents are kept
in three structures, all plain dicts keyed by page number:

* ``_free_start[start] = npages`` and ``_free_end[end] = start``, so that a
  freed extent merges with free neighbours on both sides in O(1);
* ``_bins[b]``: the free extents whose length lies in ``[2**b, 2**(b+1))``
  pages (segregated fit, as in TLSF). An allocation of ``n`` pages first looks
  for an exact or first fit among the first few extents of ``n``'s own bin,
  then takes any extent of a larger bin (every one of them fits) and splits it.

Fragmentation bound
-------------------
* Internal: each object wastes less than one page (4 KiB), so an object of
  ``s`` bytes occupies ``ceil(s / 4096)`` pages.
* External: neighbouring free extents always merge, so free space is split
  only by live objects. When objects have one size (the KV-cache case: every
  block of a model has the same byte size) a freed slot is exactly the size
  of the next object and nothing is ever lost to fragmentation. With mixed
  sizes, an allocation can fail while enough total space is free; the store
  then evicts more objects until an extent large enough exists (at worst all
  unpinned ones, after which free space is contiguous between pinned ones).

Memory bound
------------
Resident memory for objects is at most ``capacity``: pages are touched only
inside the mapping and never duplicated. Bookkeeping is a few dict entries per
free extent (at most one per live object + 1).

Thread safety: none. The store calls the arena under its own lock.
"""

from __future__ import annotations

import mmap
import os

PAGE_SIZE = 4096
# How many extents of the request's own bin are examined for a fit before a
# larger bin is split: bounds allocation work while still preferring exact fits.
_BIN_SCAN = 16


class ArenaError(ValueError):
    """Bad arena parameters or a double/unknown free (a bug in the caller)."""


def pages_for(size: int) -> int:
    """Whole pages that an object of ``size`` bytes occupies (at least 1)."""
    return max(1, -(-size // PAGE_SIZE))


class Arena:
    """``capacity`` bytes of preallocated memory with ``alloc``/``free`` of page runs.

    ``memfd=True`` backs the arena with a ``memfd`` (exposed as ``.fd``) so a
    same-host transport can map it into another process; otherwise it is a
    private anonymous mapping and ``.fd`` is ``None``. ``hugepages=True``
    asks for transparent huge pages (``MADV_HUGEPAGE``; off by default: with
    the kernel's ``defrag=madvise`` setting a first touch may stall on
    compaction, and 4 KiB pages are only slower on first touch).

    Raises :class:`ArenaError` if ``capacity`` is below one page; ``OSError``
    if the mapping cannot be made.
    """

    def __init__(self, capacity: int, *, memfd: bool = False, hugepages: bool = False) -> None:
        if type(capacity) is not int or capacity < PAGE_SIZE:
            raise ArenaError(f"arena capacity must be an int >= {PAGE_SIZE} bytes, got {capacity!r}")
        self.npages = capacity // PAGE_SIZE
        self.capacity = self.npages * PAGE_SIZE
        self.fd: int | None = None
        if memfd:
            self.fd = os.memfd_create("kvfabric-arena", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.capacity)
            self._mm = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED)
        else:
            self._mm = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self._mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass  # transparent huge pages unavailable: 4 KiB pages work the same, slower to fault in
        self.buffer = memoryview(self._mm)
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{} for _ in range(self.npages.bit_length() + 1)]
        self._allocated: dict[int, int] = {}  # start page -> npages, to catch bad frees
        self.used_pages = 0
        self._add_free(0, self.npages)

    # ------------------------------------------------------------------ public

    def alloc(self, size: int) -> int | None:
        """Reserve room for ``size`` bytes; return its byte offset, or ``None`` if no extent fits."""
        if size < 0:
            raise ArenaError(f"negative allocation size {size}")
        n = pages_for(size)
        if n > self.npages:
            return None
        start = self._find(n)
        if start is None:
            return None
        length = self._free_start[start]
        self._remove_free(start, length)
        if length > n:
            self._add_free(start + n, length - n)
        self._allocated[start] = n
        self.used_pages += n
        return start * PAGE_SIZE

    def free(self, offset: int, size: int) -> None:
        """Return the extent given by ``alloc`` for ``size`` bytes; merges with free neighbours.

        Raises :class:`ArenaError` for an offset that is not allocated or a
        size that does not match its allocation.
        """
        start, rem = divmod(offset, PAGE_SIZE)
        n = pages_for(size)
        if rem or self._allocated.get(start) != n:
            raise ArenaError(f"free of unallocated extent offset={offset} size={size}")
        del self._allocated[start]
        self.used_pages -= n
        # merge with the free extent that ends where this one starts
        prev_start = self._free_end.get(start)
        if prev_start is not None:
            prev_len = self._free_start[prev_start]
            self._remove_free(prev_start, prev_len)
            start, n = prev_start, n + prev_len
        # ... and with the one that starts where this one ends
        next_len = self._free_start.get(start + n)
        if next_len is not None:
            self._remove_free(start + n, next_len)
            n += next_len
        self._add_free(start, n)

    def view(self, offset: int, size: int) -> memoryview:
        """A writable ``memoryview`` of ``size`` bytes at ``offset`` (no copy)."""
        return self.buffer[offset : offset + size]

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated extents (page-rounded)."""
        return self.used_pages * PAGE_SIZE

    @property
    def free_bytes(self) -> int:
        return (self.npages - self.used_pages) * PAGE_SIZE

    @property
    def free_extents(self) -> int:
        return len(self._free_start)

    def largest_free(self) -> int:
        """Bytes in the largest free extent (O(number of free extents))."""
        return max(self._free_start.values(), default=0) * PAGE_SIZE

    def check(self) -> None:
        """Assert the allocator's invariants (tests call this): extents tile the arena exactly."""
        spans = sorted([(s, n, "free") for s, n in self._free_start.items()] + [(s, n, "used") for s, n in self._allocated.items()])
        pos = 0
        prev_kind = None
        for s, n, kind in spans:
            assert s == pos, f"gap or overlap at page {pos} (next extent at {s})"
            assert n > 0
            assert not (kind == "free" and prev_kind == "free"), f"unmerged free neighbours at page {s}"
            pos, prev_kind = s + n, kind
        assert pos == self.npages, f"extents cover {pos} of {self.npages} pages"
        assert sum(self._allocated.values()) == self.used_pages
        assert len(self._free_end) == len(self._free_start)
        assert sum(len(b) for b in self._bins) == len(self._free_start)

    def close(self) -> None:
        """Unmap the arena. Views handed out earlier must have been released (else ``BufferError``)."""
        self.buffer.release()
        self._mm.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # ----------------------------------------------------------------- private

    def _find(self, n: int) -> int | None:
        b = n.bit_length() - 1
        bin_ = self._bins[b]
        best = None
        for i, start in enumerate(bin_):
            length = self._free_start[start]
            if length == n:
                return start
            if length > n and best is None:
                best = start
            if i >= _BIN_SCAN:
                break
        if best is not None:
            return best
        for bigger in self._bins[b + 1 :]:
            for start in bigger:
                return start
        return None

    def _add_free(self, start: int, n: int) -> None:
        self._free_start[start] = n
        self._free_end[start + n] = start
        self._bins[n.bit_length() - 1][start] = None

    def _remove_free(self, start: int, n: int) -> None:
        del self._free_start[start]
        del self._free_end[start + n]
        del self._bins[n.bit_length() - 1][start]
