"""The L2 adapter for LMCache's multiprocess server, loaded the way the MP server loads it (--l2-adapter JSON)."""

from __future__ import annotations

import argparse
import json
import select
import time

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
