"""A GET payload corrupted on the wire is a miss on the client, counted, never returned.

A verifying client lets the server send without checking (``client_verifies``)
and asks again, with the server checking, for an object that failed: a flip
on the wire once costs a second GET of that object, a flip every time a miss.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.testing.conformance import SOCKET_PAYLOAD_TRANSPORTS


def _setup(pair, make_pool, make_client, make_proxy, **cfg):
    if pair[1] not in SOCKET_PAYLOAD_TRANSPORTS:
        pytest.skip(f"{pair[1]} GET payloads do not travel through the proxied socket")
    pool = make_pool(3)
    proxies = [make_proxy(a) for a in pool.addresses]
    client = make_client([p.address for p in proxies], **cfg)
    rng = np.random.default_rng(11)
    keys = [rng.bytes(16) for _ in range(30)]
    values = [rng.integers(0, 256, 5000 + i, dtype=np.uint8).tobytes() for i in range(30)]
    assert client.put(keys, values).stored == 30
    return client, proxies, keys, values


def test_corrupted_get_payload_is_a_miss(pair, make_pool, make_client, make_proxy):
    client, proxies, keys, values = _setup(pair, make_pool, make_client, make_proxy)
    for p in proxies:
        p.arm(2)  # the next 2 GET replies through each proxy have their first payload byte flipped
    bufs = [np.zeros(6000, np.uint8) for _ in keys]
    got = client.get_into(keys, bufs)
    assert sum(p.corrupted for p in proxies) == 6  # each shard's reply, then the object asked again
    misses = [i for i, n in enumerate(got) if n is None]
    assert len(misses) == 3  # exactly the first found object of each shard's reply
    for i, n in enumerate(got):
        if n is not None:
            assert bytes(bufs[i][:n]) == values[i]
    st = client.stats()
    assert st["client"]["checksum_failures"] == 6
    assert all(s["up"] for s in st["client"]["shards"].values())  # corruption is not a dead shard
    # The stored objects are intact: read again without corruption.
    assert client.get(keys) == values
    # get() verifies too
    proxies[0].arm(2)
    got = client.get(keys)
    assert sum(v is None for v in got) == 1
    assert all(g == v for g, v in zip(got, values) if g is not None)


def test_a_flip_on_the_wire_once_is_recovered_by_asking_again(pair, make_pool, make_client, make_proxy):
    client, proxies, keys, values = _setup(pair, make_pool, make_client, make_proxy)
    for p in proxies:
        p.arm(1)  # only each shard's next GET reply is corrupted
    bufs = [np.zeros(6000, np.uint8) for _ in keys]
    got = client.get_into(keys, bufs)
    assert sum(p.corrupted for p in proxies) == 3
    assert got == [len(v) for v in values]  # the failed objects came again, intact
    assert all(bytes(bufs[i][: len(v)]) == v for i, v in enumerate(values))
    st = client.stats()
    assert st["client"]["checksum_failures"] == 3 and st["client"]["misses"] == 0


def test_without_verification_the_corruption_would_get_through(pair, make_pool, make_client, make_proxy):
    """Shows the proxy really corrupts: with checksums off the client returns the bad bytes."""
    client, proxies, keys, values = _setup(pair, make_pool, make_client, make_proxy, verify_checksums=False)
    for p in proxies:
        p.arm(1)
    got = client.get(keys)
    assert all(g is not None for g in got)
    assert sum(g != v for g, v in zip(got, values)) == 3


def test_a_byte_flipped_deep_inside_a_large_object_is_a_miss(pair, make_pool, make_client, make_proxy):
    """The native transport hashes objects in slices as they land: a flip in a later slice, or in
    the reply's very last byte, still fails that object only (get_into and the scatter form)."""
    if pair[1] not in SOCKET_PAYLOAD_TRANSPORTS:
        pytest.skip(f"{pair[1]} GET payloads do not travel through the proxied socket")
    pool = make_pool(1)
    proxy = make_proxy(pool.addresses[0])
    client = make_client([proxy.address])
    rng = np.random.default_rng(12)
    sizes = [3000, 1_000_000, 70_000, 5]
    keys = [rng.bytes(16) for _ in sizes]
    values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    assert client.put(keys, values).stored == len(keys)

    proxy.arm(2, at=3000 + 700_000)  # inside the 1 MB object, well past its first slices (and asked again)
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    got = client.get_into(keys, bufs)
    assert got == [3000, None, 70_000, 5]
    assert [bytes(bufs[i]) for i in (0, 2, 3)] == [values[i] for i in (0, 2, 3)]

    proxy.arm(2, at=-1)  # the last byte of the reply: the last object's (and asked again)
    parts = [(np.zeros(256, np.uint8), np.zeros(max(n - 256, 1), np.uint8)) for n in sizes]
    got = client.get_into_parts(keys, parts)
    assert got == [3000, 1_000_000, 70_000, None]
    for i in range(3):
        assert (bytes(parts[i][0]) + bytes(parts[i][1]))[: sizes[i]] == values[i]
    assert client.stats()["client"]["checksum_failures"] == 4
    assert client.get_into(keys, bufs) == sizes  # stored intact, the connection still serves
