"""Moving KV pages between a layer's KV tensor and pool objects in host memory, on any device.

Used by the worker (``worker.py``) when pages cannot be received in place:
the KV cache is on a GPU (``.numpy()`` of a CUDA tensor raises; the client
receives into host memory), or a page is several runs in the tensor
(``pages.PageLayout``: head-outer layouts). A CPU KV cache whose pages are one
run each keeps the worker's own path (receive straight into the blocks,
numpy views): this module is not used there.

Pieces, each usable on its own (``tests/gpu`` uses them without vLLM):

* :class:`SlotPool`: a bounded host slab of ``n_slots`` rows of ``obj_bytes``
  (one row = one pool object), pinned when the KV cache is on a GPU, handed
  out as contiguous :class:`Lease` ranges (first fit). When no range is free,
  ``take`` returns None at once: the caller skips the save or recomputes the
  load (counted), nothing ever waits for memory. The whole slab is registered
  with the client (``Client.register_buffers``), so ``native`` loads land in
  it with io_uring ``READ_FIXED``.
* :class:`Lane` (:class:`HostLane`, :class:`CudaLane`): where the copies run
  and how they are ordered against the engine's compute, through four calls:
  ``compute_mark`` (a mark of the compute stream's work so far),
  ``launch(after, fn)`` (run ``fn``'s device work after ``after``, on the
  transfer stream; returns a mark of its completion), ``compute_wait`` (later
  compute waits for a mark, the CPU does not) and ``host_wait`` (the CPU
  waits). ``CudaLane`` is one dedicated CUDA stream and CUDA events;
  ``HostLane`` runs ``fn`` at once and every mark is already complete (a copy
  between host tensors is done when it returns).
* :class:`PagedKV`: the layers' tensors, their ``PageLayout`` and a lane.
  ``gather(li, blocks, dst)`` copies the pages of ``blocks`` in layer ``li``
  into host rows: one batched gather on the device, then one device-to-host
  copy of the whole batch (a save: ``after`` = the mark taken when the
  layer's forward wrote it, so a save never reads a page before it is
  written); ``scatter(li, src, pairs)`` the reverse: one host-to-device copy
  of the batch, then one batched scatter into the blocks (a load: the
  returned mark is what attention must ``compute_wait`` for).

Ordering rules the worker keeps (``worker.py``):

* save, per layer: ``mark = compute_mark()`` in ``save_kv_layer`` (right
  after the layer's attention wrote its KV) and ``gather(..., after=mark)``;
  at ``wait_for_save`` every gather mark of the step is ``compute_wait``-ed,
  so the next step's compute cannot overwrite a block before its bytes left
  it; the put thread ``host_wait``-s the marks before the pool reads the rows;
* load: rows are filled by ``Client.get_into`` (CPU), then
  ``scatter(..., after=mark)`` with ``mark = compute_mark()`` taken when the
  load was started in the step (a block handed to a load may still be read by
  kernels queued for its previous owner); a load inside the step ``compute_wait``-s the mark (per
  layer with ``load_layerwise``, in ``wait_for_layer_load``); an async load
  ``host_wait``-s it before the request is reported finished;
* a lease goes back to the pool only after every mark of a copy reading or
  writing its rows completed (``release(lease, marks)`` host-waits them).

Not verified on a real GPU yet (2026-12-05): ``CudaLane`` and the pinned slab
ran on no device here; ``tests/gpu`` and ``scripts/gpu-check.sh`` are ready
for one. The same gather / scatter code is tested on CPU tensors
(``tests/unit/test_transfer_core.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .pages import PageLayout

__all__ = ["CudaLane", "HostLane", "Lane", "Lease", "PagedKV", "SlotPool", "layer_layout"]


# ------------------------------------------------------------------ ordering


class Lane(Protocol):
    """Where transfers run and how they are ordered against compute (module docstring)."""

    def compute_mark(self) -> Any: ...

    def launch(self, after: Any, fn: Callable[[], None]) -> Any: ...

    def compute_wait(self, mark: Any) -> None: ...

    def host_wait(self, mark: Any) -> None: ...


class HostLane:
    """Host tensors: ``fn`` runs at once in the caller's thread; every mark is complete."""

    def compute_mark(self) -> None:
        return None

    def launch(self, after: Any, fn: Callable[[], None]) -> None:
        fn()
        return None

    def compute_wait(self, mark: Any) -> None:
        return None

    def host_wait(self, mark: Any) -> None:
        return None


