"""The same-host (shm) path: leases, reservations, dead clients, corruption, negotiation."""

import os
import subprocess
import sys
import textwrap

import pytest

from kvfabric import protocol as p
from kvfabric import transport
from kvfabric.config import ClientConfig
from kvfabric.errors import TransportUnavailable
from kvfabric.transport import shm, tcp

from test_server import wait_for

MiB = 1 << 20


def put(c, key, val):
    return c.request(p.PutRequest([key], [len(val)], [p.checksum(key, val)]), [val]).msg.status[0]


def test_get_put_round_trip_with_parts_split_anyhow(server):
    c = shm.connect(server.address, timeout_s=5)
    assert c.name == "shm"
    vals = [os.urandom(5000), b"", os.urandom(70000)]
    joined = b"".join(vals)
    parts = [joined[:3], joined[3:60000], joined[60000:]]  # do not line up with the objects
    keys = [b"a", b"b", b"c"]
    st = c.request(p.PutRequest(keys, [len(v) for v in vals], [p.checksum(k, v) for k, v in zip(keys, vals)]), parts).msg.status
    assert st == [0, 0, 0]
    bufs = [bytearray(len(v) + 10) for v in vals] + [bytearray(1)]
    rep = c.request(p.GetRequest(keys + [b"missing"]), recv_buffers=bufs).msg
    assert rep.sizes == [5000, 0, 70000, -1]
    assert [bytes(b[:len(v)]) for b, v in zip(bufs, vals)] == vals
    assert rep.checksums[:3] == [p.checksum(k, v) for k, v in zip(keys, vals)]
    t = tcp.connect(server.address, timeout_s=5)  # the same objects over the wire
    assert t.request(p.GetRequest([b"c"])).payload == vals[2]
    assert server.stats()["transports_in_use"]["shm"] == 1
    # RELEASE is not awaited and a zero-copy send pins until its notification: both settle
    assert wait_for(lambda: server.stats()["pinned"] == 0)
    c.close()
    t.close()


def test_a_reserved_slot_is_never_served_before_commit(server):
    c = shm.connect(server.address, timeout_s=5)
    other = tcp.connect(server.address, timeout_s=5)
    res = c._control(p.ShmReserveRequest(keys=[b"r"], sizes=[4096]), None)
    assert res.status == [0] and res.offsets[0] >= 0
    c._view[res.offsets[0]:res.offsets[0] + 4096] = b"q" * 4096
    assert other.request(p.ExistsRequest([b"r"])).msg.present == [False]
    assert other.request(p.GetRequest([b"r"])).msg.sizes == [-1]
    done = c._control(p.ShmCommitRequest(res=res.res, checksums=[p.checksum(b"r", b"q" * 4096)]), None)
    assert done.status == [0]
    assert other.request(p.GetRequest([b"r"])).payload == b"q" * 4096
    c.close()
    other.close()


def test_commit_checks_the_checksum(server):
    c = shm.connect(server.address, timeout_s=5)
    res = c._control(p.ShmReserveRequest(keys=[b"r"], sizes=[10]), None)
    c._view[res.offsets[0]:res.offsets[0] + 10] = b"0123456789"
    done = c._control(p.ShmCommitRequest(res=res.res, checksums=[p.checksum(b"r", b"something else")]), None)
    assert done.status == [p.PutStatus.CHECKSUM_MISMATCH]
    assert c.request(p.ExistsRequest([b"r"])).msg.present == [False]
    c.close()


