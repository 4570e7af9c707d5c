"""``Client.get_into_parts``: one object received over several buffers (header + payload), every transport."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.client import PutResult

KiB, MiB = 1024, 1024 * 1024


def test_get_into_parts_scatters_each_object_over_its_buffers_in_order(make_pool, make_client):
    pool = make_pool(2)
    client = make_client(pool.addresses)
    rng = np.random.default_rng(7)
    sizes = [256 + 1 * MiB, 256 + 1000, 100, 256, 3 * 256 + 5]
    keys = [rng.bytes(16) for _ in sizes]
    values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    assert client.put(keys, values) == PutResult(stored=len(keys))
    missing = rng.bytes(16)

    heads = [np.full(256, 0xEE, dtype=np.uint8) for _ in range(len(sizes) + 1)]
    bodies = [np.full(1 * MiB + 64, 0xEE, dtype=np.uint8) for _ in range(len(sizes) + 1)]
    parts: list[tuple] = [(h, b) for h, b in zip(heads, bodies)]
    # the last object goes over four buffers of 256 bytes, the 4th one 5 bytes into it
    quads = [np.full(256, 0xEE, dtype=np.uint8) for _ in range(4)]
    parts[4] = tuple(quads)
    got = client.get_into_parts(keys + [missing], parts)
    assert got == sizes + [None]

    for i in range(3):  # header buffer, then the payload buffer
        n = sizes[i]
        joined = bytes(heads[i][: min(n, 256)]) + bytes(bodies[i][: max(n - 256, 0)])
        assert joined == values[i]
    assert (bodies[2] == 0xEE).all()  # a 100-byte object fills only the header buffer
    assert (heads[2][100:] == 0xEE).all()
    assert bytes(heads[3]) == values[3] and (bodies[3] == 0xEE).all()  # exactly the header
    assert b"".join(bytes(q) for q in quads)[: sizes[4]] == values[4]
    assert (quads[3][5:] == 0xEE).all()
    assert (heads[5] == 0xEE).all() and (bodies[5] == 0xEE).all()  # a miss writes nothing
    assert client.stats()["client"]["checksum_failures"] == 0


def test_get_into_parts_rejects_small_or_bad_entries_and_the_connection_stays_usable(make_pool, make_client):
    pool = make_pool(1)
    client = make_client(pool.addresses)
    rng = np.random.default_rng(8)
    keys = [rng.bytes(16) for _ in range(3)]
    values = [rng.integers(0, 256, 4 * KiB, dtype=np.uint8).tobytes() for _ in keys]
    client.put(keys, values)

    ok1 = (bytearray(16), bytearray(4 * KiB))
    small = (bytearray(16), bytearray(4 * KiB - 17))  # one byte short in total
    ok2 = (bytearray(4 * KiB),)
    with pytest.raises(ValueError):
        client.get_into_parts(keys, [ok1, small, ok2])
    # the connection stayed usable: the same call with a big enough entry succeeds
    big = (bytearray(16), bytearray(4 * KiB))
    assert client.get_into_parts(keys[1:2], [big]) == [4 * KiB]
    assert bytes(big[0]) + bytes(big[1][: 4 * KiB - 16]) == values[1]

    with pytest.raises(TypeError):
        client.get_into_parts(keys[:1], [(bytes(16), bytearray(4 * KiB))])  # read-only part
    with pytest.raises(ValueError):
        client.get_into_parts(keys[:1], [()])
    with pytest.raises(ValueError):
        client.get_into_parts(keys[:1], [tuple(bytearray(64) for _ in range(65))])
    with pytest.raises(ValueError):
        client.get_into_parts(keys, [ok1])


def test_hand_off_repairs_read_scatter_entries_in_order() -> None:
    # a hand-off repair re-puts what a GET found; for get_into_parts that object is spread over the parts
    from kvfabric.membership.handoff import _received

    a, b, c = bytearray(b"head"), bytearray(b"payload-xx"), bytearray(b"zz")
    parts = tuple(memoryview(x) for x in (a, b, c))
    assert _received(parts, 11) == b"headpayload"
    assert _received(parts, 3) == b"hea"
    assert _received(memoryview(b), 7) == b"payload"
