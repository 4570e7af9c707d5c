"""The L2 adapter for LMCache's multiprocess server, loaded the way the MP server loads it (--l2-adapter JSON)."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.platform.event_notifier import consume_fd

from kvfabric_lmcache.l2_adapter import KVFabricL2Adapter

pytestmark = pytest.mark.lmcache

SHAPE = torch.Size([2, 4, 256, 128])  # one 256-token chunk, 4 layers, fp16: 512 KiB


def adapter_for(url: str, **params) -> KVFabricL2Adapter:
    spec = {"type": "plugin", "module_path": "kvfabric_lmcache.l2_adapter", "class_name": "KVFabricL2Adapter",
            "adapter_params": {"url": url, **params}}
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    adapter = create_l2_adapter_from_registry(cfg.adapters[0])
    assert isinstance(adapter, KVFabricL2Adapter)
    return adapter


def wait_result(fd: int, query, task_id, timeout_s: float = 20.0):
    """Wait on the adapter's event fd (as LMCache's controllers do), then query; fails after the deadline."""
    end = time.monotonic() + timeout_s
    while True:
        res = query(task_id)
        if res is not None:
            return res
        left = end - time.monotonic()
        if left <= 0:
            pytest.fail("L2 task did not complete")
        if select.select([fd], [], [], min(left, 0.2))[0]:
            consume_fd(fd)


def store(adapter, keys, objs):
    tid = adapter.submit_store_task(keys, objs)

    def pop(t):
        return adapter.pop_completed_store_tasks().get(t)

    return wait_result(adapter.get_store_event_fd(), pop, tid)


def bits(bitmap, n: int) -> list[int]:
    return [int(bitmap.test(i)) for i in range(n)]


@pytest.fixture
def allocator():
    a = MixedMemoryAllocator(32 << 20)
    yield a
    a.close()


def new_obj(allocator, shape=SHAPE, fill: int | None = None):
    obj = allocator.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
    if fill is not None:
        g = torch.Generator().manual_seed(fill)
        obj.tensor.copy_(torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.float16))
    else:
        obj.tensor.zero_()
    return obj


def okey(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "little"), model_name="org/model", kv_rank=0, cache_salt=salt)


def test_store_lookup_load_round_trip(pool, allocator) -> None:
    url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=10&connect_timeout_s=5"
    adapter = adapter_for(url, lease_ms=2000)
    objs, loaded = [], []
    try:
        keys = [okey(i) for i in range(3)]
        objs = [new_obj(allocator, fill=i) for i in range(3)]
        res = store(adapter, keys, objs)
        assert res.is_successful() and res.bytes_transferred() == 3 * objs[0].get_size()
        assert adapter.get_usage().total_bytes_used == 3 * objs[0].get_size()

        probe = [keys[0], okey(99), keys[2], okey(0, salt="other-user")]
        tid = adapter.submit_lookup_and_lock_task(probe, {})
        assert bits(wait_result(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, tid), 4) == [1, 0, 1, 0]
        adapter.submit_unlock(probe)

        loaded = [new_obj(allocator) for _ in range(3)] + [new_obj(allocator, shape=torch.Size([2, 4, 128, 128]))]
        tid = adapter.submit_load_task([keys[0], okey(99), keys[2], keys[1]], loaded)
        got = wait_result(adapter.get_load_event_fd(), adapter.query_load_result, tid)
        assert bits(got, 4) == [1, 0, 1, 0]  # the last buffer has the wrong shape: a miss, not a partial copy
        assert torch.equal(loaded[0].tensor.view(torch.int16), objs[0].tensor.view(torch.int16))
        assert torch.equal(loaded[2].tensor.view(torch.int16), objs[2].tensor.view(torch.int16))
        assert torch.count_nonzero(loaded[1].tensor.view(torch.int16)) == 0
        assert torch.count_nonzero(loaded[3].tensor.view(torch.int16)) == 0
        assert adapter.query_load_result(tid) is None  # a result is handed out once
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()
        for o in objs + loaded:
            o.ref_count_down()


def test_store_copies_objects_before_returning_reuse_after_ttl_keeps_bytes(pool, allocator) -> None:
    """Issue 13: submit_store_task encoded the objects inside the queued job. LMCache's
    L1 read lock expires after --l1-read-ttl-seconds and the memory is reused, so behind
    a slow (here: frozen) pool keys were stored with other keys' bytes. The objects'
    memory is overwritten right after submit returns, while the pool is stopped (one
    I/O thread, busy with an earlier store behind the frozen pool, so the task under
    test cannot have started); the stored bytes must be the ones submitted."""
    url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=60&connect_timeout_s=5"
    adapter = adapter_for(url, io_threads=1)
    objs, loaded = [], []
    try:
        keys = [okey(200 + i) for i in range(3)]
        objs = [new_obj(allocator, fill=300 + i) for i in range(4)]
        ref = [o.tensor.view(torch.int16).clone() for o in objs[:3]]
        with contextlib.ExitStack() as stopped:
            for s in pool:
                stopped.enter_context(s.paused())
            first = adapter.submit_store_task([okey(210)], objs[3:])   # holds the one I/O thread
            tid = adapter.submit_store_task(keys, objs[:3])
            for o in objs[:3]:                   # the TTL ran out: L1 reuses the memory
                o.tensor.view(torch.int16).fill_(7)
        done: dict = {}

        def popped(t):
            done.update(adapter.pop_completed_store_tasks())
            return done.get(t)

        assert wait_result(adapter.get_store_event_fd(), popped, first, 90).is_successful()
        assert wait_result(adapter.get_store_event_fd(), popped, tid, 90).is_successful()
        loaded = [new_obj(allocator) for _ in range(3)]
        tid = adapter.submit_load_task(keys, loaded)
        assert bits(wait_result(adapter.get_load_event_fd(), adapter.query_load_result, tid), 3) == [1, 1, 1]
        for got, want in zip(loaded, ref):
            assert torch.equal(got.tensor.view(torch.int16), want)
    finally:
        adapter.close()
        for o in objs + loaded:
            o.ref_count_down()


def test_pool_down_store_fails_lookups_and_loads_miss(pool, allocator) -> None:
    url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=0.5&connect_timeout_s=0.2"
    adapter = adapter_for(url)
    objs = []
    try:
        keys = [okey(i) for i in range(2)]
        objs = [new_obj(allocator, fill=i) for i in range(2)]
        for s in pool:
            s.kill()
        assert not store(adapter, keys, objs).is_successful()
        tid = adapter.submit_lookup_and_lock_task(keys, {})
        assert bits(wait_result(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, tid), 2) == [0, 0]
        tid = adapter.submit_load_task(keys, objs)
        assert bits(wait_result(adapter.get_load_event_fd(), adapter.query_load_result, tid), 2) == [0, 0]
        assert not adapter.report_status()["is_healthy"]
    finally:
        adapter.close()
        for o in objs:
            o.ref_count_down()


def test_bad_adapter_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown kvfabric adapter_params"):
        adapter_for("kvfabric://127.0.0.1:1", lease=5)
    with pytest.raises(ValueError, match="lease_ms"):
        adapter_for("kvfabric://127.0.0.1:1", lease_ms=-5)


def test_lmcache_storage_manager_offloads_to_and_prefetches_from_the_pool(pool) -> None:
    """LMCache's own multiprocess StorageManager (L1 + store/prefetch controllers) with kvfabric as its L2.

    Write to L1 -> LMCache's store controller pushes to kvfabric -> L1 emptied ->
    LMCache's prefetch controller loads from kvfabric -> bit-identical.
    """
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, PrefetchTaskSpec
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager

    url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=10&connect_timeout_s=5"
    spec = {"type": "plugin", "module_path": "kvfabric_lmcache.l2_adapter", "class_name": "KVFabricL2Adapter",
            "adapter_params": {"url": url}}
    args = add_storage_manager_args(argparse.ArgumentParser()).parse_args(
        ["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])
    sm = StorageManager(parse_args_to_config(args))
    try:
        adapter = sm.l2_adapters()[0][1]
        assert isinstance(adapter, KVFabricL2Adapter)
        layout = MemoryLayoutDesc([SHAPE], [torch.float16])
        keys = [okey(i) for i in range(3)]
        objs = sm.reserve_write(keys, layout)
        assert len(objs) == 3
        ref = {}
        for i, k in enumerate(keys):
            g = torch.Generator().manual_seed(100 + i)
            ref[k] = torch.randint(-(2**15), 2**15, SHAPE, dtype=torch.int16, generator=g)
            objs[k].tensor.copy_(ref[k].view(torch.float16))
        sm.finish_write(keys)

        end = time.monotonic() + 20
        placed = [adapter.keymap.placement(k) for k in keys]  # a chunk's objects are placed together (issue 23)
        while not all(adapter.client.exists([adapter.keymap(k) for k in keys], placement=placed)):
            if time.monotonic() > end:
                pytest.fail("LMCache's store controller did not push the objects to the pool")
            time.sleep(0.05)
        sm.delete_l1_keys(keys)
        assert sm.get_l1_usage()[0] == 0  # nothing left in L1: the reads below must come from the pool

        handle = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]))
        assert sm.wait_prefetch_status(handle, 20) is True   # a bool: "is not None" held even on timeout
        with sm.read_prefetched_results(keys) as got:
            assert got is not None and len(got) == 3
            for obj, k in zip(got, keys):
                assert torch.equal(obj.tensor.view(torch.int16), ref[k])
        sm.finish_read_prefetched(keys)
    finally:
        sm.close()


def test_lmcache_own_l2_adapter_check_passes(pool, capsys) -> None:
    """Issue 13: LMCache's own L2-adapter check (``lmcache.v1.check``, mode test_l2_adapter,
    also behind ``lmcache bench l2``) stored 0 of 5: its memory objects carry only
    ``shape``/``dtype`` (``get_shapes()`` asserts). It now stores, finds and loads 5 of 5."""
    import asyncio

    from lmcache.v1.check.check_mode_test_l2_adapter import run_test_mode

    url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=10&connect_timeout_s=5"
    spec = {"type": "plugin", "module_path": "kvfabric_lmcache.l2_adapter", "class_name": "KVFabricL2Adapter",
            "adapter_params": {"url": url}}
    asyncio.run(run_test_mode("org/model", l2_adapter=[json.dumps(spec)], num_keys=5))
    out = capsys.readouterr().out
    for line in ("Batch store OK", "Validation: 5/5 correctly absent", "Validation: 5/5 found",
                 "Validation (loaded): 5/5", "Validation (content): 5/5"):
        assert line in out, out
    assert "Test Failed" not in out, out


def test_lmcache_bench_l2_cli_stores_finds_and_loads_verified(pool) -> None:
    """LMCache's own ``lmcache bench l2`` CLI (a subprocess, as an operator runs it) against the adapter on
    two real servers: every store succeeds, every stored key is found, every load succeeds and the
    loaded bytes pass LMCache's own round-trip verification."""
    url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=20&connect_timeout_s=5"
    spec = {"type": "plugin", "module_path": "kvfabric_lmcache.l2_adapter", "class_name": "KVFabricL2Adapter",
            "adapter_params": {"url": url}}
    cli = Path(sys.executable).parent / "lmcache"
    proc = subprocess.run(
        [str(cli), "bench", "l2", "--l2-adapter", json.dumps(spec), "--num-keys", "16", "--data-size-kb", "256",
         "--rounds", "2", "--no-skip-verify", "--lookup-max-hit-rate", "1.0"],
        capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "All 16 keys data verified OK" in out, out[-4000:]
    assert out.count("success_keys=16/16") == 3, out[-4000:]  # warm-up + 2 measured store rounds
    assert out.count("found=16/16") == 3, out[-4000:]
    assert re.search(r"Actual hit rate:\s+1\.00\n", out), out[-4000:]
