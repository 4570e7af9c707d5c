"""Issue 13 item 1: loads received straight into the paged KV blocks, one pool object per
(chunk, layer), the chunk aligned with vLLM's block size by default.

The worker tests run on real pool servers without an engine (fast); the last test runs
real vLLM engines (float32, tiny Llama) with the connector's default chunk size.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import xxhash

from kvfabric import Client, KeyHasher, Namespace
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.config import ConnectorConfig, parse_extra_config
from kvfabric_vllm.keys import EngineKeys
from kvfabric_vllm.layout import LAYER_DOMAIN, chunk_major_layer_keys, layer_keys
from kvfabric_vllm.meta import LoadSpec, SaveSpec
from kvfabric_vllm.metrics import LOGGER_NAME, Counters
from kvfabric_vllm.scheduler import SchedulerSide
from kvfabric_vllm.worker import WorkerSide

from conftest import PARTS, PROMPT_TOKENS

BLOCK, NL, NBLOCKS = 32, 3, 16
PAGE = (2, BLOCK, 16)   # [heads, tokens, K|V channels], like the CPU backend's per-layer view
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NL)]


def make_worker(servers: list[str], dtype=torch.float32, **extra) -> tuple[WorkerSide, list[torch.Tensor]]:
    """A worker with the default chunk (no ``chunk_tokens``: one block per chunk)."""
    cfg = parse_extra_config({"servers": servers, "load_timeout_s": 5.0, "save_timeout_s": 5.0, **extra},
                             "kv_both", BLOCK)
    assert cfg.chunk_tokens == BLOCK
    w = WorkerSide(cfg, Client(config=cfg.client), 0, BLOCK, NAMES, Counters())
    kv = [torch.zeros((NBLOCKS, *PAGE), dtype=dtype) for _ in NAMES]
    w.register(dict(zip(NAMES, kv)))
    return w, kv


def engine_keys(cfg: ConnectorConfig) -> EngineKeys:
    """What the scheduler's lookup keys depend on, for these workers: ``NL`` layers, one object per
    layer (``make_worker``'s default ``HeadSplit``: whole pages)."""
    return EngineKeys(Namespace("test"), KeyHasher(), cfg.chunk_tokens, cfg.segment_chunks, NL)


def save(w: WorkerSide, keys: list[bytes], blocks: list[int]) -> None:
    spec = SaveSpec("r", keys, [None, *keys[:-1]], [[b] for b in blocks])
    w.gather_layer(NAMES[0], [spec])                 # the others are gathered by submit_saves
    w.submit_saves([spec])
    deadline = time.monotonic() + 30
    while w.counters.snapshot()["save_jobs_done"] < w.counters.snapshot()["save_jobs"]:
        assert time.monotonic() < deadline, "save did not finish"
        time.sleep(0.01)


def objects(addresses: list[str]) -> int:
    with Client(addresses) as c:
        return sum(s["objects"] for s in c.stats()["servers"].values())


def test_layer_keys_are_the_spec_hash_of_the_chunk_key():
    """Golden derivation: key(c, l) = H(chunk_key || domain || le_u32(l)) with the deployment's H."""
    h = KeyHasher()
    chunk = bytes(range(16))
    want = [xxhash.xxh3_128_digest(chunk + b"kvfabric-vllm-layer" + l.to_bytes(4, "little"), 0) for l in range(3)]
    assert LAYER_DOMAIN == b"kvfabric-vllm-layer"
    assert layer_keys(h, chunk, 3) == want
    assert len(set(want)) == 3 and chunk not in want
    assert chunk_major_layer_keys(h, [chunk, chunk[::-1]], 2) == [*layer_keys(h, chunk, 2),
                                                                 *layer_keys(h, chunk[::-1], 2)]
    # the secret and the algorithm carry over, as for the chain keys
    assert layer_keys(KeyHasher(secret=b"s"), chunk, 1) != want[:1]
    assert len(layer_keys(KeyHasher("sha256"), chunk, 1)[0]) == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_chunk_loads_straight_into_the_blocks(dtype):
    with start_pool(2, capacity="16MiB") as pool:
        a, kv_a = make_worker(pool.addresses, dtype)
        b, kv_b = make_worker(pool.addresses, dtype)
        try:
            for t in kv_a:
                t.copy_(torch.randn(t.shape).to(dtype))
            keys = [os.urandom(16) for _ in range(4)]
            src, dst = [3, 9, 12, 1], [0, 5, 6, 15]
            save(a, keys, src)
            assert a.counters.snapshot()["save_chunks"] == 4
            assert objects(pool.addresses) == 4 * NL          # one object per (chunk, layer)

            b.load([LoadSpec("r", keys, [[d] for d in dst])])
            assert b.take_failed_block_ids() == set()
            for la, lb in zip(kv_a, kv_b):
                for s, d in zip(src, dst):
                    assert torch.equal(la[s], lb[d])
                others = [i for i in range(NBLOCKS) if i not in dst]
                assert torch.count_nonzero(lb[others].float()) == 0   # nothing else written
            c = b.counters.snapshot()
            assert (c["load_chunks"], c["load_tokens"], c["load_failed_chunks"]) == (4, 4 * BLOCK, 0)
            assert b._load_buf is None                        # nothing staged: received in place
            # the layer tensors themselves are registered (native: READ_FIXED into the KV cache)
            cst = b.client.stats()["client"]
            assert cst["registered_buffers"]["bytes"] == sum(t.numel() * t.element_size() for t in kv_b)
            if cst["transports"] == ["native"]:
                assert cst["buffer_registrations"] >= 1 and cst["buffer_registration_failures"] == 0
        finally:
            a.shutdown()
            b.shutdown()


def test_a_chunk_with_one_bad_layer_object_is_recomputed_alone():
    with start_pool(1, capacity="16MiB") as pool:
        w, kv = make_worker(pool.addresses)
        try:
            for t in kv:
                t.fill_(1.0)
            keys = [os.urandom(16) for _ in range(3)]
            save(w, keys, [1, 2, 3])
            h = KeyHasher()
            with Client(pool.addresses) as c:
                assert c.delete([layer_keys(h, keys[1], NL)[2]]) == 1        # chunk 1 loses its last layer
                k20 = layer_keys(h, keys[2], NL)[0]
                assert c.delete([k20]) == 1
                assert c.put([k20], [b"x" * 100]).stored == 1                # chunk 2: a wrong-size layer 0
            for t in kv:
                t.zero_()
            w.load([LoadSpec("r", keys, [[4], [5], [6]])])
            assert w.take_failed_block_ids() == {5, 6}
            assert all(torch.all(t[4] == 1.0) for t in kv)
            assert w.counters.snapshot()["load_failed_chunks"] == 2
            assert w.counters.snapshot()["load_chunks"] == 1
        finally:
            w.shutdown()


def test_layerwise_load_is_exact_and_reports_failed_chunks_after_the_forward():
    """``load_layerwise`` (sync loads): one get per layer; waiting for layer l returns once
    layer l is in; the failed chunks are known when vLLM asks after the forward."""
    with start_pool(2, capacity="16MiB") as pool:
        a, kv_a = make_worker(pool.addresses)
        b, kv_b = make_worker(pool.addresses, load_async=False, load_layerwise=True)
        try:
            for t in kv_a:
                t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(3)]
            save(a, keys, [2, 4, 6])
            missing = os.urandom(16)
            b.load([LoadSpec("r", [*keys, missing], [[1], [3], [5], [7]])])
            for li, name in enumerate(NAMES):
                b.wait_layer(name)
                assert torch.equal(kv_b[li][1], kv_a[li][2]) and torch.equal(kv_b[li][5], kv_a[li][6])
            assert b.take_failed_block_ids() == {7}
            c = b.counters.snapshot()
            assert (c["load_chunks"], c["load_failed_chunks"], c["load_errors"]) == (3, 1, 0)
            assert b.take_failed_block_ids() == set()
        finally:
            a.shutdown()
            b.shutdown()


