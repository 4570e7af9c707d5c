"""The transfer core (kvfabric_vllm.transfer) on CPU tensors laid out as vLLM 0.32 lays them out,
and the worker's transfer-buffer path on real pool servers (torch from the vLLM virtualenv).

The KV views come from vLLM's own ``create_kv_cache_views`` for every
``KVCacheLayout``; the path the worker takes for a GPU (bounded transfer
buffer, batched gather / scatter, lane ordering) is the one it takes here for
a CPU KV cache whose pages are several runs (head-outer layouts), with the
host lane (marks complete at once). CUDA itself is tested in tests/gpu.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfabric import Client
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.meta import LoadSpec, SaveSpec
from kvfabric_vllm.metrics import Counters
from kvfabric_vllm.transfer import HostLane, PagedKV, SlotPool, layer_layout
from kvfabric_vllm.worker import WorkerSide

SPECS = {
    "attn-fp16": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16),
    "mla-bf16": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=24, dtype=torch.bfloat16),
}


def vllm_views(spec, layout: KVCacheLayout, num_blocks: int, n_layers: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat int8 allocation and its per-layer [B, H, N, C] views, exactly as vLLM 0.32 makes them."""
    strides = compute_layout_strides(spec, num_blocks, n_layers, layout)
    size = n_layers * num_blocks * spec.page_size_bytes
    kt = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(n_layers)], layer_stride=strides[0],
                       block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8)
    return raw, create_kv_cache_views(raw, spec, num_blocks, layout, kt)


def object_bytes(raw: torch.Tensor, view: torch.Tensor, blocks: list[int]) -> bytes:
    """The pool object of ``blocks`` read straight from the allocation's bytes (pages.object_ranges)."""
    mem = raw.numpy().tobytes()
    base = (view.storage_offset() - raw.storage_offset()) * view.element_size()
    return b"".join(mem[base + o: base + o + n] for o, n in layer_layout(view).object_ranges(blocks))


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_gather_then_scatter_into_other_blocks_is_byte_exact(spec_name, layout):
    spec = SPECS[spec_name]
    src_raw, src = vllm_views(spec, layout, num_blocks=6, n_layers=3)
    dst_raw, dst = vllm_views(spec, layout, num_blocks=6, n_layers=3)
    g = torch.Generator().manual_seed(hash((spec_name, layout.name)) & 0xFFFF)
    src_raw.copy_(torch.randint(-128, 128, src_raw.shape, dtype=torch.int8, generator=g))
    a, b = PagedKV(src, HostLane()), PagedKV(dst, HostLane())
    page = a.page_bytes
    assert page == spec.page_size_bytes
    blocks, into = [4, 1, 5], [0, 3, 2]
    for li in range(3):
        rows = torch.empty(len(blocks) * page, dtype=torch.uint8)
        a.gather(li, blocks, rows)
        assert rows.numpy().tobytes() == object_bytes(src_raw, src[li], blocks), f"{layout.name} layer {li}"
        b.scatter(li, rows, list(enumerate(into)))
        for s_blk, d_blk in zip(blocks, into):
            assert object_bytes(dst_raw, dst[li], [d_blk]) == object_bytes(src_raw, src[li], [s_blk])
    # nothing outside the written pages changed
    written = sum(len(object_bytes(dst_raw, dst[li], into)) for li in range(3))
    assert int(torch.count_nonzero(dst_raw)) <= written
    untouched = [blk for blk in range(6) if blk not in into]
    assert all(object_bytes(dst_raw, dst[li], untouched) == bytes(len(untouched) * page) for li in range(3))


