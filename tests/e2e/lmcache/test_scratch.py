"""The staging-buffer pool and value encoding into caller buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric_lmcache import value
from kvfabric_lmcache.scratch import ScratchPool
from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

pytestmark = pytest.mark.lmcache


def test_scratch_pool_reuses_and_bounds_what_it_keeps() -> None:
    pool = ScratchPool(1024, retain=2)
    a = pool.take(3)
    assert [b.size for b in a] == [1024] * 3
    pool.give(a)
    assert pool.retained == 2  # the third buffer is dropped
    b = pool.take(3)
    assert sum(any(x is y for y in a) for x in b) == 2  # two came back from the pool, one is new
    pool.give([np.empty(10, np.uint8)])  # a foreign size is never pooled
    assert pool.retained == 0
    with pytest.raises(ValueError):
        ScratchPool(0, 1)


def test_encode_into_matches_encode_and_checks_room() -> None:
    alloc = MixedMemoryAllocator(4 << 20)
    try:
        obj = alloc.allocate(torch.Size([2, 2, 10, 8]), torch.float16, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.arange(obj.tensor.numel(), dtype=torch.float16).view(obj.tensor.shape))
        full = value.encode(obj)
        assert full.size == value.encoded_size(obj)
        out = np.full(full.size + 100, 7, np.uint8)
        used = value.encode_into(obj, out)
        assert used.size == full.size and bytes(used) == bytes(full)
        assert (out[full.size:] == 7).all()
        with pytest.raises(ValueError, match="at least"):
            value.encode_into(obj, np.empty(full.size - 1, np.uint8))
        obj.ref_count_down()
    finally:
        alloc.close()
