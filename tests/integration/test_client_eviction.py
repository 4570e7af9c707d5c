"""LRU eviction at capacity, in exact order, observed only through the client."""

from __future__ import annotations

import numpy as np

from kvfabric import sharding
from kvfabric.testing.conformance import EXACT_CAPACITY_ARGS

KiB = 1024
BLOCK = 64 * KiB
SLOTS = 16  # capacity per shard, in blocks


def _keys_owned_by(shard: int, addresses, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        k = rng.bytes(16)
        if sharding.owners(k, addresses)[0] == shard:
            out.append(k)
    return out


def test_lru_eviction_order_through_the_client(pair, make_pool, make_client):
    # exact capacity: the server evicts only when a PUT finds no room
    pool = make_pool(3, capacity=str(SLOTS * BLOCK), extra_args=EXACT_CAPACITY_ARGS[pair[0]])
    client = make_client(pool.addresses)
    addr = pool.addresses
    keys = _keys_owned_by(1, addr, SLOTS + 6, seed=5)
    value = bytes(range(256)) * (BLOCK // 256)

    resident = keys[:SLOTS]
    assert client.put(resident, [value] * SLOTS).stored == SLOTS
    assert all(client.exists(resident))
    assert client.stats()["servers"][addr[1]]["evictions"] == 0

    # Touch in a known order: GET hits and LOOKUP hits count as accesses; EXISTS does not.
    order = list(range(SLOTS))
    rng = np.random.default_rng(6)
    rng.shuffle(order)
    for i in order[: SLOTS // 2]:
        assert client.get([resident[i]]) == [value], repr(client.stats())
    for i in order[SLOTS // 2 :]:
        assert client.lookup([resident[i]]) == 1, repr(client.stats())
    client.exists(resident[::-1])  # must not change the order
    lru_order = [resident[i] for i in order]  # least recently used first

    # Each new block evicts exactly the next least recently used one.
    evicted = []
    for k in keys[SLOTS:]:
        before = set(x for x, p in zip(lru_order, client.exists(lru_order)) if p)
        assert client.put([k], [value]).stored == 1
        after = set(x for x, p in zip(lru_order, client.exists(lru_order)) if p)
        gone = before - after
        assert len(gone) == 1
        evicted.append(gone.pop())
    assert evicted == lru_order[: len(evicted)]
    assert client.stats()["servers"][addr[1]]["evictions"] == len(evicted)
    # other shards were not touched
    for a in (addr[0], addr[2]):
        assert client.stats()["servers"][a]["objects"] == 0


def test_getting_a_block_protects_it_from_eviction(pair, make_pool, make_client):
    pool = make_pool(3, capacity=str(SLOTS * BLOCK), extra_args=EXACT_CAPACITY_ARGS[pair[0]])
    client = make_client(pool.addresses)
    keys = _keys_owned_by(0, pool.addresses, SLOTS + 1, seed=7)
    value = b"\x5a" * BLOCK
    client.put(keys[:SLOTS], [value] * SLOTS)
    buf = bytearray(BLOCK)
    assert client.get_into([keys[0]], [buf]) == [BLOCK], repr(client.stats())  # oldest becomes most recent
    client.put([keys[SLOTS]], [value])
    present = client.exists(keys)
    assert present[0] and not present[1] and all(present[2:])
