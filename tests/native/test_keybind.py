"""Protocol 2 in the C data plane: the object checksum binds the key (csrc/kvf_hash.c).

C and Python compute the same ``checksum(key, value) = xxh3_64(value,
seed=xxh3_64(key))``, one-shot and streamed in any split; the C server
verifies it on every path that takes or serves an object (PUT received over
a socket, shm COMMIT, GET before sending, GET of a large object verified while
it is sent, seeded from the key the store keeps) and counts refused PUT
objects in ``checksum_rejects``.
"""

from __future__ import annotations

import random

import pytest

from kvfabric import protocol as p
from kvfabric.transport import shm, tcp

native = pytest.importorskip("kvfabric._native")

MiB = 1 << 20


def _cases(seed: int, n: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    # value lengths around xxh3's internal boundaries (16, 128, 240, stripes and blocks) and larger
    lengths = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4096, 65536 + 7, MiB + 3]
    out = []
    for i in range(n):
        key = rng.randbytes(rng.choice([1, 8, 16, 32, 64, rng.randint(1, 64)]))
        size = lengths[i] if i < len(lengths) else rng.randint(0, 300_000)
        out.append((key, rng.randbytes(size)))
    return out


@pytest.mark.parametrize("key, value", _cases(14, 40), ids=lambda x: f"{len(x)}B" if isinstance(x, bytes) else None)
def test_c_and_python_compute_the_same_keyed_checksum(key, value):
    want = p.checksum(key, value)
    assert native.obj_checksum(key, value) == want
    for chunk in (1, 63, 4096, 256 * 1024):  # streamed as the server hashes a PUT while it arrives
        if chunk <= max(len(value), 1) * 2:
            assert native.obj_checksum(key, value, chunk) == want


def test_the_key_changes_the_checksum_in_c():
    value = bytes(range(256)) * 64
    a = native.obj_checksum(b"key-a", value)
    assert a != native.obj_checksum(b"key-b", value)
    assert a != native.xxh3_64(value)  # not the protocol-1 (value only) checksum
    assert native.obj_checksum(b"key-a", value) == native.obj_checksum(b"key-a", bytearray(value), 1000)


def test_stats_count_checksum_rejects(server):
    c = tcp.connect(server.address, timeout_s=5)
    v = b"v" * 5000
    st = c.request(p.PutRequest([b"a", b"b"], [5000, 5000], [p.checksum(b"b", v), p.checksum(b"b", v)]), [v, v]).msg
    assert st.status == [p.PutStatus.CHECKSUM_MISMATCH, p.PutStatus.STORED]
    assert c.request(p.StatsRequest()).msg.stats["checksum_rejects"] == 1
    assert server.stats()["checksum_rejects"] == 1  # the in-process view says the same
    assert server.stats()["checksum_failures"] == 0  # a refused PUT is not a stored object gone bad
    assert c.request(p.GetRequest([b"a"])).msg.sizes == [-1]
    c.close()


def test_a_zero_byte_object_binds_its_key_too(server):
    c = tcp.connect(server.address, timeout_s=5)
    st = c.request(p.PutRequest([b"e1", b"e2"], [0, 0], [p.checksum(b"e2", b""), p.checksum(b"e2", b"")]), [])
    assert st.msg.status == [p.PutStatus.CHECKSUM_MISMATCH, p.PutStatus.STORED]
    assert server.stats()["checksum_rejects"] == 1
    c.close()


def test_shm_commit_refuses_another_keys_checksum(server):
    c = shm.connect(server.address, timeout_s=5)
    value = b"s" * 4096
    res = c._control(p.ShmReserveRequest(keys=[b"mine", b"theirs"], sizes=[4096, 4096]), None)
    for off in res.offsets:
        c._view[off:off + 4096] = value
    sums = [p.checksum(b"theirs", value), p.checksum(b"theirs", value)]  # the first claims another key's binding
    done = c._control(p.ShmCommitRequest(res=res.res, checksums=sums), None)
    assert done.status == [p.PutStatus.CHECKSUM_MISMATCH, p.PutStatus.STORED]
    assert server.stats()["checksum_rejects"] == 1
    assert c.request(p.ExistsRequest([b"mine", b"theirs"])).msg.present == [False, True]
    # the fused shm PUT path: the client's checksums are the keyed ones, the server agrees
    assert c.request(p.PutRequest([b"mine"], [4096], [p.checksum(b"mine", value)]), [value]).msg.status == [0]
    buf = bytearray(4096)
    rep = c.request(p.GetRequest([b"mine"]), recv_buffers=[buf]).msg
    assert rep.checksums == [p.checksum(b"mine", value)] and bytes(buf) == value
    c.close()


def test_copy_out_returns_keyed_checksums(server):
    c = shm.connect(server.address, timeout_s=5)
    value = bytes(range(256)) * 20
    assert c.request(p.PutRequest([b"co"], [len(value)], [p.checksum(b"co", value)]), [value]).msg.status == [0]
    lease = c._control(p.ShmLeaseRequest(keys=[b"co"]), None)
    buf = bytearray(len(value))
    sums = native.copy_out(c._view, lease.offsets, lease.sizes, [buf], [b"co"])
    assert sums == lease.checksums == [p.checksum(b"co", value)] and bytes(buf) == value
    assert native.copy_out(c._view, lease.offsets, lease.sizes, [buf], None) == [None]
    c._control(p.ShmReleaseRequest(lease=lease.lease), None)
    c.close()


def test_a_large_object_is_verified_while_sent_under_its_stored_key(make_server):
    """Objects over 4 MiB (KVF_VERIFY_WHOLE) are hashed chunk by chunk as they go out, the
    stream seeded from the key the store keeps for the entry: the GET succeeds only if that
    seeding is right (a mismatch closes the connection)."""
    srv = make_server(capacity=32 * MiB)
    c = tcp.connect(srv.address, timeout_s=10)
    value = random.Random(5).randbytes(6 * MiB + 123)
    assert c.request(p.PutRequest([b"large"], [len(value)], [p.checksum(b"large", value)]), [value]).msg.status == [0]
    for _ in range(2):  # the connection's streaming state is reset (and re-seeded) per object
        rep = c.request(p.GetRequest([b"large"]))
        assert rep.msg.checksums == [p.checksum(b"large", value)] and bytes(rep.payload) == value
    assert srv.stats()["checksum_failures"] == 0
    c.close()


def test_c_server_refuses_a_protocol_1_hello(raw):
    raw.send(p.HEADER.pack(p.MAGIC, 1, p.Op.HELLO, 0, 4, 1, 0, 0) + p.encode_meta({}))
    f = raw.recv_frame()
    h = p.unpack_header(f)
    err = p.ErrorReply.from_meta(p.decode_meta(f[p.HEADER_SIZE:]))
    assert h.is_error and h.request_id == 4 and err.code == p.ErrorCode.BAD_VERSION
    assert err.message == p.BAD_VERSION_MESSAGE == "this server speaks protocol 3: HELLO proves both sides hold the pool token"
    assert raw.closed_by_peer()
