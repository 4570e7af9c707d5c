"""The native server on its own: bad input, limits, pipelining, eviction through the policy, pins.

Real server (in-process io_uring thread + control thread) on loopback; the
client side is raw frames or the pure-Python tcp transport, so these tests
check the C data plane, not the native client.
"""

import struct
import threading
import time

import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, RemoteError, TransportUnavailable
from kvfabric.transport import tcp
from kvfabric.testing import wait_for

MiB = 1 << 20


def put_frame(rid, keys, values, checksums=None):
    msg = p.PutRequest(keys=keys, sizes=[len(v) for v in values],
                       checksums=checksums or [p.checksum(k, v) for k, v in zip(keys, values)])
    return p.encode_request(msg, rid) + b"".join(values)


def reply_of(frame, op):
    h = p.unpack_header(frame)
    return p.decode_reply(h, frame[p.HEADER_SIZE:p.HEADER_SIZE + h.meta_len], op)


def error_code(frame):
    h = p.unpack_header(frame)
    assert h.is_error
    return p.ErrorReply.from_meta(p.decode_meta(frame[p.HEADER_SIZE:])).code


@pytest.mark.parametrize("bad, code", [
    (b"XXXX" + p.pack_header(2, 1, 0, 0)[4:], ErrorCode.BAD_MAGIC),
    (p.pack_header(2, 1, 0, 0)[:4] + struct.pack("<H", 9) + p.pack_header(2, 1, 0, 0)[6:], ErrorCode.BAD_VERSION),
    (p.pack_header(2, 1, p.MAX_META_BYTES + 1, 0), ErrorCode.META_TOO_LARGE),
    (p.pack_header(6, 1, 0, p.MAX_PAYLOAD_BYTES + 1), ErrorCode.PAYLOAD_TOO_LARGE),
])
def test_untrustworthy_headers_get_an_error_then_the_connection_closes(raw, server, bad, code):
    raw.send(bad)
    assert error_code(raw.recv_frame()) == code
    assert raw.closed_by_peer()
    assert server.stats()["connections"] == 0 or wait_for(lambda: server.stats()["connections"] == 0)


@pytest.mark.parametrize("meta, code", [
    (b"\x93\x01\x02\x03", ErrorCode.MALFORMED),                                 # not a map
    (p.encode_meta({"keys": [b"k"] * 4097}), ErrorCode.TOO_MANY_KEYS),
    (p.encode_meta({"keys": [b""]}), ErrorCode.BAD_KEY),
    (p.encode_meta({"keys": [b"x" * 65]}), ErrorCode.BAD_KEY),
    (p.encode_meta({"keys": "notalist"}), ErrorCode.MALFORMED),
])
def test_bad_metadata_is_answered_and_the_connection_stays_usable(raw, meta, code):
    raw.send(p.pack_header(p.Op.GET, 4, len(meta), 0) + meta)
    assert error_code(raw.recv_frame()) == code
    raw.send(p.encode_request(p.PingRequest(), 5))
    assert p.unpack_header(raw.recv_frame()).request_id == 5


def test_unknown_opcode_with_payload_is_drained(raw):
    raw.send(p.pack_header(77, 1, 1, 5) + b"\x80" + b"hello")
    assert error_code(raw.recv_frame()) == ErrorCode.UNKNOWN_OPCODE
    raw.send(p.encode_request(p.PingRequest(), 2))
    assert p.unpack_header(raw.recv_frame()).request_id == 2


def test_put_length_mismatch_closes(raw):
    msg = p.PutRequest(keys=[b"k"], sizes=[10], checksums=[0])
    meta = p.encode_meta(msg.to_meta())
    raw.send(p.pack_header(p.Op.PUT, 1, len(meta), 4) + meta + b"abcd")
    assert error_code(raw.recv_frame()) == ErrorCode.LENGTH_MISMATCH
    assert raw.closed_by_peer()


def test_put_statuses(raw):
    big = b"x" * (16 * MiB + 1)  # larger than the whole arena
    raw.send(put_frame(1, [b"a", b"b", b"c"], [b"1" * 5000, b"2", b"3"], [p.checksum(b"a", b"1" * 5000), 0, p.checksum(b"c", b"3")]))
    assert reply_of(raw.recv_frame(), p.Op.PUT).status == [0, 4, 0]
    raw.send(put_frame(2, [b"a", b"big"], [b"1" * 5000, big]))
    assert reply_of(raw.recv_frame(), p.Op.PUT).status == [1, 2]
    raw.send(p.encode_request(p.GetRequest(keys=[b"a", b"b", b"c"]), 3))
    f = raw.recv_frame()
    rep = reply_of(f, p.Op.GET)
    assert rep.sizes == [5000, -1, 1] and f.endswith(b"1" * 5000 + b"3")


