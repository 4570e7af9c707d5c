"""Golden wire vectors, checked against both implementations.

golden_frames.json pins the bytes; kvfabric.protocol must still encode them, and the
C server must answer the golden requests with exactly the golden replies.
"""

import json
import mmap
import os
import pathlib
import socket
import threading
import time

import native_golden
import pytest
import xxhash

from kvfabric import protocol as p

native = pytest.importorskip("kvfabric._native")

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden_frames.json").read_text())


def test_python_still_encodes_the_golden_bytes():
    assert native_golden.frames() == GOLDEN


@pytest.mark.parametrize("case", GOLDEN["checksums"], ids=lambda c: f"{len(c['data']) // 2}B")
def test_xxh3_64_is_the_same_in_c_and_python(case):
    data = bytes.fromhex(case["data"])
    assert native.xxh3_64(data) == xxhash.xxh3_64_intdigest(data) == case["xxh3_64"]


@pytest.mark.parametrize("case", GOLDEN["object_checksums"], ids=lambda c: f"{len(c['data']) // 2}B")
def test_object_checksum_is_the_same_in_c_and_python(case):
    key, data = bytes.fromhex(case["key"]), bytes.fromhex(case["data"])
    want = case["checksum"]
    assert p.checksum(key, data) == want
    assert want == xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(key))  # the spec, spelled out
    assert native.obj_checksum(key, data) == want  # one-shot
    assert native.obj_checksum(key, data, 7) == want  # streamed, as a PUT is hashed while it arrives


def test_c_server_answers_with_the_golden_bytes(raw):
    for case in GOLDEN["cases"]:
        raw.send(bytes.fromhex(case["request"]))
        assert raw.recv_frame().hex() == case["reply"], case["name"]


def test_c_error_reply_decodes_like_the_golden_one(raw):
    golden = bytes.fromhex(GOLDEN["error_unknown_opcode"])
    raw.send(p.pack_header(99, 7, 1, 0) + p.encode_meta({}))
    got = raw.recv_frame()
    assert got[: p.HEADER_SIZE - 12] == golden[: p.HEADER_SIZE - 12]  # magic..request_id
    h = p.unpack_header(got)
    err = p.ErrorReply.from_meta(p.decode_meta(got[p.HEADER_SIZE:]))
    gh = p.unpack_header(golden)
    gerr = p.ErrorReply.from_meta(p.decode_meta(golden[p.HEADER_SIZE:]))
    assert (h.flags, h.payload_len, err.code) == (gh.flags, gh.payload_len, gerr.code)
    raw.send(bytes.fromhex(GOLDEN["cases"][0]["request"]))  # still usable afterwards
    assert raw.recv_frame().hex() == GOLDEN["cases"][0]["reply"]


