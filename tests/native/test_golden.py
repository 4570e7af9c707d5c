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
        meta = bytes.fromhex(cases["shm_lease"]["request"])[p.HEADER_SIZE:]
        bufs = [bytearray(3), bytearray(1)]
        _, flags, rid, _ = native.shm_get(ours.fileno(), arena, 4, meta, bufs, 1 << 20)
        t.join(10)
        assert (flags, rid) == (p.FLAG_REPLY, 4) and bytes(bufs[0]) == native_golden.ABC
        assert seen == ["shm_reserve", "shm_commit", "shm_lease", "shm_release"]
    finally:
        ours.close()
        theirs.close()
