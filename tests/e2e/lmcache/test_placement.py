"""Placement of LMCache's objects (issue 23): one LMCache chunk's objects are routed by one placement key.

The L2 adapter stores one object per (chunk, kv rank, object group): the object groups of a chunk land on
one server. The storage plugin's per-layer keys (``LayerCacheEngineKey``) are placed by their chunk's
whole-chunk key; whole-chunk keys keep their own routing.
"""

from __future__ import annotations

import pytest
import torch
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.distributed.api import ObjectKey

from kvfabric import Client, KeyHasher, sharding
from kvfabric.testing.servers import start_pool
from kvfabric_lmcache.keymap import KeyMapper

from test_l2_adapter import adapter_for, allocator, bits, new_obj, store, wait_result  # noqa: F401 (allocator: a fixture)

pytestmark = pytest.mark.lmcache


def test_plugin_layer_keys_are_placed_by_their_chunk():
    km = KeyMapper(KeyHasher(), 256)
    base = dict(model_name="org/model", world_size=1, worker_id=0, chunk_hash=0xABCD, dtype=torch.float16)
    whole = CacheEngineKey(**base)
    layers = [LayerCacheEngineKey(**base, layer_id=i) for i in range(4)]
    assert km.placement([whole]) is None                      # whole-chunk objects: routed as before
    assert km.placement(layers) == [km(whole)] * 4            # every layer: its chunk's key
    assert len(set(km.many(layers))) == 4                     # the objects keep their own keys
    other = LayerCacheEngineKey(**{**base, "chunk_hash": 0xABCE}, layer_id=0)
    assert km.placement([other]) != km.placement(layers[:1])


def test_l2_object_groups_of_a_chunk_live_on_one_server(allocator):
    with start_pool(4, capacity="64MiB") as pool:
        url = "kvfabric://" + ",".join(pool.addresses) + "?timeout_s=10&connect_timeout_s=5"
        adapter = adapter_for(url, lease_ms=2000)
        objs, loaded = [], []
        try:
            keys = [ObjectKey(chunk_hash=c.to_bytes(8, "little"), model_name="org/model", kv_rank=0,
                              object_group_id=g) for c in range(8) for g in (0, 1)]
            objs = [new_obj(allocator, shape=torch.Size([2, 1, 16, 64]), fill=i) for i in range(len(keys))]
            assert store(adapter, keys, objs).is_successful()
            ks = [adapter.keymap(k) for k in keys]
            place = [adapter.keymap.placement(k) for k in keys]
            assert place[0] == place[1] != place[2] and ks[0] != ks[1]
            with Client(pool.addresses) as c:
                members = c.members
            for pos, addr in enumerate(pool.addresses):
                with Client([addr]) as one:
                    held = one.exists(ks)
                want = [sharding.owners(p, members)[0] == pos for p in place]
                assert held == want, (addr, held, want)
            tid = adapter.submit_lookup_and_lock_task(keys, {})
            got = wait_result(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, tid)
            assert bits(got, len(keys)) == [1] * len(keys)
            loaded = [new_obj(allocator, shape=torch.Size([2, 1, 16, 64])) for _ in keys[:4]]
            tid = adapter.submit_load_task(keys[:4], loaded)
            assert bits(wait_result(adapter.get_load_event_fd(), adapter.query_load_result, tid), 4) == [1] * 4
            for a, b in zip(loaded, objs):
                assert torch.equal(a.tensor.view(torch.int16), b.tensor.view(torch.int16))
        finally:
            adapter.close()
            for o in objs + loaded:
                o.ref_count_down()
