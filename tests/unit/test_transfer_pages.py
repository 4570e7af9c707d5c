"""pages.PageLayout: one block's page of a vLLM KV tensor as byte runs, from shape and strides alone.

The strides are those vLLM 0.32 gives each layout (``KVCacheLayout``: a stride
permutation of the logical ``[L, B, H, N, C]``), computed here the way
``compute_layout_strides`` does for dense pages; the e2e transfer tests
(tests/e2e/vllm/test_transfer.py) check the same against vLLM's own
``create_kv_cache_views`` and move real bytes.
"""

from __future__ import annotations

import math

import pytest

from kvfabric_vllm.pages import MAX_RUNS_PER_PAGE, PageLayout

# vLLM 0.32's KVCacheLayout members: physical order of the logical axes L, B, H, N, C
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def layer_view(order: tuple[int, ...], shape5: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, element strides) of one layer's ``[B, H, N, C]`` view for a dense allocation."""
    strides = [0] * 5
    acc = 1
    for dim in reversed(order):
        strides[dim] = acc
        acc *= shape5[dim]
    return shape5[1:], tuple(strides[1:])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_vllm_032_layouts(name):
    L, B, H, N, C, isz = 3, 7, 4, 16, 2 * 64, 2       # fp16, head_size 64: C holds K then V
    shape, strides = layer_view(LAYOUTS[name], (L, B, H, N, C))
    pl = PageLayout.of(shape, strides, isz)
    page = H * N * C * isz
    assert pl.page_bytes == page and pl.num_blocks == B
    if name in ("LHBNC", "BHLNC"):          # head outside the block: one run of [N, C] per head
        assert (pl.runs_per_page, pl.run_bytes) == (H, N * C * isz), pl
        assert not pl.contiguous
    else:                                   # block-compact: the page is one run
        assert pl.contiguous and pl.run_bytes == page, pl
    # blocks outermost: the block stride spans every layer's page
    assert pl.block_stride == (L * page if name.startswith("B") else page if name[1] == "B" else N * C * isz)


def test_mla_is_one_run_per_page():
    # vLLM 0.32 MLA: [B, H=1, N, C] (C = latent + rope), any layout; and the older [B, N, D]
    for name, order in LAYOUTS.items():
        shape, strides = layer_view(order, (2, 5, 1, 16, 576))
        pl = PageLayout.of(shape, strides, 2)
        assert pl.contiguous and pl.page_bytes == 16 * 576 * 2, (name, pl)
    assert PageLayout.of((5, 16, 576), (16 * 576, 576, 1), 2).run_bytes == 16 * 576 * 2


def test_older_flash_attention_and_flashinfer_shapes():
    # vLLM <= 0.11 FlashAttention: [2, B, N, H, D], block axis 1: K and V pages apart (2 runs)
    B, N, H, D = 6, 16, 2, 8
    fa = PageLayout.of((2, B, N, H, D), (B * N * H * D, N * H * D, H * D, D, 1), 4, block_dim=1)
    assert (fa.runs_per_page, fa.run_bytes, fa.block_stride) == (2, N * H * D * 4, N * H * D * 4)
    assert fa.run_offsets(3) == [3 * N * H * D * 4, (B * N * H * D + 3 * N * H * D) * 4]
    # FlashInfer: [B, 2, N, H, D]: K and V of a block adjacent, one run
    fi = PageLayout.of((B, 2, N, H, D), (2 * N * H * D, N * H * D, H * D, D, 1), 4)
    assert fi.contiguous and fi.page_bytes == 2 * N * H * D * 4


def test_object_ranges_merge_adjacent_runs_in_order():
    shape, strides = layer_view(LAYOUTS["LHBNC"], (1, 4, 2, 2, 3))
    pl = PageLayout.of(shape, strides, 1)            # runs of 6 bytes, head stride 24, block stride 6
    assert pl.run_offsets(1) == [6, 30]
    # object order is block by block, each block's runs in head order (not merged across heads)
    assert pl.object_ranges([1, 2]) == [(6, 6), (30, 6), (12, 6), (36, 6)]
    lbhnc = PageLayout.of(*layer_view(LAYOUTS["LBHNC"], (1, 4, 2, 2, 3)), 1)
    assert lbhnc.object_ranges([1, 2, 0]) == [(12, 24), (0, 12)]   # consecutive pages merged


def test_padding_between_blocks_is_not_part_of_the_page():
    # a padded page (vLLM's page_size_padded): block stride larger than the page
    pl = PageLayout.of((4, 2, 16, 32), (2 * 16 * 32 + 64, 16 * 32, 32, 1), 2)
    assert pl.contiguous and pl.page_bytes == 2 * 16 * 32 * 2 and pl.block_stride == (2 * 16 * 32 + 64) * 2


@pytest.mark.parametrize("shape, strides, message", [
    ((4, 2, 8), (8, 8, 1), "overlapping"),            # one block's page spans the next one's
    ((4, 2, 8), (4, 8, 1), "overlapping"),            # blocks overlap
    ((4, 2, 8), (16, 8, -1), "unsupported"),
    ((4, 2, 8), (16, 8), "bad KV tensor"),
])
def test_refused_tensors(shape, strides, message):
    with pytest.raises(ValueError, match=message):
        PageLayout.of(shape, strides, 2)


def test_too_many_runs_are_refused():
    # content innermost but not unit-stride: every element its own run
    n = MAX_RUNS_PER_PAGE + 1
    with pytest.raises(ValueError, match="runs"):
        PageLayout.of((2, n), (2 * n, 2), 1)


def test_run_offsets_bounds():
    pl = PageLayout.of((3, 8), (8, 1), 1)
    assert pl.run_offsets(2) == [16]
    with pytest.raises(IndexError):
        pl.run_offsets(3)
    assert math.prod(s for s, _ in pl.outer) == 1