def test_c_server_answers_the_shm_conversation_with_the_golden_bytes(server):
    """The shm opcodes on the unix socket: typed messages in, golden bytes out (parents included)."""
    assert server.capacity == native_golden.SHM_CAPACITY
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(server.shm_socket)
    arena = None

    def recv_exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            more = sock.recv(n - len(buf))
            assert more, "closed"
            buf += more
        return buf

    try:
        for case in GOLDEN["shm_cases"]:
            if case["name"] == "shm_commit":  # the client copies the object into its reserved slot
                arena[0:3] = native_golden.ABC
            sock.sendall(bytes.fromhex(case["request"]))
            if case["reply"] is None:
                continue
            if case["name"] == "shm_attach":
                head, fds, _, _ = socket.recv_fds(sock, p.HEADER_SIZE, 1)
                head += recv_exact(p.HEADER_SIZE - len(head))
                assert len(fds) == 1
                arena = mmap.mmap(fds[0], server.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                for fd in fds:
                    os.close(fd)
            else:
                head = recv_exact(p.HEADER_SIZE)
            h = p.unpack_header(head)
            got = head + recv_exact(h.meta_len + h.payload_len)
            assert got.hex() == case["reply"], case["name"]
    finally:
        if arena is not None:
            arena.close()
        sock.close()


def test_c_shm_client_sends_the_golden_frames():
    """The one-call C client (kvf_client.c kvf_shm_get / kvf_shm_put) builds RELEASE and COMMIT itself:
    replayed against the golden replies, every frame it sends is the golden request byte for byte."""
    cases = {c["name"]: c for c in GOLDEN["shm_cases"]}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.settimeout(10)
    arena = bytearray(native_golden.SHM_CAPACITY)
    seen: list[str] = []

    def serve(names):
        for name in names:
            want = bytes.fromhex(cases[name]["request"])
            got = b""
            while len(got) < len(want):
                more = theirs.recv(len(want) - len(got))
                assert more
                got += more
            seen.append(name if got == want else f"{name}: got {got.hex()}")
            if cases[name]["reply"] is not None:
                theirs.sendall(bytes.fromhex(cases[name]["reply"]))

    try:
        t = threading.Thread(target=serve, args=(["shm_reserve", "shm_commit"],))
        t.start()
        reserve = cases["shm_reserve"]
        meta = bytes.fromhex(reserve["request"])[p.HEADER_SIZE:]
        sums = [p.checksum(native_golden.K1, native_golden.ABC), p.checksum(native_golden.K2, b"")]
        _, flags, rid, _ = native.shm_put(ours.fileno(), arena, 2, meta, [3, 0], sums, [native_golden.ABC], 1 << 20)
        t.join(10)
        assert (flags, rid) == (p.FLAG_REPLY, 3) and arena[:3] == native_golden.ABC
        t = threading.Thread(target=serve, args=(["shm_lease", "shm_release"],))
        t.start()
        bufs = [bytearray(3), bytearray(1)]
        _, flags, rid, _, sizes, sums = native.shm_get(ours.fileno(), arena, 4, [native_golden.K1, native_golden.MISSING],
                                                       bufs, 1 << 20, 1 << 20)
        t.join(10)
        assert (flags, rid) == (p.FLAG_REPLY, 4) and bytes(bufs[0]) == native_golden.ABC
        lease = p.decode_reply(p.unpack_header(bytes.fromhex(cases["shm_lease"]["reply"])[:p.HEADER_SIZE]),
                               bytes.fromhex(cases["shm_lease"]["reply"])[p.HEADER_SIZE:], p.ShmOp.LEASE)
        assert (sizes, sums) == (list(lease.sizes), list(lease.checksums))  # parsed in C as Python decodes it
        assert seen == ["shm_reserve", "shm_commit", "shm_lease", "shm_release"]
    finally:
        ours.close()
        theirs.close()


def _lease_reply_to(meta: bytes, flags: int = p.FLAG_REPLY, arena_len: int = 4096, bufs=None):
    """Run ``native.shm_get`` of two keys against a peer that answers its LEASE with ``meta``; returns
    (what shm_get returned or raised, the frames the peer got after the LEASE: (opcode, rid) each)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.settimeout(10)
    after: list[tuple[int, int]] = []

    def recv_exact(n):
        got = b""
        while len(got) < n:
            more = theirs.recv(n - len(got))
            if not more:
                return None
            got += more
        return got

    def peer():
        h = p.unpack_header(recv_exact(p.HEADER_SIZE))
        recv_exact(h.meta_len)
        theirs.sendall(p.pack_header(h.opcode, h.request_id, len(meta), 0, flags) + meta)
        head = recv_exact(p.HEADER_SIZE)  # RELEASE, the last frame a GET sends, or the end of the stream
        if head is not None:
            h = p.unpack_header(head)
            recv_exact(h.meta_len)
            after.append((h.opcode, h.request_id))

    t = threading.Thread(target=peer)
    t.start()
    try:
        res = native.shm_get(ours.fileno(), bytearray(arena_len), 8, [native_golden.K1, native_golden.MISSING],
                             bufs or [bytearray(16), bytearray(16)], 1 << 20, 64, time.monotonic() + 10)
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        res = e
    finally:
        ours.shutdown(socket.SHUT_WR)
        t.join(10)
        ours.close()
        theirs.close()
    return res, after


def _lease(**over):
    fields = {"lease": 5, "offsets": [0, -1], "sizes": [3, -1], "checksums": [7, 0]}
    fields.update(over)
    return p.encode_meta(fields)


def test_c_shm_get_parses_the_lease_reply_as_python_does():
    """C writes the LEASE request and parses its reply: a good reply comes back as sizes and checksums,
    and the lease is released (rid + 1)."""
    res, after = _lease_reply_to(_lease())
    assert not isinstance(res, Exception), res
    assert res[4:] == ([3, -1], [7, 0]) and after == [(p.ShmOp.RELEASE, 9)]


@pytest.mark.parametrize("meta", [
    _lease(sizes=[3, -2]),                      # below -1
    _lease(sizes=[65, -1]),                     # over the max object (64 here)
    _lease(offsets=[4094, -1]),                 # object past the arena's end
    _lease(offsets=[-2, -1]),                   # offset below -1
    _lease(sizes=[3]),                          # one size for two keys
    _lease(checksums=[7, -1]),                  # a checksum is a uint64
    p.encode_meta({"lease": 5, "offsets": [0, -1], "sizes": [3, -1]}),  # no checksums
    b"\x82\xa5lease\x05\xa5lease\x06",          # one key twice
    _lease()[:-1],                              # truncated
], ids=["size-2", "size-over-max", "past-arena", "offset-2", "short-sizes", "negative-sum", "no-checksums",
        "key-twice", "truncated"])
def test_c_shm_get_refuses_a_malformed_lease_reply(meta):
    """Every check ShmLeaseReply.from_meta makes, C makes: a malformed reply raises ProtocolError
    (MALFORMED) and copies nothing."""
    bufs = [bytearray(16), bytearray(16)]
    res, _ = _lease_reply_to(meta, bufs=bufs)
    assert isinstance(res, p.ProtocolError) and res.code == p.ErrorCode.MALFORMED, res
    assert bufs == [bytearray(16), bytearray(16)]


def test_c_shm_get_hands_an_error_reply_back_undecoded():
    """An error reply to the LEASE comes back as is (sizes and checksums None) for Python to raise."""
    err = p.encode_meta({"code": int(p.ErrorCode.BUSY), "message": "busy"})
    res, after = _lease_reply_to(err, flags=p.FLAG_REPLY | p.FLAG_ERROR)
    assert not isinstance(res, Exception), res
    assert res[4:] == (None, None) and res[3] == err and after == []
