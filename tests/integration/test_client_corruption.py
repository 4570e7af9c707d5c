"""A GET payload corrupted on the wire is a miss on the client, counted, never returned."""

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
        p.arm(1)  # the next GET reply through each proxy has its first payload byte flipped
    bufs = [np.zeros(6000, np.uint8) for _ in keys]
    got = client.get_into(keys, bufs)
    assert sum(p.corrupted for p in proxies) == 3
    misses = [i for i, n in enumerate(got) if n is None]
    assert len(misses) == 3  # exactly the first found object of each shard's reply
    for i, n in enumerate(got):
        if n is not None:
            assert bytes(bufs[i][:n]) == values[i]
    st = client.stats()
    assert st["client"]["checksum_failures"] == 3
    assert all(s["up"] for s in st["client"]["shards"].values())  # corruption is not a dead shard
    # The stored objects are intact: read again without corruption.
    assert client.get(keys) == values
    # get() verifies too
    proxies[0].arm(1)
    got = client.get(keys)
    assert sum(v is None for v in got) == 1
    assert all(g == v for g, v in zip(got, values) if g is not None)


def test_without_verification_the_corruption_would_get_through(pair, make_pool, make_client, make_proxy):
    """Shows the proxy really corrupts: with checksums off the client returns the bad bytes."""
    client, proxies, keys, values = _setup(pair, make_pool, make_client, make_proxy, verify_checksums=False)
    for p in proxies:
        p.arm(1)
    got = client.get(keys)
    assert all(g is not None for g in got)
    assert sum(g != v for g, v in zip(got, values)) == 3
