"""Bad input against a real ``kvfabric serve`` process, with raw sockets.

Each case sends a deliberately broken frame, checks the answer (an error
reply with its stable code, and/or a closed connection), then checks that the
server still serves a second connection (PING, PUT, GET verified).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvfabric import protocol as P
from kvfabric.errors import ErrorCode
from kvfabric.testing import start_server, wait_for

STALL_S = 0.5


@pytest.fixture(scope="module", params=["native", "reference"])
def server(request):
    """The product server and the Python reference, each answering every case the same way."""
    args = ["--stall-timeout", str(STALL_S), "--min-rate", "64KiB"]
    module = "kvfabric" if request.param == "native" else "kvfabric.testing.reference"
    with start_server(capacity="8MiB", extra_args=args, module=module) as srv:
        srv.kind = request.param
        yield srv
        assert srv.alive


# ------------------------------------------------------------------ raw frame helpers


def frame(op: int, meta: dict | bytes = b"\x80", payload: bytes = b"", *, rid: int = 7, magic: bytes = P.MAGIC,
          version: int = P.VERSION, flags: int = 0, meta_len: int | None = None, payload_len: int | None = None,
          reserved: int = 0) -> bytes:
    m = P.encode_meta(meta) if isinstance(meta, dict) else meta
    head = P.HEADER.pack(magic, version, op, flags, rid, len(m) if meta_len is None else meta_len,
                         len(payload) if payload_len is None else payload_len, reserved)
    return head + m + payload


def connect(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None if not buf else bytes(buf)
        buf += chunk
    return bytes(buf)


def read_frame(s: socket.socket):
    """(header, meta, payload) of the next frame, or None when the server closed the connection."""
    raw = recv_exact(s, P.HEADER_SIZE)
    if raw is None:
        return None
    assert len(raw) == P.HEADER_SIZE, "server closed mid-header"
    header = P.unpack_header(raw)
    meta = P.decode_meta(recv_exact(s, header.meta_len) or b"") if header.meta_len else {}
    payload = recv_exact(s, header.payload_len) if header.payload_len else b""
    return header, meta, payload


def expect_error(s: socket.socket, code: ErrorCode, rid: int = 7) -> None:
    f = read_frame(s)
    assert f is not None, "expected an error reply, the server closed instead"
    header, meta, _ = f
    assert header.is_reply and header.is_error
    assert header.request_id == rid
    assert meta["code"] == code, meta
    assert isinstance(meta["message"], str) and meta["message"]


def expect_closed(s: socket.socket) -> None:
    s.settimeout(10)
    try:
        assert s.recv(1) == b"", "server kept the connection open"
    except ConnectionResetError:
        pass  # closed with our unread bytes in its buffer: also closed


def request(s: socket.socket, op: int, meta: dict, payload: bytes = b"", rid: int = 9):
    s.sendall(frame(op, meta, payload, rid=rid))
    f = read_frame(s)
    assert f is not None
    header, rmeta, rpayload = f
    assert header.request_id == rid and not header.is_error, rmeta
    return rmeta, rpayload


def assert_serving(server) -> None:
    """A fresh connection can PING, PUT and GET (bytes verified)."""
    with connect(server) as s:
        request(s, P.Op.PING, {})
        data = os.urandom(5000)
        key = os.urandom(16)
        meta, _ = request(s, P.Op.PUT, {"keys": [key], "sizes": [len(data)], "checksums": [P.checksum(key, data)]}, data)
        assert meta["status"] == [P.PutStatus.STORED]
        meta, payload = request(s, P.Op.GET, {"keys": [key]})
        assert meta["sizes"] == [len(data)] and payload == data


def stats(server) -> dict:
    with connect(server) as s:
        meta, _ = request(s, P.Op.STATS, {})
    return meta


# ------------------------------------------------------------------ cases


def test_wrong_magic_gets_error_then_close(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {}, magic=b"HTTP"))
        expect_error(s, ErrorCode.BAD_MAGIC, rid=0)  # nothing in a bad-magic header is a request id
        expect_closed(s)
    assert_serving(server)


def test_plain_http_garbage(server):
    with connect(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 100)
        expect_error(s, ErrorCode.BAD_MAGIC, rid=0)
        expect_closed(s)
    assert_serving(server)


def test_wrong_version_gets_error_then_close(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {}, version=P.VERSION + 1))
        expect_error(s, ErrorCode.BAD_VERSION)
        expect_closed(s)
    assert_serving(server)


def test_nonzero_reserved_field_closes(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {}, reserved=1))
        expect_error(s, ErrorCode.MALFORMED)
        expect_closed(s)
    assert_serving(server)


def test_unknown_opcode_keeps_connection_usable(server):
    with connect(server) as s:
        s.sendall(frame(99, {}, b"z" * 1000))  # its payload is skipped
        expect_error(s, ErrorCode.UNKNOWN_OPCODE)
        request(s, P.Op.PING, {})
    assert_serving(server)


def test_malformed_metadata_keeps_connection_usable(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.EXISTS, b"\xc1\xc1\xc1"))  # not msgpack
        expect_error(s, ErrorCode.MALFORMED)
        s.sendall(frame(P.Op.EXISTS, b"\x92\x01\x02"))  # an array, not a map
        expect_error(s, ErrorCode.MALFORMED)
        s.sendall(frame(P.Op.GET, {"keys": "notalist"}))
        expect_error(s, ErrorCode.MALFORMED)
        for bad in (1, None, b"x", "yes"):  # LOOKUP media is a bool (issue 26 part 3)
            s.sendall(frame(P.Op.LOOKUP, {"keys": [b"k"], "media": bad}))
            expect_error(s, ErrorCode.MALFORMED)
        meta, _ = request(s, P.Op.LOOKUP, {"keys": [b"k"], "media": True})
        assert meta == {"count": 0, "media": b""}, meta
        request(s, P.Op.PING, {})
    assert_serving(server)


def test_bad_keys(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.GET, {"keys": [b""]}))
        expect_error(s, ErrorCode.BAD_KEY)
        s.sendall(frame(P.Op.EXISTS, {"keys": [b"x" * 65]}))
        expect_error(s, ErrorCode.BAD_KEY)
        s.sendall(frame(P.Op.DELETE, {"keys": ["a string"]}))
        expect_error(s, ErrorCode.BAD_KEY)
        request(s, P.Op.PING, {})
    assert_serving(server)


def test_too_many_keys_keeps_connection_usable(server):
    with connect(server) as s:
        keys = [i.to_bytes(4, "little") for i in range(P.MAX_KEYS_PER_BATCH + 1)]
        s.sendall(frame(P.Op.EXISTS, {"keys": keys}))
        expect_error(s, ErrorCode.TOO_MANY_KEYS)
        meta, _ = request(s, P.Op.EXISTS, {"keys": keys[: P.MAX_KEYS_PER_BATCH]})
        assert len(meta["present"]) == P.MAX_KEYS_PER_BATCH
    assert_serving(server)


def test_oversize_meta_len_closes_before_allocating(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, b"", meta_len=P.MAX_META_BYTES + 1))
        expect_error(s, ErrorCode.META_TOO_LARGE)
        expect_closed(s)
    assert_serving(server)


def test_oversize_payload_len_closes_before_allocating(server):
    before = server.rss_bytes()
    with connect(server) as s:
        s.sendall(frame(P.Op.PUT, {"keys": [b"k"], "sizes": [1 << 40], "checksums": [0]}, payload_len=1 << 40))
        expect_error(s, ErrorCode.PAYLOAD_TOO_LARGE)
        expect_closed(s)
    assert server.rss_bytes() < before + (64 << 20)  # nothing near 1 TiB was allocated
    assert_serving(server)


def test_object_larger_than_object_limit_closes(server):
    with connect(server) as s:
        size = P.MAX_OBJECT_BYTES + 1
        s.sendall(frame(P.Op.PUT, {"keys": [b"k"], "sizes": [size], "checksums": [0]}, payload_len=size))
        expect_error(s, ErrorCode.PAYLOAD_TOO_LARGE)
        expect_closed(s)
    assert_serving(server)


def test_inconsistent_lengths_close(server):
    with connect(server) as s:
        # sizes add up to 10 but the header announces 20
        s.sendall(frame(P.Op.PUT, {"keys": [b"k"], "sizes": [10], "checksums": [0]}, b"x" * 20))
        expect_error(s, ErrorCode.LENGTH_MISMATCH)
        expect_closed(s)
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {}, b"unexpected"))  # PING carries no payload
        expect_error(s, ErrorCode.LENGTH_MISMATCH)
        expect_closed(s)
    with connect(server) as s:
        s.sendall(frame(P.Op.PUT, {"keys": [b"a", b"b"], "sizes": [1], "checksums": [0, 0]}, b"x"))
        expect_error(s, ErrorCode.MALFORMED)  # sizes shorter than keys: metadata error, stream intact
        request(s, P.Op.PING, {})
    assert_serving(server)


def test_request_with_reply_flag_closes(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {}, flags=P.FLAG_REPLY))
        expect_error(s, ErrorCode.MALFORMED)
        expect_closed(s)
    assert_serving(server)


def test_truncated_header_then_close(server):
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {})[:10])
    with connect(server) as s:
        s.sendall(frame(P.Op.GET, {"keys": [b"abc"]})[: P.HEADER_SIZE + 3])  # truncated metadata
    assert_serving(server)


def test_payload_shorter_than_announced_frees_its_slot(server):
    allocated = stats(server)["bytes_allocated"]
    objects = stats(server)["objects"]
    data = os.urandom(1 << 20)
    with connect(server) as s:
        meta = {"keys": [b"short-1", b"short-2"], "sizes": [len(data), len(data)],
                "checksums": [P.checksum(b"short-1", data), P.checksum(b"short-2", data)]}
        # announces both objects, sends the second one cut short, then closes
        s.sendall(frame(P.Op.PUT, meta, data + data[:1000], payload_len=2 * len(data)))
    # the first object was complete and is stored; the cut one's slot is given back
    st = wait_for(lambda: (lambda st: st if st["connections"] == 1 else None)(stats(server)))
    assert st["objects"] == objects + 1
    assert st["bytes_allocated"] == allocated + len(data)
    assert_serving(server)


def test_stall_mid_header_is_dropped(server):
    before = stats(server)["stalled_connections"]
    with connect(server) as s:
        s.sendall(frame(P.Op.PING, {})[:5])
        expect_closed(s)  # after the stall timeout
        assert_serving(server)
    assert stats(server)["stalled_connections"] == before + 1


def test_stall_mid_payload_is_dropped_and_slot_freed(server):
    allocated = stats(server)["bytes_allocated"]
    data = os.urandom(256 * 1024)
    with connect(server) as s:
        meta = {"keys": [b"stall"], "sizes": [len(data)], "checksums": [P.checksum(b"stall", data)]}
        s.sendall(frame(P.Op.PUT, meta, data[:1000], payload_len=len(data)))
        assert_serving(server)  # others are served while this one stalls
        expect_closed(s)
    st = wait_for(lambda: (lambda st: st if st["connections"] == 1 else None)(stats(server)))
    assert st["bytes_allocated"] == allocated + 8192  # only assert_serving's 5000-byte object (2 pages) was added
    with connect(server) as s:
        meta, _ = request(s, P.Op.EXISTS, {"keys": [b"stall"]})
        assert meta["present"] == [False]


def test_trickling_peer_is_dropped_at_the_frame_deadline(server):
    """One byte every 0.1 s never trips the no-progress timeout, but the frame deadline
    (stall timeout + size / min rate = 0.5 s + ~1 s here) ends it."""
    import select

    data = os.urandom(64 * 1024)
    with connect(server) as s:
        meta = {"keys": [b"trickle"], "sizes": [len(data)], "checksums": [P.checksum(b"trickle", data)]}
        head = frame(P.Op.PUT, meta, b"", payload_len=len(data))
        s.sendall(head)
        closed = False
        deadline = time.monotonic() + 30
        for i in range(len(data)):
            if time.monotonic() > deadline:
                break
            try:
                s.send(data[i : i + 1])
            except OSError:
                closed = True
                break
            if select.select([s], [], [], 0.1)[0]:
                try:
                    closed = s.recv(1) == b""
                except ConnectionResetError:
                    closed = True
                break
        assert closed, "a trickling peer kept its connection"
    assert_serving(server)


def test_bad_checksum_put_is_rejected_connection_usable(server):
    with connect(server) as s:
        data = b"q" * 3000
        meta, _ = request(s, P.Op.PUT, {"keys": [b"badsum"], "sizes": [3000], "checksums": [P.checksum(b"badsum", data) ^ 1]}, data)
        assert meta["status"] == [P.PutStatus.CHECKSUM_MISMATCH]
        meta, _ = request(s, P.Op.GET, {"keys": [b"badsum"]})
        assert meta["sizes"] == [-1]


def test_errors_are_counted_by_code(server):
    before = stats(server)["errors"]
    with connect(server) as s:
        s.sendall(frame(99, {}))
        expect_error(s, ErrorCode.UNKNOWN_OPCODE)
        s.sendall(frame(P.Op.PING, {}, magic=b"XXXX"))
        expect_error(s, ErrorCode.BAD_MAGIC, rid=0)
    after = stats(server)["errors"]
    for code in ("UNKNOWN_OPCODE", "BAD_MAGIC"):
        assert after.get(code, 0) == before.get(code, 0) + 1, (code, before, after)
