"""Where one block's page of one layer lies in that layer's KV tensor: byte runs (pure logic).

A pool object (``layout``) is the pages of a chunk's blocks in one layer,
concatenated. A page is what vLLM's per-layer KV tensor holds for one block;
this module says which bytes of the tensor make it up and in which order, from
the tensor's shape and strides alone, so the same description serves a CPU
tensor (receive in place, numpy views) and a CUDA tensor (batched gather and
scatter through pinned host memory, ``transfer``). No torch here: the unit
tests run in the dev virtualenv.

The description (:class:`PageLayout`): the page's bytes are ``runs`` of
``run_bytes`` contiguous bytes each; the dimensions that could not be merged
into a run (``outer``, logical order, with their byte strides) enumerate the
runs, row-major. Object bytes of one page = those runs in that order. So:

* a page that is one contiguous run (every block-compact layout) is its
  memory bytes as they are, and a load can receive it in place;
* a page split over several runs (K and V pages apart, head-outer layouts) is
  its runs concatenated, outer dimensions in logical order;
* the bytes depend only on the layout, shape and dtype, never on the device,
  the tensor's base address or padding between blocks: a CPU and a GPU
  engine with the same vLLM layout produce byte-identical objects. Different
  layouts never share objects because the namespace binds vLLM's layout name
  (``config.kv_layout_name`` from ``KVCacheConfig.kv_cache_layout``).

vLLM 0.32's layouts (installed ``vllm`` package, paths under ``vllm/``): every
attention backend gets a logical 4-D per-layer view ``[B, H, N, C]`` (blocks,
head slots, tokens of a block, content bytes: K then V of a token's head,
``head_size + head_size_v`` elements; ``v1/kv_cache_interface.py:319-335``
``compute_layer_kv_cache_shape_bytes``, ``:544-549``
``state_content_size_bytes``), over one flat buffer whose physical order is a
stride permutation of ``[L, B, H, N, C]`` (``v1/kv_cache_layout.py:15-28``
``KVCacheLayout``; ``v1/kv_cache_interface.py:338-371``
``compute_layout_strides``; ``:376-441`` ``create_kv_cache_views``):

==========  =========================================  ===========================
layout      who picks it                               one block's page
==========  =========================================  ===========================
``LBHNC``   CPU (``v1/attention/backends/cpu_attn.py:  one run, ``[H, N, C]``
            73-75``); FlashInfer on SM100
            (``flashinfer.py:604-610``)
``LBNHC``   the default preference, so FlashAttention  one run, ``[N, H, C]``
            (declares none; ``backends/utils.py:
            194-201``; its view ``flash_attn.py:
            1196-1197``, K/V split at ``:1252``)
``BLHNC``   FlashInfer SM100 second choice; blocks     one run, ``[H, N, C]``
            outermost, layers interleaved              (block stride = L pages)
``BLNHC``   cross-layer, token-major                   one run (block stride L pages)
``LHBNC``   ROCm backends (``rocm_attn.py:232-237``)   ``H`` runs of ``[N, C]``
``BHLNC``   head-major across layers                   ``H`` runs of ``[N, C]``
==========  =========================================  ===========================

MLA in 0.32 is the same view with ``H = 1`` and ``C`` the latent + rope
bytes (``model_executor/layers/attention/mla_attention.py:734-736`` squeezes
``[B, 1, N, C]`` to the kernels' ``[B, N, C]``). Older vLLM releases gave
FlashAttention ``[2, B, N, H, D]`` (block axis 1; K and V pages apart: two
runs) and FlashInfer ``[B, 2, N, H, D]``; ``PageLayout.of`` describes those
too (``block_dim``), and the unit tests cover them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

__all__ = ["MAX_RUNS_PER_PAGE", "PageLayout"]

#: More runs than this per page would make every gather a scatter of tiny copies: refused.
MAX_RUNS_PER_PAGE = 4096


@dataclass(frozen=True)
class PageLayout:
    """One block's page in a layer's KV tensor, as byte runs (module docstring).

    Offsets are in bytes from the tensor's first element (its storage offset),
    so a layer tensor ``t`` holds block ``b``'s run ``i`` at
    ``t``'s first byte + ``run_offsets(b)[i]``.
    """

    num_blocks: int
    block_stride: int                       # bytes from one block's page to the next
    outer: tuple[tuple[int, int], ...]      # (size, byte stride) of the dims enumerating runs, logical order
    run_bytes: int                          # contiguous bytes per run

    @property
    def runs_per_page(self) -> int:
        return math.prod(s for s, _ in self.outer)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: of one pool object per block in the chunk."""
        return self.runs_per_page * self.run_bytes

    @property
    def contiguous(self) -> bool:
        """True when a page is one run (a load can receive it in place)."""
        return not self.outer

    def run_offsets(self, block: int) -> list[int]:
        """Byte offsets of block ``block``'s runs, in object order."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside 0..{self.num_blocks - 1}")
        base = block * self.block_stride
        if not self.outer:
            return [base]
        return [base + sum(i * st for i, (_, st) in zip(idx, self.outer))
                for idx in product(*(range(s) for s, _ in self.outer))]

    def object_ranges(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, length) byte ranges whose concatenation is the pool object of ``blocks``
        (a chunk's blocks, in order), adjacent runs merged."""
        out: list[tuple[int, int]] = []
        for b in blocks:
            for off in self.run_offsets(b):
                if out and out[-1][0] + out[-1][1] == off:
                    out[-1] = (out[-1][0], out[-1][1] + self.run_bytes)
                else:
                    out.append((off, self.run_bytes))
        return out

    @classmethod
    def of(cls, shape: Sequence[int], strides: Sequence[int], itemsize: int, block_dim: int = 0) -> PageLayout:
        """Describe a KV tensor of ``shape`` / element ``strides`` whose axis ``block_dim`` is the block.

        Raises ``ValueError`` for a tensor whose pages overlap each other or
        themselves, a negative stride, or pages of more than
        ``MAX_RUNS_PER_PAGE`` runs (the connector then refuses the layout at
        start, ``kvfabric.ConfigError``).
        """
        if len(shape) != len(strides) or not 0 <= block_dim < len(shape):
            raise ValueError(f"bad KV tensor description: shape {tuple(shape)}, strides {tuple(strides)}, "
                             f"block axis {block_dim}")
        if itemsize < 1 or any(s < 0 for s in strides) or any(n < 1 for n in shape):
            raise ValueError(f"unsupported KV tensor: shape {tuple(shape)}, strides {tuple(strides)}")
        # the page's dims with their byte strides, logical order; size-1 dims do not matter
        dims = [(n, st * itemsize) for d, (n, st) in enumerate(zip(shape, strides)) if d != block_dim and n > 1]
        # merge from the innermost dim (smallest stride) outward while each continues the run
        run, merged = itemsize, set()
        for i in sorted(range(len(dims)), key=lambda i: dims[i][1]):
            n, st = dims[i]
            if st != run:
                break
            run *= n
            merged.add(i)
        outer = tuple(d for i, d in enumerate(dims) if i not in merged)
        layout = cls(num_blocks=shape[block_dim], block_stride=strides[block_dim] * itemsize, outer=outer,
                     run_bytes=run)
        if layout.runs_per_page > MAX_RUNS_PER_PAGE:
            raise ValueError(f"a page of shape {tuple(shape)} / strides {tuple(strides)} is "
                             f"{layout.runs_per_page} runs of {run} bytes (more than {MAX_RUNS_PER_PAGE})")
        # no two bytes of any two (block, run) pairs may coincide: sorted by stride, each dim
        # must step past everything the dims inside it span
        span = run
        for n, st in sorted([*outer, (layout.num_blocks, layout.block_stride)], key=lambda d: d[1]):
            if n > 1 and st < span:
                raise ValueError(f"KV tensor with shape {tuple(shape)} / strides {tuple(strides)} has "
                                 "overlapping pages")
            span = max(span, st * (n - 1) + span)
        return layout