class CudaLane:
    """One dedicated CUDA stream on ``device``; marks are CUDA events.

    ``compute_mark`` records an event on the thread's current stream of the
    device (vLLM's compute stream in the step); ``launch`` makes the transfer
    stream wait for ``after`` (GPU-side) before ``fn``'s work, and records a
    completion event after it. ``fn`` may be called from any thread (the
    stream context is set there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def compute_mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def launch(self, after: torch.cuda.Event | None, fn: Callable[[], None]) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def compute_wait(self, mark: torch.cuda.Event | None) -> None:
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    def host_wait(self, mark: torch.cuda.Event | None) -> None:
        if mark is not None:
            mark.synchronize()


# ------------------------------------------------------------------ bounded host rows


class Lease:
    """Rows ``[start, start + n)`` of a :class:`SlotPool`, until released."""

    __slots__ = ("start", "n", "rows", "released")

    def __init__(self, start: int, n: int, rows: torch.Tensor) -> None:
        self.start, self.n, self.rows = start, n, rows      # rows: uint8 [n, obj_bytes]
        self.released = False

    def __repr__(self) -> str:
        return f"Lease({self.start}+{self.n})"


class SlotPool:
    """``n_slots`` host rows of ``obj_bytes`` (pinned for a GPU), leased as contiguous ranges.

    Thread-safe. ``take(n)`` returns a :class:`Lease` or None when no ``n``
    contiguous free rows exist (never waits, never allocates). The slab is
    allocated once, here: ``n_slots * obj_bytes`` bytes, checked against
    nothing else (the caller sizes it from its configured bound).
    """

    def __init__(self, n_slots: int, obj_bytes: int, *, pin: bool) -> None:
        if n_slots < 1 or obj_bytes < 1:
            raise ValueError(f"a slot pool needs slots and bytes, got {n_slots} x {obj_bytes}")
        self.n_slots, self.obj_bytes, self.pinned = n_slots, obj_bytes, pin
        self.slab = torch.empty((n_slots, obj_bytes), dtype=torch.uint8, pin_memory=pin)
        self._free: list[tuple[int, int]] = [(0, n_slots)]   # sorted, disjoint, never adjacent
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.obj_bytes

    def free_slots(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def take(self, n: int) -> Lease | None:
        """``n`` contiguous rows, or None when none are free (first fit)."""
        if n < 1:
            raise ValueError(f"lease of {n} rows")
        with self._lock:
            for i, (start, size) in enumerate(self._free):
                if size >= n:
                    if size == n:
                        del self._free[i]
                    else:
                        self._free[i] = (start + n, size - n)
                    return Lease(start, n, self.slab[start:start + n])
        return None

    def give_back(self, lease: Lease) -> None:
        """Return ``lease``'s rows (the caller waited for every copy touching them). Once only."""
        with self._lock:
            if lease.released:
                raise RuntimeError(f"{lease} released twice")
            lease.released = True
            lo, hi = lease.start, lease.start + lease.n
            i = 0
            while i < len(self._free) and self._free[i][0] < lo:
                i += 1
            if (i and self._free[i - 1][0] + self._free[i - 1][1] > lo) or \
                    (i < len(self._free) and self._free[i][0] < hi):
                raise RuntimeError(f"{lease} overlaps free rows {self._free}")
            self._free.insert(i, (lo, lease.n))
            # merge with the neighbours, so the free list stays minimal
            if i + 1 < len(self._free) and lo + lease.n == self._free[i + 1][0]:
                self._free[i] = (lo, lease.n + self._free[i + 1][1])
                del self._free[i + 1]
            if i and self._free[i - 1][0] + self._free[i - 1][1] == lo:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]


# ------------------------------------------------------------------ pages


