"""GET checksums computed in C while the objects land (``request(..., checksums=True)``).

The native connection hashes each object slice by slice as its bytes arrive
(``kvf_recv_objects`` with keys, csrc/kvf_client.c) instead of a second pass
over the buffers. Against the Python and the native server: the digests
equal ``protocol.checksum`` and the reply's checksums for every object and
split (objects larger than a slice, several objects in one recvmsg, scatter
entries cut anywhere, empty parts, pieces read with READ_FIXED from a
registered buffer); misses leave their entry alone; without ``checksums``
nothing is computed.
"""

from __future__ import annotations

import time

import numpy as np

from kvfabric import protocol
from kvfabric.transport import native as tn

KiB = 1024
SIZES = [1, 255, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1, 3 * 64 * KiB + 7, 1 << 20, 17]


def _put(conn: tn.NativeConnection, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in SIZES]
    vals = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES]
    sums = [protocol.checksum(k, v) for k, v in zip(keys, vals)]
    reply = conn.request(protocol.PutRequest(keys=keys, sizes=SIZES, checksums=sums), vals,
                         deadline=time.monotonic() + 10)
    assert list(reply.msg.status) == [protocol.PutStatus.STORED] * len(keys)
    return keys, vals


def _get(conn, keys, bufs, **kw):
    return conn.request(protocol.GetRequest(keys=keys), recv_buffers=bufs, deadline=time.monotonic() + 10, **kw)


def test_digests_equal_the_object_checksums_for_plain_and_scatter_buffers(address):
    with tn.connect(address, timeout_s=5) as conn:
        keys, vals = _put(conn, 1)
        missing = b"not-stored-key-0"
        ks = keys[:3] + [missing] + keys[3:]
        want = [protocol.checksum(k, v) for k, v in zip(keys, vals)]

        bufs = [bytearray(max(n, 1)) for n in SIZES[:3]] + [bytearray(8)] + [bytearray(n) for n in SIZES[3:]]
        reply = _get(conn, ks, bufs, checksums=True)
        assert reply.checksums is not None and len(reply.checksums) == len(ks)
        got = list(reply.checksums)
        assert got[3] == 0  # a miss: its entry left as it was
        assert got[:3] + got[4:] == want
        found = [c for n, c in zip(reply.msg.sizes, reply.msg.checksums) if n >= 0]
        assert found == want  # the server's checksums: what the client compares with
        assert [bytes(b[:n]) for b, n in zip(bufs[:3] + bufs[4:], SIZES)] == vals

        # scatter: a 7-byte head, an empty part, then the rest in uneven pieces
        parts = []
        for n in SIZES:
            parts.append((bytearray(7), bytearray(0), bytearray(max(n // 3, 1)), bytearray(n)))
        reply = _get(conn, keys, parts, checksums=True)
        assert list(reply.checksums) == want
        for p, v in zip(parts, vals):
            assert b"".join(bytes(x) for x in p)[: len(v)] == v

        # without checksums=True nothing is computed
        assert _get(conn, keys, [bytearray(n) for n in SIZES]).checksums is None


def test_digests_cover_pieces_read_with_fixed_reads_from_a_registered_buffer(address):
    with tn.connect(address, timeout_s=5) as conn:
        keys, vals = _put(conn, 2)
        staging = np.zeros(sum(SIZES), dtype=np.uint8)
        conn.register_buffers([staging])
        views, off = [], 0
        for n in SIZES:
            views.append(staging[off:off + n])
            off += n
        # every other object in the registered buffer, the rest in plain ones: both paths in one reply
        bufs = [v if i % 2 == 0 else bytearray(n) for i, (v, n) in enumerate(zip(views, SIZES))]
        before = conn.registered_stats()["fixed_bytes"]
        reply = _get(conn, keys, bufs, checksums=True)
        assert conn.registered_stats()["fixed_bytes"] - before == sum(SIZES[0::2])
        assert list(reply.checksums) == [protocol.checksum(k, v) for k, v in zip(keys, vals)]
        assert [bytes(b) for b in bufs] == vals


def test_shm_digests_are_computed_while_copying_out_of_the_arena(make_server):
    """The shm GET into plain buffers hashes each object slice by slice as it copies it out of the arena
    (``kvf_shm_get`` with keys): the digests equal ``protocol.checksum`` for objects smaller and larger
    than a slice and of 0 bytes; a miss leaves its entry alone."""
    from kvfabric.transport import shm

    srv = make_server(capacity=64 << 20)
    with shm.connect(srv.address, timeout_s=5) as conn:
        sizes = [*SIZES, 0, 3 << 20]
        rng = np.random.default_rng(3)
        keys = [rng.bytes(16) for _ in sizes]
        vals = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        for k, v in zip(keys, vals):  # one by one: a 3 MiB object and the rest need not fit one request
            reply = conn.request(protocol.PutRequest(keys=[k], sizes=[len(v)], checksums=[protocol.checksum(k, v)]),
                                 [v], deadline=time.monotonic() + 10)
            assert list(reply.msg.status) == [protocol.PutStatus.STORED], (len(v), reply.msg.status)
        ks = keys[:2] + [b"not-stored-key-0"] + keys[2:]
        bufs = [bytearray(max(n, 1)) for n in sizes[:2]] + [bytearray(8)] + [bytearray(max(n, 1)) for n in sizes[2:]]
        reply = _get(conn, ks, bufs, checksums=True)
        got = list(reply.checksums)
        assert got[2] == 0, got  # the miss
        assert got[:2] + got[3:] == [protocol.checksum(k, v) for k, v in zip(keys, vals)]
        assert [bytes(b[:n]) for b, n in zip(bufs[:2] + bufs[3:], sizes)] == vals
        assert _get(conn, keys, [bytearray(max(n, 1)) for n in sizes]).checksums is None


def test_a_client_put_over_two_transports_stores_every_replica(make_server):
    """With two replicas, one owner reached over shm and one over the native socket, every object is
    stored on both (each server checks the checksum before storing) and reads back verified from each."""
    from kvfabric import Client, ClientConfig

    with_shm = make_server(capacity=32 << 20)
    without = make_server(capacity=32 << 20, transports=("tcp", "native"))
    rng = np.random.default_rng(9)
    sizes = [1, 300, 64 * KiB + 1, 1 << 20, 0]
    keys = [rng.bytes(16) for _ in sizes]
    vals = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    cfg = ClientConfig(replicas=2, timeout_s=10, connect_timeout_s=5)
    with Client([with_shm.address, without.address], config=cfg) as client:
        assert client.put(keys, vals).stored == len(keys)
        assert sorted(client.transports.values()) == ["native", "shm"], client.transports
    for srv in (with_shm, without):
        with Client([srv.address], config=ClientConfig(timeout_s=10, connect_timeout_s=5)) as one:
            bufs = [bytearray(max(n, 1)) for n in sizes]
            assert one.get_into(keys, bufs) == sizes, srv.address
            assert [bytes(b[:n]) for b, n in zip(bufs, sizes)] == vals
            assert one.stats()["client"]["checksum_failures"] == 0