def test_cpu_layout_objects_are_todays_pages():
    # LBHNC (vLLM's CPU layout): an object is the page's bytes kv[b], as the direct path stores it
    _, views = vllm_views(SPECS["attn-fp16"], KVCacheLayout.LBHNC, num_blocks=4, n_layers=1)
    kv = views[0]
    kv.copy_(torch.randn(kv.shape).to(kv.dtype))
    rows = torch.empty(2 * kv[0].numel() * kv.element_size(), dtype=torch.uint8)
    PagedKV([kv], HostLane()).gather(0, [2, 0], rows)
    assert rows.numpy().tobytes() == kv[2].view(torch.uint8).numpy().tobytes() + kv[0].view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("shape, strides, block_dim", [
    ((2, 6, 16, 2, 8), (6 * 256, 256, 16, 8, 1), 1),     # older FlashAttention [2, B, N, H, D]
    ((6, 2, 16, 2, 8), (512, 256, 16, 8, 1), 0),         # older FlashInfer [B, 2, N, H, D]
    ((6, 16, 24), (384, 24, 1), 0),                      # older MLA [B, N, D]
])
def test_older_vllm_shapes_round_trip(shape, strides, block_dim):
    n = sum(s * (d - 1) for s, d in zip(strides, shape)) + 1
    src = torch.randn(n).as_strided(shape, strides)
    dst = torch.zeros(n).as_strided(shape, strides)
    a, b = PagedKV([src], HostLane(), block_dim), PagedKV([dst], HostLane(), block_dim)
    rows = torch.empty(2 * a.page_bytes, dtype=torch.uint8)
    a.gather(0, [5, 2], rows)
    b.scatter(0, rows, [(0, 1), (1, 4)])
    for s_blk, d_blk in ((5, 1), (2, 4)):
        assert torch.equal(src.select(block_dim, s_blk), dst.select(block_dim, d_blk))
    assert torch.count_nonzero(dst).item() == 2 * src.select(block_dim, 0).numel()


def test_slot_pool_bounds_and_first_fit():
    pool = SlotPool(8, 16, pin=False)
    a, b, c = pool.take(3), pool.take(3), pool.take(2)
    assert (a.start, b.start, c.start) == (0, 3, 6)
    assert pool.take(1) is None                      # exhausted: None at once, never waits
    pool.give_back(b)
    assert pool.take(4) is None and pool.free_slots() == 3   # 3 free, not 4 contiguous
    pool.give_back(a)                                # merges with b's range: 0..5 free
    d = pool.take(6)
    assert d is not None and d.start == 0 and d.rows.shape == (6, 16)
    with pytest.raises(RuntimeError, match="twice"):
        pool.give_back(a)
    pool.give_back(c)
    pool.give_back(d)
    assert pool.free_slots() == 8 and pool.take(8) is not None
    with pytest.raises(ValueError):
        pool.take(0)