def test_many_requests_in_flight_on_one_connection(raw, server):
    values = [bytes([i % 251]) * (1000 + 37 * i) for i in range(200)]
    frames = b"".join(put_frame(i, [b"key%d" % i], [v]) for i, v in enumerate(values))
    frames += b"".join(p.encode_request(p.GetRequest(keys=[b"key%d" % i]), 1000 + i) for i in range(200))
    sender = threading.Thread(target=raw.send, args=(frames,))
    sender.start()  # more than max_in_flight requests queued: the server applies backpressure
    for i in range(200):
        assert reply_of(raw.recv_frame(), p.Op.PUT).status == [0]
    for i in range(200):
        f = raw.recv_frame()
        assert p.unpack_header(f).request_id == 1000 + i and f.endswith(values[i])
    sender.join()
    assert server.stats()["puts"] == 200


def test_lru_eviction_order_is_the_policys(make_server):
    srv = make_server(capacity=64 * 4096, low_watermark=0.0, high_watermark=0.0)
    c = tcp.connect(srv.address, timeout_s=5)
    val = b"v" * 4096  # one page each: 64 fit
    keys = [b"k%02d" % i for i in range(64)]
    for k in keys:
        assert c.request(p.PutRequest([k], [4096], [p.checksum(k, val)]), [val]).msg.status == [0]
    c.request(p.GetRequest([keys[0]]))  # k00 becomes the most recent, k01 the coldest
    # the events reach the policy in order before it picks a victim for the next PUT
    assert c.request(p.PutRequest([b"new"], [4096], [p.checksum(b"new", val)]), [val]).msg.status == [0]
    present = c.request(p.ExistsRequest(keys[:3] + [b"new"])).msg.present
    assert present == [True, False, True, True]
    assert srv.stats()["evictions"] == 1
    c.close()


def test_leased_and_pinned_objects_are_not_evicted_and_a_full_pinned_arena_says_no_space(make_server):
    srv = make_server(capacity=8 * 4096, low_watermark=0.0, high_watermark=0.0)
    c = tcp.connect(srv.address, timeout_s=5)
    val = b"v" * 4096
    keys = [b"k%d" % i for i in range(8)]
    for k in keys:
        c.request(p.PutRequest([k], [4096], [p.checksum(k, val)]), [val])
    assert c.request(p.LookupRequest(keys, lease_ms=60_000)).msg.count == 8  # all leased
    st = c.request(p.PutRequest([b"x"], [4096], [p.checksum(b"x", val)]), [val]).msg.status
    assert st == [p.PutStatus.NO_SPACE]
    assert c.request(p.ExistsRequest(keys)).msg.present == [True] * 8
    assert c.request(p.DeleteRequest(keys[:1])).msg.deleted == 1  # delete still works on leased objects
    assert c.request(p.PutRequest([b"x"], [4096], [p.checksum(b"x", val)]), [val]).msg.status == [0]
    c.close()


def test_eviction_makes_room_for_a_stream_larger_than_the_arena(make_server):
    srv = make_server(capacity=1 * MiB)
    c = tcp.connect(srv.address, timeout_s=5)
    val = bytes(range(256)) * 256  # 64 KiB
    for i in range(64):  # 4 MiB through a 1 MiB arena
        assert c.request(p.PutRequest([b"s%d" % i], [len(val)], [p.checksum(b"s%d" % i, val)]), [val]).msg.status == [0]
    assert srv.stats()["evictions"] >= 48
    assert c.request(p.ExistsRequest([b"s63"])).msg.present == [True]
    assert srv._srv.check()
    c.close()


def test_auth(make_server):
    srv = make_server(auth_token="s3cret")
    with pytest.raises(RemoteError) as e:
        tcp.connect(srv.address, timeout_s=5, auth_token="wrong")
    assert e.value.code == ErrorCode.AUTH_FAILED
    c = tcp.connect(srv.address, timeout_s=5, auth_token="s3cret")
    assert c.request(p.PingRequest()).msg == p.PingReply()
    c.close()


def test_stats_report_the_data_plane_and_transports(server):
    c = tcp.connect(server.address, timeout_s=5)
    st = c.request(p.StatsRequest()).msg.stats
    assert st["transports"] == ["shm", "native", "tcp"] and st["policy"] == "lru"
    assert st["data_plane"].startswith("io_uring") and st["transports_in_use"]["tcp"] == 1
    for name in ("objects", "bytes_used", "capacity", "hits", "misses", "puts", "evictions", "checksum_failures",
                 "bytes_in", "bytes_out", "connections", "connections_total", "errors", "uptime_s", "server_id"):
        assert name in st
    c.close()


