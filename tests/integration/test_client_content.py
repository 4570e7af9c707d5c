"""Client against 3 real shards: content byte for byte, lookup, delete, batching, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric import KeyHasher, Namespace, protocol, sharding
from kvfabric.client import PutResult

KiB, MiB = 1024, 1024 * 1024


def _values(rng, sizes):
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def test_content_byte_for_byte_many_keys_and_sizes(make_pool, make_client):
    pool = make_pool(3, capacity="64MiB")
    client = make_client(pool.addresses)
    rng = np.random.default_rng(1)
    sizes = [1, 7, 100, 4095, 4096, 4097, 64 * KiB, 256 * KiB + 3, 1 * MiB, 2 * MiB + 1]
    sizes += [int(x) for x in rng.integers(1, 200 * KiB, 190)]
    keys = [rng.bytes(16) for _ in sizes]
    values = _values(rng, sizes)
    assert client.put(keys, values) == PutResult(stored=len(keys))
    assert client.put(keys[:5], values[:5]) == PutResult(existed=5)

    # numpy destinations of several dtypes, and bytearrays, all larger than needed
    bufs = []
    for i, n in enumerate(sizes):
        if i % 3 == 0:
            bufs.append(bytearray(n + 13))
        elif i % 3 == 1:
            bufs.append(np.zeros(n + 5, dtype=np.uint8))
        else:
            bufs.append(np.zeros((n + 1) // 2 + 8, dtype=np.float16))  # 2-byte elements
    got = client.get_into(keys, bufs)
    assert got == sizes
    for buf, n, v in zip(bufs, sizes, values):
        assert bytes(memoryview(buf).cast("B")[:n]) == v
    assert client.get(keys) == values

    st = client.stats()
    per_server = [st["servers"][a]["objects"] for a in pool.addresses]
    assert sum(per_server) == len(keys)
    assert all(n > 0 for n in per_server), per_server  # keys spread over every shard
    owners = sharding.owner_table(keys, pool.addresses)
    assert per_server == [sum(1 for o in owners if o[0] == s) for s in range(3)]
    assert st["client"]["hits"] == 2 * len(keys)
    assert st["client"]["checksum_failures"] == 0


def test_misses_exists_delete(make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses)
    rng = np.random.default_rng(2)
    keys = [rng.bytes(16) for _ in range(60)]
    values = _values(rng, [1000] * 60)
    client.put(keys[:40], values[:40])
    assert client.exists(keys) == [True] * 40 + [False] * 20
    assert client.get(keys[38:42]) == values[38:40] + [None, None]
    bufs = [bytearray(1000) for _ in range(4)]
    assert client.get_into(keys[38:42], bufs) == [1000, 1000, None, None]
    assert client.delete(keys[:10] + keys[50:]) == 10
    assert client.exists(keys[:12]) == [False] * 10 + [True] * 2
    assert client.get([]) == [] and client.exists([]) == [] and client.lookup([]) == 0


def test_lookup_longest_leading_run_over_shards(make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses)
    ns = Namespace(model="test-model", block_tokens=16)
    keys = KeyHasher().prefix_keys(ns, list(range(16 * 40)))
    assert len(keys) == 40 and len({sharding.owners(k, pool.addresses)[0] for k in keys}) == 3
    blobs = _values(np.random.default_rng(3), [512] * 40)
    assert client.lookup(keys) == 0
    client.put(keys[:25], blobs[:25], parents=[None] + keys[:24])
    assert client.lookup(keys) == 25
    assert client.lookup(keys, lease_ms=1000) == 25
    assert client.lookup(keys[:25]) == 25
    client.delete([keys[10]])
    assert client.lookup(keys) == 10
    client.put(keys[10:11], blobs[10:11])
    client.put(keys[30:], blobs[30:])  # a hole at 25..29: the run still stops at 25
    assert client.lookup(keys) == 25
    client.delete([keys[0]])
    assert client.lookup(keys) == 0


def test_prefix_keys_uses_the_namespace(make_pool, make_client):
    pool = make_pool(1)
    ns = Namespace(model="m", block_tokens=4)
    client = make_client(pool.addresses, namespace=ns)
    tokens = list(range(10))
    assert client.prefix_keys(tokens) == KeyHasher().prefix_keys(ns, tokens)
    assert len(client.prefix_keys(tokens)) == 2  # whole blocks only


def test_batches_are_split_at_the_key_limit(make_pool, make_client):
    pool = make_pool(2)
    client = make_client(pool.addresses, max_batch_keys=50)
    rng = np.random.default_rng(4)
    keys = [rng.bytes(16) for _ in range(1000)]
    values = [k * 2 for k in keys]
    before = client.stats()["client"]["requests"]
    assert client.put(keys, values).stored == 1000
    requests = client.stats()["client"]["requests"] - before
    assert requests >= 1000 // 50  # split per shard into <= 50-key requests
    assert client.get(keys) == values
    assert client.lookup(keys) == 1000


def test_more_keys_than_one_frame_allows(make_pool, make_client):
    pool = make_pool(1)
    client = make_client(pool.addresses)
    n = protocol.MAX_KEYS_PER_BATCH + 500
    keys = [i.to_bytes(8, "little") for i in range(n)]
    assert client.put(keys, [b"v"] * n).stored == n
    assert client.exists(keys) == [True] * n
    assert client.lookup(keys) == n


def test_programming_errors_raise_and_leave_the_client_usable(make_pool, make_client):
    pool = make_pool(1)
    client = make_client(pool.addresses)
    k = b"k" * 16
    client.put([k], [b"x" * 100])
    with pytest.raises(ValueError, match="GET buffer 0"):
        client.get_into([k], [bytearray(10)])
    with pytest.raises(TypeError):
        client.get_into([k], [b"x" * 100])  # read-only
    with pytest.raises(TypeError):
        client.get_into([k], [np.zeros((10, 20), np.uint8)[:, ::2]])  # not contiguous
    with pytest.raises(TypeError):
        client.put(["text-key"], [b"x"])
    with pytest.raises(ValueError):
        client.put([b"k" * 65], [b"x"])
    with pytest.raises(ValueError):
        client.put([b""], [b"x"])
    with pytest.raises(ValueError):
        client.put([k, k], [b"x"])
    with pytest.raises(TypeError):
        client.get(k)  # a single key instead of a list
    with pytest.raises(ValueError):
        client.lookup([k], lease_ms=-1)
    # still fine afterwards, on the same pooled connection
    buf = bytearray(100)
    assert client.get_into([k], [buf]) == [100] and bytes(buf) == b"x" * 100
    assert client.stats()["client"]["shard_errors"] == 0


def test_closed_client_raises(make_pool, make_client):
    from kvfabric.errors import KVFabricError

    pool = make_pool(1)
    client = make_client(pool.addresses)
    client.close()
    with pytest.raises(KVFabricError):
        client.get([b"k"])
    client.close()  # idempotent
