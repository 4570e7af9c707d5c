"""The worker's copies between paged KV blocks and pool chunks, and its failure handling,
on real pool servers without an engine (fast; torch from the vLLM virtualenv)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from kvfabric import ConfigError
from kvfabric import Client, KeyHasher
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.config import parse_extra_config, weights_fingerprint
from kvfabric_vllm.layout import chunk_major_layer_keys
from kvfabric_vllm.meta import LoadSpec, SaveSpec
from kvfabric_vllm.metrics import Counters
from kvfabric_vllm.worker import WorkerSide

BLOCK, CHUNK, LAYERS, NBLOCKS = 32, 64, 3, 16
PAGE = (2, BLOCK, 16)   # [heads, tokens, K|V channels], like the CPU backend's per-layer view
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def make_worker(servers: list[str], client: Client | None = None, **extra) -> tuple[WorkerSide, list[torch.Tensor]]:
    cfg = parse_extra_config({"servers": servers, "chunk_tokens": CHUNK, "load_timeout_s": 2.0,
                              "save_timeout_s": 2.0, **extra}, "kv_both", BLOCK)
    w = WorkerSide(cfg, client if client is not None else Client(config=cfg.client), 0, BLOCK, NAMES, Counters())
    kv = [torch.zeros((NBLOCKS, *PAGE)) for _ in NAMES]
    w.register(dict(zip(NAMES, kv)))
    return w, kv


def save(w: WorkerSide, keys: list[bytes], block_ids: list[list[int]]) -> None:
    spec = SaveSpec("r", keys, [None, *keys[:-1]], block_ids)
    for name in NAMES[:2]:                  # the last layer is gathered by submit_saves
        w.gather_layer(name, [spec])
    w.submit_saves([spec])
    deadline = time.monotonic() + 10
    while w.counters.snapshot()["save_jobs_done"] < w.counters.snapshot()["save_jobs"]:
        assert time.monotonic() < deadline, "save did not finish"
        time.sleep(0.01)


def test_save_then_load_into_other_blocks_is_exact():
    with start_pool(2, capacity="16MiB") as pool:
        a, kv_a = make_worker(pool.addresses)
        b, kv_b = make_worker(pool.addresses)
        try:
            for t in kv_a:
                t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(3)]
            src_blocks = [[3, 9], [4, 1], [12, 7]]
            save(a, keys, src_blocks)
            assert a.counters.snapshot()["save_chunks"] == 3

            dst_blocks = [[0, 2], [5, 6], [8, 10]]
            b.load([LoadSpec("r", keys, dst_blocks, skip_blocks=1)])
            assert b.take_failed_block_ids() == set()
            for la, lb in zip(kv_a, kv_b):
                pairs = [(s, d) for sb, db in zip(src_blocks, dst_blocks) for s, d in zip(sb, db)]
                for s, d in pairs[1:]:      # first block skipped: computed locally
                    assert torch.equal(la[s], lb[d])
                assert torch.count_nonzero(lb[dst_blocks[0][0]]) == 0
            assert b.counters.snapshot()["load_tokens"] == 5 * BLOCK
            # the reused load staging buffer is registered; native connections receive into it with READ_FIXED
            cst = b.client.stats()["client"]
            assert cst["registered_buffers"]["bytes"] == 3 * b.chunk_bytes
            if cst["transports"] == ["native"]:
                assert cst["buffer_registrations"] >= 1 and cst["buffer_registration_failures"] == 0
        finally:
            a.shutdown()
            b.shutdown()


def test_save_staging_is_reused_and_each_save_keeps_its_own_bytes():
    """Save staging buffers come back when their put is done (before it counts as done: the counts below do not
    depend on how fast the putter's thread ran) and the next save gathers into them (no fresh,
    page-faulted allocation per save), each save's objects still hold exactly its own blocks' bytes, and the
    idle buffers kept stay within their bound (a quarter of max_pending_save_mb)."""
    with start_pool(2, capacity="16MiB") as pool:
        a, kv_a = make_worker(pool.addresses, max_pending_save_mb=1)
        b, kv_b = make_worker(pool.addresses)
        try:
            keep = max(1, (1 << 20) // 4 // a.chunk_bytes)
            saved = []
            for round_ in range(3):
                for t in kv_a:
                    t.copy_(torch.randn_like(t))
                keys = [os.urandom(16) for _ in range(2)]
                blocks = [[2 * round_, 2 * round_ + 1], [15 - round_, 8]]
                save(a, keys, blocks)
                saved.append((keys, blocks, [t.clone() for t in kv_a]))
                bufs = a._chunk_bufs
                assert bufs is not None and len(bufs._idle) == min(2, keep), (round_, len(bufs._idle), keep)
                if round_ == 0:
                    first = {t.data_ptr() for t in bufs._idle}
                else:   # the same buffers again: taken by this save, given back when its put was done
                    assert {t.data_ptr() for t in bufs._idle} == first
            assert a.counters.snapshot()["save_chunks"] == 6
            extra = bufs.take(keep + 3)    # more than it keeps: the surplus is freed, not held
            assert len(bufs._idle) == 0 and {t.data_ptr() for t in extra} >= first
            bufs.give(extra)
            assert len(bufs._idle) == keep
            for keys, blocks, snap in saved:
                b.load([LoadSpec("r", keys, [[0, 1], [3, 4]])])
                assert b.take_failed_block_ids() == set()
                for src, dst in zip(snap, kv_b):
                    for sb, db in zip(blocks, [[0, 1], [3, 4]]):
                        for s_, d_ in zip(sb, db):
                            assert torch.equal(src[s_], dst[d_]), (keys[0].hex(), s_, d_)
        finally:
            a.shutdown()
            b.shutdown()


def test_missing_or_malformed_chunks_are_reported_not_used():
    with start_pool(1, capacity="16MiB") as pool:
        w, kv = make_worker(pool.addresses)
        try:
            good, short = os.urandom(16), os.urandom(16)
            for t in kv:
                t.fill_(1.0)
            save(w, [good], [[1, 2]])
            with Client(pool.addresses) as c:
                c.put([short], [b"x" * 100])          # right key length, wrong size
            for t in kv:
                t.zero_()
            w.load([LoadSpec("r", [good, short, os.urandom(16)], [[3, 4], [5, 6], [7, 8]])])
            assert w.take_failed_block_ids() == {5, 6, 7, 8}
            assert all(torch.all(t[3] == 1.0) and torch.count_nonzero(t[5]) == 0 for t in kv)
            assert w.counters.snapshot()["load_failed_chunks"] == 2
            assert w.take_failed_block_ids() == set()    # reported once
        finally:
            w.shutdown()


def test_dead_pool_degrades_without_raising():
    with start_pool(1, capacity="16MiB") as pool:
        w, kv = make_worker(pool.addresses)
        pool[0].kill()
        try:
            keys = [os.urandom(16), os.urandom(16)]
            w.load([LoadSpec("r", keys, [[1, 2], [3, 4]], skip_blocks=1)])
            assert w.take_failed_block_ids() == {2, 3, 4}
            save(w, keys, [[1, 2], [3, 4]])
            c = w.counters.snapshot()
            assert c["save_dropped_chunks"] == 2 and c["save_errors"] == 0
        finally:
            w.shutdown()


def test_no_client_means_every_load_fails_cleanly():
    w = WorkerSide(parse_extra_config({"servers": ["127.0.0.1:9"], "chunk_tokens": CHUNK}, "kv_both", BLOCK),
                   None, 0, BLOCK, NAMES, Counters())
    w.register({n: torch.zeros((NBLOCKS, *PAGE)) for n in NAMES})
    w.load([LoadSpec("r", [os.urandom(16)], [[1, 2]])])
    assert w.take_failed_block_ids() == {1, 2}
    assert w.counters.snapshot()["load_errors"] == 1


@pytest.mark.parametrize("extra, message", [
    ({}, "servers is required"),
    ({"servers": ["127.0.0.1:1"], "chunk_tokens": 48}, "multiple of vLLM's block size"),
    ({"servers": ["127.0.0.1:1"], "chunk_token": 256}, "unknown kv_connector_extra_config key"),
    ({"servers": ["nohost"]}, "host:port"),
    ({"servers": ["127.0.0.1:1"], "lookup_timeout_ms": 0}, "lookup_timeout_ms"),
    ({"servers": ["127.0.0.1:1"], "save": "yes"}, "save must be true or false"),
    ({"servers": ["127.0.0.1:1"], "load_async": 1}, "load_async must be true or false"),
    ({"servers": ["127.0.0.1:1"], "shutdown_drain_s": -1}, "shutdown_drain_s"),
])
def test_bad_extra_config_is_a_clear_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_extra_config(extra, "kv_both", BLOCK)


def test_roles_choose_load_and_save():
    cfg = parse_extra_config({"servers": "127.0.0.1:1,127.0.0.1:2"}, "kv_consumer", 128)
    # the default chunk is vLLM's block size (here 128): at most one partial block recomputed
    assert (cfg.load, cfg.save, cfg.chunk_tokens, cfg.client.servers) == (True, False, 128,
                                                                          ("127.0.0.1:1", "127.0.0.1:2"))
    assert parse_extra_config({"servers": ["127.0.0.1:1"]}, "kv_producer", 128).load is False
    with pytest.raises(ConfigError, match="kv_role"):
        parse_extra_config({"servers": ["127.0.0.1:1"]}, None, 128)


def _wait_loads(w: WorkerSide, n: int) -> set[str]:
    done: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < n:
        assert time.monotonic() < deadline, "async load never reported"
        done |= w.finished_loads()
    return done


def test_async_load_leaves_the_step_free_while_the_pool_stalls():
    """Defect: loads ran inside the step, so a stalled pool held the whole batch's step for
    up to load_timeout_s. Async loads are queued; the step's get_finished waits at most
    load_poll_ms and reports the load once the pool answers (here: after SIGCONT)."""
    with start_pool(1, capacity="16MiB") as pool:
        w, kv = make_worker(pool.addresses, load_timeout_s=120.0)
        try:
            for t in kv:
                t.fill_(1.0)
            keys = [os.urandom(16), os.urandom(16)]
            save(w, keys, [[1, 2], [3, 4]])
            with pool[0].paused():
                w.load([LoadSpec("r", keys, [[5, 6], [7, 8]], async_load=True)])   # queued, not run
                assert w.finished_loads() == set()   # the pool is stopped: nothing done, the step goes on
                assert w.take_failed_block_ids() == set()
            assert _wait_loads(w, 1) == {"r"}
            assert w.take_failed_block_ids() == set()
            assert all(torch.all(t[5] == 1.0) and torch.all(t[8] == 1.0) for t in kv)
            assert w.counters.snapshot()["async_loads"] == 1
            # a failed async load: its blocks are reported with (never after) the request
            w.load([LoadSpec("m", [os.urandom(16)], [[9, 10]], async_load=True)])
            assert _wait_loads(w, 1) == {"m"}
            assert w.take_failed_block_ids() == {9, 10}
        finally:
            w.shutdown()


def test_shutdown_drains_saves_within_its_bound():
    """Defect: pending saves were lost on SIGTERM (vLLM kills the engine core 5 s after
    it, and shutdown waited for every queued save without a bound). Now shutdown drains
    for at most shutdown_drain_s and counts what it abandons; with a pool that answers,
    a shutdown right after the step drains every save."""
    with start_pool(1, capacity="16MiB") as pool:
        keys = [os.urandom(16), os.urandom(16)]
        w, kv = make_worker(pool.addresses, shutdown_drain_s=60.0)
        spec = SaveSpec("r", keys, [None, keys[0]], [[1, 2], [3, 4]])
        w.submit_saves([spec])
        w.shutdown()                      # at once: the queued put still lands
        with Client(pool.addresses) as c:
            assert all(c.exists(chunk_major_layer_keys(KeyHasher(), keys, LAYERS)))   # every layer object
        assert w.counters.snapshot()["save_abandoned_jobs"] == 0

        stalled, _ = make_worker(pool.addresses, shutdown_drain_s=0.5, save_timeout_s=120.0)
        with pool[0].paused():
            stalled.submit_saves([SaveSpec("s", [os.urandom(16)], [None], [[5, 6]])])
            stalled.shutdown()            # returns after the drain bound, not the 120 s put deadline
        assert stalled.counters.snapshot()["save_abandoned_jobs"] == 1


def test_weights_fingerprint_follows_the_weights_not_the_path(tmp_path):
    """Defect: the namespace bound the model path string, so weights replaced under the
    same path loaded the old KV. The fingerprint binds config + sampled weight bytes."""
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 256}')
    (a / "model.safetensors").write_bytes(os.urandom(3 << 20))
    fp = weights_fingerprint(str(a))
    assert len(fp) == 32
    b = tmp_path / "b"
    shutil.copytree(a, b)
    os.utime(b / "model.safetensors", (1, 1))
    assert weights_fingerprint(str(b)) == fp              # other path, other mtime: same weights
    (a / "model.safetensors").write_bytes(os.urandom(3 << 20))
    assert weights_fingerprint(str(a)) != fp              # same path, same size, other weights
    assert weights_fingerprint("org/hub-model-id") == ""  # not a directory: the revision is bound