def test_lookup_counts_only_chunks_held_in_every_layer():
    with start_pool(2, capacity="16MiB") as pool:
        w, kv = make_worker(pool.addresses)
        cfg = w.cfg
        sched = SchedulerSide(cfg, Client(config=cfg.client), engine_keys(cfg), BLOCK, Counters(), lambda: None)
        try:
            keys = [os.urandom(16) for _ in range(4)]
            save(w, keys, [1, 2, 3, 4])
            assert sched._lookup_all_parts(keys, 0).count == 4
            with Client(pool.addresses) as c:
                assert c.delete([layer_keys(KeyHasher(), keys[2], NL)[1]]) == 1
            assert sched._lookup_all_parts(keys, 0).count == 2
        finally:
            w.shutdown()
            sched.shutdown()


class _Lines(logging.Handler):
    """The connector's log lines, kept."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("offer_shm", [True, False])
def test_loads_from_a_server_on_this_host_use_shm_when_offered(offer_shm):
    """Issue 13 figures: over loopback ``native``/``tcp`` a load crosses the network stack; a
    server on this host that offers ``shm`` gets an ``auto`` client's loads as one copy out of its
    arena, exact and checksum-verified. The worker logs the transport once, and when a same-host
    server does not offer shm, how to get it."""
    offered = "tcp,native,shm" if offer_shm else "tcp,native"
    logger = logging.getLogger(LOGGER_NAME)
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    with start_pool(1, capacity="16MiB", extra_args=["--transports", offered]) as pool:
        a, kv_a = make_worker(pool.addresses)
        b, kv_b = make_worker(pool.addresses)
        try:
            for t in kv_a:
                t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(3)]
            save(a, keys, [2, 4, 6])
            for dst in ([1, 3, 5], [7, 8, 9]):     # twice: the transport is logged once
                b.load([LoadSpec("r", keys, [[d] for d in dst])])
                assert b.take_failed_block_ids() == set()
                for la, lb in zip(kv_a, kv_b):
                    assert all(torch.equal(la[s], lb[d]) for s, d in zip([2, 4, 6], dst))
            (addr,) = pool.addresses
            used = b.client.transports[addr]
            assert (used == "shm") == offer_shm, used
            cst = b.client.stats()["client"]
            assert b.cfg.client.verify_checksums and cst["checksum_failures"] == 0
            assert [ln for ln in lines.lines if ln.startswith("kvfabric: loads use")] == [
                f"kvfabric: loads use {used} ({addr})"]
            hints = [ln for ln in lines.lines if "do not offer shm" in ln]
            assert hints == ([] if offer_shm else [
                f"kvfabric: pool server(s) {addr} are on this host but do not offer shm: start them with "
                "`--transports tcp,native,shm` for faster loads (transport auto then picks shm)"])
        finally:
            logger.removeHandler(lines)
            logger.setLevel(level)
            a.shutdown()
            b.shutdown()


def test_engines_with_the_default_chunk_load_in_place_token_identical(run_engine, cold):
    """Real vLLM: no ``chunk_tokens`` given, so the chunk is vLLM's CPU block (128): the pool
    hit leaves only the last partial block (< 128 tokens) to compute, the objects are one
    KV page each and loads receive them in place; output identical to cold."""
    default_chunk = ["--chunk-tokens", "0"]
    with start_pool(2, capacity="64MiB") as pool:
        a = run_engine(["single"], pool.addresses, args=default_chunk)
        assert a["cached"] == [0] and a["outputs"] == [cold["single"]]
        assert a["counters"]["save_chunks"] == PROMPT_TOKENS // 128
        assert objects(pool.addresses) == PROMPT_TOKENS // 128 * PARTS
        b = run_engine(["single"], pool.addresses, args=default_chunk)
        assert b["outputs"] == [cold["single"]]
        assert b["cached"][0] == (PROMPT_TOKENS - 1) // 128 * 128 > PROMPT_TOKENS - 128, b["cached"]
        assert b["counters"]["load_chunks"] == (PROMPT_TOKENS - 1) // 128
        assert b["counters"]["load_failed_chunks"] == 0 and b["counters"]["load_errors"] == 0
        assert "chunk 128 tokens" in b["stdout"] + b["log"]
        assert "loads straight into the KV blocks" in b["stdout"] + b["log"]
        # sync loads, layer by layer: same tokens
        c = run_engine(["single"], pool.addresses,
                       args=[*default_chunk, "--extra", '{"load_async": false, "load_layerwise": true}'])
        assert c["outputs"] == [cold["single"]]
        assert c["cached"][0] == b["cached"][0] and c["counters"]["async_loads"] == 0
        assert c["counters"]["load_chunks"] == (PROMPT_TOKENS - 1) // 128
