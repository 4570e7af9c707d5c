"""The TP-independent layout (layout 3, issue 23 part 4) through the connector's worker halves and
real pool servers, without an engine: the KV tensors of TP=1 and TP=2 ranks hold the same model
heads, the ranks save and load their own heads' objects, and the pool's groups stay whole.

Every case runs with the tensors of vLLM's CPU layout (``LBHNC``: a head is one run of a page,
loads in place) and of a head-inner layout (``LBNHC``, FlashAttention's; on the CPU the worker's
transfer path), and with chunks of one and of two blocks (the staging path).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvfabric import Client, KeyHasher, Namespace
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.keys import EngineKeys, PromptKeys
from kvfabric_vllm.layout import HeadSplit, chunk_object_keys, chunk_placement
from kvfabric_vllm.meta import LoadSpec, SaveSpec
from kvfabric_vllm.metrics import Counters
from kvfabric_vllm.worker import WorkerSide

BLOCK, NL, NBLOCKS, HEADS, C = 16, 3, 24, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NL)]
CHUNKS = 3


def _kv(layout: str, heads: int) -> list[torch.Tensor]:
    """Zeroed per-layer KV tensors as vLLM hands them over: the logical view [blocks, heads, tokens, C]."""
    if layout == "LBHNC":
        return [torch.zeros((NBLOCKS, heads, BLOCK, C)) for _ in NAMES]
    return [torch.zeros((NBLOCKS, BLOCK, heads, C)).permute(0, 2, 1, 3) for _ in NAMES]   # head inner


def _worker(servers: list[str], split: HeadSplit, rank: int, layout: str, per_chunk: int):
    cfg = parse_extra_config({"servers": servers, "chunk_tokens": BLOCK * per_chunk, "load_timeout_s": 60.0,
                              "save_timeout_s": 60.0, "timeout_s": 60.0, "connect_timeout_s": 60.0,
                              "segment_tokens": 2 * BLOCK * per_chunk}, "kv_both", BLOCK)
    w = WorkerSide(cfg, Client(config=cfg.client), rank, BLOCK, NAMES, Counters(), heads=split)
    kv = _kv(layout, len(split.heads(rank)))
    w.register(dict(zip(NAMES, kv)))
    return w, kv


def _engine(w: WorkerSide) -> EngineKeys:
    return EngineKeys(Namespace("tp-test"), KeyHasher(), w.cfg.chunk_tokens, w.cfg.segment_chunks, NL, w.heads)


def _blocks(first: int, per_chunk: int) -> list[list[int]]:
    return [[first + c * per_chunk + j for j in range(per_chunk)] for c in range(CHUNKS)]


def _save(w: WorkerSide, keys: list[bytes], blocks: list[list[int]]) -> None:
    spec = SaveSpec("r", keys, [None, *keys[:-1]], blocks, placement=chunk_placement(keys, w.cfg.segment_chunks))
    w.gather_layer(NAMES[0], [spec])               # the others are gathered by submit_saves
    w.submit_saves([spec])
    deadline = time.monotonic() + 60
    while w.counters.snapshot()["save_jobs_done"] < w.counters.snapshot()["save_jobs"]:
        assert time.monotonic() < deadline, f"save did not finish: {w.counters.snapshot()}"
        time.sleep(0.01)


def _load(w: WorkerSide, keys: list[bytes], blocks: list[list[int]]) -> set[int]:
    w.load([LoadSpec("r", keys, blocks, placement=chunk_placement(keys, w.cfg.segment_chunks))])
    for name in NAMES:
        w.wait_layer(name)
    return w.take_failed_block_ids()


def _groups(addresses: list[str]) -> dict[str, int]:
    with Client(addresses) as c:
        servers = c.stats()["servers"].values()
    return {k: sum(s[k] for s in servers) for k in ("objects", "groups", "group_objects", "groups_incomplete")}


def _lookup(w: WorkerSide, keys: list[bytes]) -> int:
    """Leading chunks the pool holds whole for an engine of ``w``'s model (any TP size): the scheduler's lookup."""
    e = _engine(w)
    objs, place, groups = PromptKeys(keys, chunk_placement(keys, w.cfg.segment_chunks)).objects(e)
    return w.client.lookup(objs, placement=place, groups=groups, timeout_s=60.0) // len(e.parts())


@pytest.mark.parametrize("layout,per_chunk", [("LBHNC", 1), ("LBHNC", 2), ("LBNHC", 1)])
def test_tp2_ranks_and_a_tp1_worker_load_each_others_heads(layout, per_chunk):
    with start_pool(2, capacity="16MiB") as pool:
        one, kv1 = _worker(pool.addresses, HeadSplit.for_model(HEADS, 1), 0, layout, per_chunk)
        ranks = [_worker(pool.addresses, HeadSplit.for_model(HEADS, 2), r, layout, per_chunk) for r in range(2)]
        try:
            src, dst = _blocks(1, per_chunk), _blocks(12, per_chunk)
            # TP=2 saves: each rank its head's objects, one group per rank and chunk
            for r, (w, kv) in enumerate(ranks):
                for t in kv:
                    t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(CHUNKS)]
            _save(ranks[0][0], keys, src)
            assert _lookup(one, keys) == 0                  # rank 1's heads are missing: no chunk is whole
            _save(ranks[1][0], keys, src)
            assert _lookup(one, keys) == CHUNKS
            g = _groups(pool.addresses)
            assert g == {"objects": CHUNKS * NL * HEADS, "groups": CHUNKS * 2, "group_objects": CHUNKS * NL * HEADS,
                         "groups_incomplete": 0}, g
            # ... which a TP=1 worker loads: both heads, bytes as the ranks held them
            assert _load(one, keys, dst) == set()
            for li in range(NL):
                for c in range(CHUNKS):
                    for s, d in zip(src[c], dst[c]):
                        for r, (_, kv) in enumerate(ranks):
                            assert torch.equal(kv1[li][d, r], kv[li][s, 0]), (li, c, r)
            # TP=1 saves (one group of both heads per chunk); each TP=2 rank loads its own head
            for t in kv1:
                t.copy_(torch.randn_like(t))
            keys2 = [os.urandom(16) for _ in range(CHUNKS)]
            _save(one, keys2, src)
            g = _groups(pool.addresses)
            assert g["groups"] == CHUNKS * 3 and g["groups_incomplete"] == 0 and g["group_objects"] == g["objects"], g
            for r, (w, kv) in enumerate(ranks):
                assert _load(w, keys2, dst) == set()
                assert w.counters.snapshot()["load_chunks"] == CHUNKS
                for li in range(NL):
                    for c in range(CHUNKS):
                        for s, d in zip(src[c], dst[c]):
                            assert torch.equal(kv[li][d, 0], kv1[li][s, r]), (li, c, r)
        finally:
            one.shutdown()
            for w, _ in ranks:
                w.shutdown()


def test_one_ranks_part_dropped_makes_the_chunk_a_miss_for_every_tp_size():
    """A rank's part of a chunk is its own server group: losing one object drops that part whole
    (the other rank's part stays), and the chunk is then missing for TP=1 and TP=2 lookups alike;
    the loads that try it anyway fail only that chunk (recomputed)."""
    with start_pool(1, capacity="16MiB") as pool:
        ranks = [_worker(pool.addresses, HeadSplit.for_model(HEADS, 2), r, "LBHNC", 1) for r in range(2)]
        one, _ = _worker(pool.addresses, HeadSplit.for_model(HEADS, 1), 0, "LBHNC", 1)
        try:
            keys = [os.urandom(16) for _ in range(CHUNKS)]
            for w, kv in ranks:
                for t in kv:
                    t.copy_(torch.randn_like(t))
                _save(w, keys, _blocks(1, 1))
            rank1_objs = chunk_object_keys(KeyHasher(), keys[1:2], ranks[1][0].parts)
            with Client(pool.addresses) as c:
                place = chunk_placement(keys, 2)[1]
                assert c.delete(rank1_objs[:1], placement=[place]) == NL   # its group: every layer, head 1
                assert c.exists(chunk_object_keys(KeyHasher(), keys[1:2], ranks[0][0].parts)) == [True] * NL
            assert _lookup(one, keys) == _lookup(ranks[0][0], keys) == 1
            g = _groups(pool.addresses)
            assert g["groups"] == CHUNKS * 2 - 1 and g["groups_incomplete"] == 0, g
            assert _load(one, keys, _blocks(12, 1)) == {13}              # chunk 1 recomputed, 0 and 2 loaded
        finally:
            one.shutdown()
            for w, _ in ranks:
                w.shutdown()


def test_replicated_heads_are_saved_once_and_loaded_by_every_rank():
    """One KV head, TP=2 (vLLM replicates it: both ranks hold the same head): rank 0 saves it,
    rank 1 saves nothing, both load it, and the objects are the TP=1 engine's."""
    with start_pool(1, capacity="16MiB") as pool:
        split = HeadSplit.for_model(1, 2)
        ranks = [_worker(pool.addresses, split, r, "LBHNC", 1) for r in range(2)]
        one, kv1 = _worker(pool.addresses, HeadSplit.for_model(1, 1), 0, "LBHNC", 1)
        try:
            for w, kv in ranks:
                for t in kv:
                    t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(CHUNKS)]
            for w, _ in ranks:
                _save(w, keys, _blocks(1, 1))
            assert ranks[1][0].counters.snapshot().get("save_jobs", 0) == 0
            assert ranks[0][0].counters.snapshot()["save_chunks"] == CHUNKS
            assert _groups(pool.addresses)["objects"] == CHUNKS * NL
            assert _load(one, keys, _blocks(12, 1)) == set()
            assert _load(ranks[1][0], keys, _blocks(12, 1)) == set()
            for li in range(NL):
                assert torch.equal(kv1[li][12:15], ranks[0][1][li][1:4])
                assert torch.equal(ranks[1][1][li][12:15], ranks[0][1][li][1:4])
        finally:
            one.shutdown()
            for w, _ in ranks:
                w.shutdown()


def test_two_heads_per_object_between_tp1_and_tp2():
    """``kv_heads_per_object: 2`` on a 4-head model: a TP=2 rank's 2 heads are one object per layer,
    a TP=1 worker's 4 heads two; each loads what the other saved."""
    g = 2
    with start_pool(1, capacity="16MiB") as pool:
        one, kv1 = _worker(pool.addresses, HeadSplit.for_model(4, 1, per_object=g), 0, "LBHNC", 1)
        ranks = [_worker(pool.addresses, HeadSplit.for_model(4, 2, per_object=g), r, "LBHNC", 1) for r in range(2)]
        try:
            assert len(one.parts) == 2 * NL and all(len(w.parts) == NL for w, _ in ranks)
            for t in kv1:
                t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(CHUNKS)]
            _save(one, keys, _blocks(1, 1))
            assert _groups(pool.addresses)["objects"] == CHUNKS * NL * 2
            for r, (w, kv) in enumerate(ranks):
                assert _load(w, keys, _blocks(12, 1)) == set()
                for li in range(NL):
                    assert torch.equal(kv[li][12:15], kv1[li][1:4, 2 * r:2 * r + 2]), (r, li)
        finally:
            one.shutdown()
            for w, _ in ranks:
                w.shutdown()