def test_leases_and_reservations_of_a_dead_client_are_released(server):
    t = tcp.connect(server.address, timeout_s=5)
    assert put(t, b"held", b"h" * 8192) == 0
    free_before = server.stats()["free_bytes"]
    child = textwrap.dedent(f"""
        import os, sys
        from kvfabric import protocol as p
        from kvfabric.transport import shm
        c = shm.connect({server.address!r}, timeout_s=5)
        lease = c._control(p.ShmLeaseRequest(keys=[b"held"]), None)
        res = c._control(p.ShmReserveRequest(keys=[b"never"], sizes=[65536]), None)
        assert lease.sizes == [8192] and res.status == [0]
        print("ready", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert server.stats()["pinned"] == 1
        assert server.stats()["free_bytes"] == free_before - 65536
        assert server._srv.evict(b"held") == 0  # pinned by the lease
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_for(lambda: server.stats()["pinned"] == 0)
    assert wait_for(lambda: server.stats()["free_bytes"] == free_before)
    assert t.request(p.ExistsRequest([b"never"])).msg.present == [False]
    t.close()


def test_a_corrupted_arena_byte_is_caught_by_the_checksum(server):
    c = shm.connect(server.address, timeout_s=5)
    assert put(c, b"k", b"a" * 4096) == 0
    lease = c._control(p.ShmLeaseRequest(keys=[b"k"]), None)
    off = lease.offsets[0]
    c._control(p.ShmReleaseRequest(lease=lease.lease), None)
    c._view[off] = ord("b")  # a stray write by some process that maps the arena
    buf = bytearray(4096)
    rep = c.request(p.GetRequest([b"k"]), recv_buffers=[buf]).msg
    assert p.checksum(b"k", buf) != rep.checksums[0]  # the client's verification turns this into a miss
    t = tcp.connect(server.address, timeout_s=5)
    assert t.request(p.GetRequest([b"k"])).msg.sizes == [-1]  # the server drops it before sending
    assert server.stats()["checksum_failures"] == 1
    c.close()
    t.close()


def test_shm_is_unavailable_for_a_server_that_does_not_offer_it(make_server):
    srv = make_server(transports=("tcp", "native"))
    with pytest.raises(TransportUnavailable, match="does not offer shm"):
        shm.connect(srv.address, timeout_s=5)
    with pytest.raises(TransportUnavailable):
        transport.connect("shm", srv.address, ClientConfig(connect_timeout_s=5))


def test_shm_is_unavailable_for_a_remote_address():
    with pytest.raises(TransportUnavailable, match="same host|loopback"):
        shm.connect("192.0.2.1:7070", timeout_s=0.2)


def test_auto_picks_shm_for_a_local_native_server_and_native_otherwise(server, make_server):
    conn = transport.connect("auto", server.address, ClientConfig(connect_timeout_s=5))
    assert conn.name == "shm"
    conn.close()
    srv = make_server(transports=("tcp", "native"))
    conn = transport.connect("auto", srv.address, ClientConfig(connect_timeout_s=5))
    assert conn.name == "native"
    conn.close()


def test_a_large_corrupted_object_is_never_sent_whole(server):
    """Objects above 4 MiB are verified while they are sent: the unverified rest is held back."""
    from kvfabric.errors import TransportError

    c = shm.connect(server.address, timeout_s=5)
    val = os.urandom(6 * MiB - 1) + b"\x5a"  # a fixed last byte: corrupted it reads 0xa5, never buf's 0
    assert put(c, b"big", val) == 0
    lease = c._control(p.ShmLeaseRequest(keys=[b"big"]), None)
    off = lease.offsets[0]
    c._control(p.ShmReleaseRequest(lease=lease.lease), None)
    c._view[off + 6 * MiB - 1] ^= 0xFF  # the very last byte
    t = tcp.connect(server.address, timeout_s=5)
    buf = bytearray(6 * MiB)
    with pytest.raises(TransportError):
        t.request(p.GetRequest([b"big"]), recv_buffers=[buf])
    assert t.closed and buf[-1] != 0xA5  # the corrupted last byte never reached the reader
    t2 = tcp.connect(server.address, timeout_s=5)
    assert t2.request(p.GetRequest([b"big"])).msg.sizes == [-1]  # dropped, a miss from now on
    assert server.stats()["checksum_failures"] == 1
    c.close()
    t2.close()