def test_gather_and_scatter_check_their_buffers():
    kv = torch.zeros(4, 2, 16, 8)
    px = PagedKV([kv], HostLane())
    with pytest.raises(ValueError, match="gather"):
        px.gather(0, [0, 1], torch.empty(px.page_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="outside"):
        px.scatter(0, torch.empty(px.page_bytes, dtype=torch.uint8), [(1, 0)])
    assert px.scatter(0, torch.empty(px.page_bytes, dtype=torch.uint8), []) is None


# ------------------------------------------------------------------ the worker's transfer-buffer path

BLOCK, LAYERS, NBLOCKS = 16, 3, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
HNC = (2, BLOCK, 32)     # heads, tokens, K|V elements


def lhbnc_layers(fill: bool) -> list[torch.Tensor]:
    """KV laid out LHBNC (heads outside blocks: a page is 2 runs), so the worker takes the transfer path."""
    H, N, C = HNC
    phys = torch.randn(LAYERS, H, NBLOCKS, N, C) if fill else torch.zeros(LAYERS, H, NBLOCKS, N, C)
    return [phys[li].permute(1, 0, 2, 3) for li in range(LAYERS)]


def make_worker(servers, kv, chunk, **extra) -> WorkerSide:
    cfg = parse_extra_config({"servers": servers, "chunk_tokens": chunk, "load_timeout_s": 2.0,
                              "save_timeout_s": 2.0, **extra}, "kv_both", BLOCK)
    w = WorkerSide(cfg, Client(config=cfg.client), 0, BLOCK, NAMES, Counters())
    w.register(dict(zip(NAMES, kv)))
    return w


def wait_saves(w: WorkerSide) -> None:
    deadline = time.monotonic() + 30
    while w.counters.snapshot()["save_jobs_done"] < w.counters.snapshot()["save_jobs"]:
        assert time.monotonic() < deadline, f"saves did not finish: {w.counters.snapshot()}"
        time.sleep(0.01)


def wait_leases_back(w: WorkerSide) -> None:
    """Until every transfer-buffer lease is back (the last put job's done-callback gives a step's back,
    just after ``save_jobs_done`` counted it)."""
    deadline = time.monotonic() + 30
    while w._pool.free_slots() != w._pool.n_slots:
        assert time.monotonic() < deadline, f"leases not back: {w._pool.free_slots()} of {w._pool.n_slots} free"
        time.sleep(0.01)


@pytest.mark.parametrize("chunk", [BLOCK, 2 * BLOCK])
@pytest.mark.parametrize("async_load", [False, True])
def test_worker_saves_and_loads_through_the_transfer_buffer(chunk, async_load):
    per = chunk // BLOCK
    with start_pool(2, capacity="16MiB") as pool:
        kv_a, kv_b = lhbnc_layers(True), lhbnc_layers(False)
        a = make_worker(pool.addresses, kv_a, chunk, transfer_buffer_mb=8)
        b = make_worker(pool.addresses, kv_b, chunk, transfer_buffer_mb=8)
        try:
            assert a._xfer is not None and a._xfer.layout.runs_per_page == HNC[0]
            assert a.counters.snapshot()["transfer_buffer_bytes"] == a._pool.nbytes == 8 << 20
            keys = [os.urandom(16) for _ in range(3)]
            src = [[3 + i * per + j for j in range(per)] for i in range(3)]
            spec_a = SaveSpec("r1", keys[:2], [None, keys[0]], src[:2])
            spec_b = SaveSpec("r2", keys[2:], [keys[1]], src[2:])
            a.gather_layer(NAMES[0], [spec_a, spec_b])          # the others are gathered at wait_for_save
            a.submit_saves([spec_a, spec_b])
            wait_saves(a)
            assert a.counters.snapshot()["save_chunks"] == 3, a.counters.snapshot()
            wait_leases_back(a)

            dst = [[NBLOCKS - 1 - (i * per + j) for j in range(per)] for i in range(3)]
            b.load([LoadSpec("r", keys, dst, skip_blocks=1, async_load=async_load)])
            if async_load:
                deadline = time.monotonic() + 30
                while not b.finished_loads():
                    assert time.monotonic() < deadline, "async load not reported"
            for name in NAMES:
                b.wait_layer(name)
            assert b.take_failed_block_ids() == set()
            assert b._pool.free_slots() == b._pool.n_slots
            pairs = [(s, d) for sb, db in zip(src, dst) for s, d in zip(sb, db)]
            for la, lb in zip(kv_a, kv_b):
                for s, d in pairs[1:]:
                    assert torch.equal(la[s], lb[d]), (s, d)
                assert torch.count_nonzero(lb[pairs[0][1]]) == 0       # skipped: computed locally
            assert b.counters.snapshot()["load_tokens"] == (3 * per - 1) * BLOCK
        finally:
            a.shutdown()
            b.shutdown()


def test_full_transfer_buffer_skips_saves_and_recomputes_loads():
    with start_pool(1, capacity="16MiB") as pool:
        kv = lhbnc_layers(True)
        page = HNC[0] * HNC[1] * HNC[2] * 4
        # room for 1 MiB / page objects: fewer than a 3-layer save of many chunks needs
        w = make_worker(pool.addresses, kv, BLOCK, transfer_buffer_mb=1)
        try:
            n_slots = w._pool.n_slots
            assert n_slots == (1 << 20) // page
            too_many = n_slots // LAYERS + 1
            keys = [os.urandom(16) for _ in range(too_many)]
            blocks = [[i % NBLOCKS] for i in range(too_many)]
            spec = SaveSpec("big", keys, [None, *keys[:-1]], blocks)
            w.gather_layer(NAMES[0], [spec])
            w.submit_saves([spec])
            snap = w.counters.snapshot()
            assert (snap["save_no_buffer_chunks"], snap["save_jobs"]) == (too_many, 0), snap

            # a small save fits, and while a held lease fills the buffer a load recomputes
            small = SaveSpec("small", keys[:1], [None], [[2]])
            w.submit_saves([small])
            wait_saves(w)
            assert w.counters.snapshot()["save_chunks"] == 1
            wait_leases_back(w)
            held = w._pool.take(n_slots)
            assert held is not None
            w.load([LoadSpec("r", keys[:1], [[5]])])
            assert w.take_failed_block_ids() == {5}
            assert w.counters.snapshot()["load_no_buffer_chunks"] == 1
            w._pool.give_back(held)
            w.load([LoadSpec("r", keys[:1], [[5]])])
            assert w.take_failed_block_ids() == set()
            assert all(torch.equal(layer[2], layer[5]) for layer in kv)
        finally:
            w.shutdown()


# ------------------------------------------------------------------ the worker's ordering calls, in order


class RecordedHostLane(HostLane):
    """The host lane (copies done when ``fn`` returns) with each ordering call recorded, so a test can
    check which mark the worker waits for where. Marks are numbered; nothing here stands in for CUDA."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._n = 0
        self._lock = threading.Lock()

    def _new(self, kind: str, *args) -> int:
        with self._lock:
            self._n += 1
            self.calls.append((kind, *args, self._n))
            return self._n

    def compute_mark(self) -> int:
        return self._new("mark")

    def launch(self, after, fn) -> int:
        fn()
        return self._new("launch", after)

    def compute_wait(self, mark) -> None:
        with self._lock:
            self.calls.append(("compute_wait", mark))

    def host_wait(self, mark) -> None:
        with self._lock:
            self.calls.append(("host_wait", mark))


def recorded(w: WorkerSide) -> RecordedHostLane:
    lane = RecordedHostLane()
    w._xfer.lane = lane
    return lane


def test_a_steps_saves_wait_for_the_forward_and_hold_their_blocks_until_gathered():
    with start_pool(1, capacity="16MiB") as pool:
        w = make_worker(pool.addresses, lhbnc_layers(True), BLOCK, transfer_buffer_mb=8)
        try:
            lane = recorded(w)
            keys = [os.urandom(16) for _ in range(2)]
            spec = SaveSpec("r", keys, [None, keys[0]], [[1], [2]])
            w.gather_layer(NAMES[0], [spec])            # save_kv_layer after layer 0's attention
            assert lane.calls == [("mark", 1), ("launch", 1, 2)]
            w.submit_saves([spec])                      # wait_for_save: layers 1, 2, then compute waits all
            # (the put thread may already be running: its calls can only follow these, queued after them)
            assert lane.calls[:9] == [("mark", 1), ("launch", 1, 2), ("mark", 3), ("launch", 3, 4), ("mark", 5),
                                      ("launch", 5, 6), ("compute_wait", 2), ("compute_wait", 4),
                                      ("compute_wait", 6)], lane.calls
            wait_saves(w)
            wait_leases_back(w)
            after = lane.calls[9:]
            # the put thread waited for every gather before putting, and again before the lease went back
            assert after == [("host_wait", 2), ("host_wait", 4), ("host_wait", 6)] * 2, after
            assert w.counters.snapshot()["save_chunks"] == 2
        finally:
            w.shutdown()


@pytest.mark.parametrize("async_load", [False, True])
def test_a_loads_attention_waits_for_its_layers_scatter(async_load):
    with start_pool(1, capacity="16MiB") as pool:
        a = make_worker(pool.addresses, lhbnc_layers(True), BLOCK, transfer_buffer_mb=8)
        b = make_worker(pool.addresses, lhbnc_layers(False), BLOCK, transfer_buffer_mb=8)
        try:
            keys = [os.urandom(16) for _ in range(2)]
            spec = SaveSpec("r", keys, [None, keys[0]], [[1], [2]])
            a.submit_saves([spec])
            wait_saves(a)
            lane = recorded(b)
            b.load([LoadSpec("r", keys, [[7], [8]], async_load=async_load)])
            if async_load:                              # waited on the loader thread, before it is reported
                deadline = time.monotonic() + 30
                while not b.finished_loads():
                    assert time.monotonic() < deadline, "async load not reported"
                assert lane.calls == [("mark", 1), ("launch", 1, 2), ("launch", 1, 3), ("launch", 1, 4),
                                      ("host_wait", 2), ("host_wait", 3), ("host_wait", 4)]
                return
            # every scatter after the compute stream's work so far (its blocks may have been read by it)
            assert lane.calls == [("mark", 1), ("launch", 1, 2), ("launch", 1, 3), ("launch", 1, 4)]
            b.wait_layer(NAMES[1])                      # layer 1's attention waits for layer 1's scatter only
            assert lane.calls[4:] == [("compute_wait", 3)]
            b.wait_layer(NAMES[0])
            b.wait_layer(NAMES[2])
            assert lane.calls[5:] == [("compute_wait", 2), ("compute_wait", 4)]
            assert b._pool.free_slots() < b._pool.n_slots     # held until after the forward
            assert b.take_failed_block_ids() == set()
            assert sorted(lane.calls[7:]) == [("host_wait", 2), ("host_wait", 3), ("host_wait", 4)]
            assert b._pool.free_slots() == b._pool.n_slots
        finally:
            a.shutdown()
            b.shutdown()