def layer_layout(kv: torch.Tensor, block_dim: int = 0) -> PageLayout:
    """The page layout of one per-layer KV tensor (vLLM 0.32: block axis 0; ``pages`` docstring)."""
    return PageLayout.of(tuple(kv.shape), tuple(kv.stride()), kv.element_size(), block_dim=block_dim)


def page_rows(kv: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``kv``'s pages as a uint8 view ``[num_blocks, *outer sizes, run_bytes]``: element ``[b]`` is
    block ``b``'s page in object order (contiguous as a whole only when ``layout.contiguous``)."""
    base = kv.view(torch.uint8) if kv.dtype != torch.uint8 else kv
    return torch.as_strided(
        base,
        (layout.num_blocks, *(s for s, _ in layout.outer), layout.run_bytes),
        (layout.block_stride, *(st for _, st in layout.outer), 1),
        base.storage_offset())


class PagedKV:
    """The layers' KV tensors (same shape, dtype, device) and how to move their pages (module docstring)."""

    def __init__(self, layers: Sequence[torch.Tensor], lane: Lane, block_dim: int = 0) -> None:
        if not layers:
            raise ValueError("no KV layers")
        self.layers = list(layers)
        self.layout = layer_layout(self.layers[0], block_dim)
        self.device = self.layers[0].device
        self.lane = lane
        self._pages = [page_rows(kv, self.layout) for kv in self.layers]
        self._page_shape = tuple(self._pages[0].shape[1:])

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def gather(self, li: int, blocks: Sequence[int], dst: torch.Tensor, after: Any = None) -> Any:
        """Copy the pages of ``blocks`` (layer ``li``) into ``dst`` (host uint8, ``len(blocks) *
        page_bytes`` bytes, contiguous): page ``i`` lands at ``i * page_bytes``. Runs after ``after``;
        returns the completion mark (``dst`` is complete when the lane says so)."""
        if dst.numel() != len(blocks) * self.page_bytes or not dst.is_contiguous():
            raise ValueError(f"gather of {len(blocks)} pages into {dst.numel()} bytes")
        idx = torch.tensor(list(blocks), dtype=torch.long)
        out = dst.view(len(blocks), *self._page_shape)
        pages = self._pages[li]

        def run() -> None:
            src = pages.index_select(0, idx.to(self.device, non_blocking=True))   # one gather, contiguous
            out.copy_(src, non_blocking=True)                                      # one device-to-host copy

        return self.lane.launch(after, run)

    def scatter(self, li: int, src: torch.Tensor, pairs: Sequence[tuple[int, int]], after: Any = None) -> Any:
        """Copy pages from ``src`` (host uint8 rows of ``page_bytes``, contiguous) into layer ``li``:
        ``(i, b)`` writes source page ``i`` into block ``b``. One host-to-device copy of ``src``,
        one batched scatter. Returns the completion mark (attention must wait for it)."""
        if not pairs:
            return None
        if src.numel() % self.page_bytes or not src.is_contiguous():
            raise ValueError(f"scatter from {src.numel()} bytes (pages of {self.page_bytes})")
        n = src.numel() // self.page_bytes
        if any(not 0 <= i < n for i, _ in pairs):
            raise ValueError(f"scatter names source pages outside 0..{n - 1}")
        s_idx = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        d_idx = torch.tensor([b for _, b in pairs], dtype=torch.long)
        host = src.view(n, *self._page_shape)
        pages = self._pages[li]

        def run() -> None:
            dev = host.to(self.device, non_blocking=True)                         # one host-to-device copy
            if len(pairs) != n or s_idx.tolist() != list(range(n)):
                dev = dev.index_select(0, s_idx.to(self.device, non_blocking=True))
            pages.index_copy_(0, d_idx.to(self.device, non_blocking=True), dev)   # one scatter

        return self.lane.launch(after, run)

    def release(self, pool: SlotPool, lease: Lease, marks: Sequence[Any] = ()) -> None:
        """Give ``lease`` back once every copy in ``marks`` (those touching its rows) completed."""
        for m in marks:
            self.lane.host_wait(m)
        pool.give_back(lease)