def test_zero_copy_sends_are_used_for_large_objects(make_server, server):
    if not server.stats()["zerocopy"]:
        pytest.skip("this kernel has no IORING_OP_SEND_ZC")
    c = tcp.connect(server.address, timeout_s=5)  # auto: loopback peers get copying sends
    val = b"z" * MiB
    c.request(p.PutRequest([b"big"], [MiB], [p.checksum(b"big", val)]), [val])
    assert c.request(p.GetRequest([b"big"])).payload == val
    assert server.stats()["zc_sends"] == 0
    c.close()
    server = make_server(zerocopy="on")  # forced: zero-copy even on loopback
    c = tcp.connect(server.address, timeout_s=5)
    val = b"z" * MiB
    c.request(p.PutRequest([b"big"], [MiB], [p.checksum(b"big", val)]), [val])
    buf = bytearray(MiB)
    assert c.request(p.GetRequest([b"big"]), recv_buffers=[buf]).msg.sizes == [MiB] and buf == val
    assert server.stats()["zc_sends"] >= 1
    assert wait_for(lambda: server.stats()["pinned"] == 0)  # released once the notification came
    c.close()


def test_forcing_zerocopy_where_it_is_missing_is_an_error_not_a_fallback(make_server, server):
    if server.stats()["zerocopy"]:
        pytest.skip("SEND_ZC exists here; nothing to refuse")
    with pytest.raises(TransportUnavailable):
        make_server(zerocopy="on")


def test_a_peer_stalling_mid_frame_is_dropped_and_its_slot_freed(make_server, open_raw):
    # 1 s: long enough that a loaded machine still sees the slot reserved before the stall drops it
    srv = make_server(stall_timeout_s=1.0)
    free = srv.stats()["free_bytes"]
    r = open_raw(srv.address)
    frame = put_frame(1, [b"slow"], [b"s" * 100000])
    r.send(frame[: len(frame) - 50000])  # header, metadata and half the object, then nothing
    assert wait_for(lambda: srv.stats()["free_bytes"] < free)  # a slot is reserved for it
    assert r.closed_by_peer()
    assert wait_for(lambda: srv.stats()["free_bytes"] == free)
    idle = open_raw(srv.address)  # an idle connection between requests is kept
    time.sleep(1.5)
    idle.send(p.encode_request(p.PingRequest(), 9))
    assert p.unpack_header(idle.recv_frame()).request_id == 9
    r.close()
    idle.close()


def test_watermarks_evict_ahead_of_demand(make_server):
    srv = make_server(capacity=64 * 4096, low_watermark=0.25, high_watermark=0.5)
    c = tcp.connect(srv.address, timeout_s=5)
    val = b"w" * 4096
    for i in range(52):  # 52 of 64 pages: free space drops below a quarter
        assert c.request(p.PutRequest([b"w%02d" % i], [4096], [p.checksum(b"w%02d" % i, val)]), [val]).msg.status == [0]
    # the control thread evicts back towards half free (PUTs racing with it may use some of it)
    assert wait_for(lambda: srv.stats()["evictions"] > 0 and srv.stats()["free_bytes"] >= 16 * 4096)
    present = c.request(p.ExistsRequest([b"w%02d" % i for i in range(52)])).msg.present
    k = present.count(False)
    assert k >= 4 and present == [False] * k + [True] * (52 - k)  # oldest first, no PUT waited for it
    c.close()


def test_auto_watermarks_keep_bounded_headroom():
    from kvfabric.server.native import AUTO_HIGH_BYTES, AUTO_LOW_BYTES, auto_watermarks

    assert auto_watermarks(256 << 20) == (0.05, 0.10)  # small arenas: 5% / 10%
    low, high = auto_watermarks(64 << 30)  # large arenas: 64 MiB / 128 MiB of 64 GiB
    assert (low * (64 << 30), high * (64 << 30)) == (AUTO_LOW_BYTES, AUTO_HIGH_BYTES)
    with pytest.raises(Exception, match="capacity"):
        auto_watermarks(0)


def test_command_line_default_evicts_ahead_of_demand():
    from kvfabric.testing.servers import start_server

    page = 64 << 10
    with start_server(capacity=str(64 * page), ) as srv:
        c = tcp.connect(srv.address, timeout_s=5)
        val = b"a" * page
        for i in range(64):  # exactly the capacity
            assert c.request(p.PutRequest([b"a%02d" % i], [page], [p.checksum(b"a%02d" % i, val)]), [val]).msg.status == [0]
        st = c.request(p.StatsRequest()).msg.stats
        # evicted oldest-first down towards 10% free, with no PUT parked waiting for room
        assert wait_for(lambda: c.request(p.StatsRequest()).msg.stats["evictions"] >= 3)
        present = c.request(p.ExistsRequest([b"a%02d" % i for i in range(64)])).msg.present
        k = present.count(False)
        assert k >= 3 and present == [False] * k + [True] * (64 - k)
        assert st["capacity"] == 64 * page
        c.close()
