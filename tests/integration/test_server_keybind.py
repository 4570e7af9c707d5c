"""Protocol 2: checksums bind keys, against both server kinds (real server processes).

Before protocol 2 an object's checksum covered its value only, so one key
could be made to carry another key's bytes with a valid checksum (by a client
sending them with that key's checksum, or by a key altered on the wire), and
since the first writer of a key wins, the poisoned key stayed poisoned. Here each server refuses such a PUT
(status CHECKSUM_MISMATCH, counted in STATS ``checksum_rejects``), stores
nothing, and later serves the honest writer's bytes; a key altered on the wire
is refused on PUT and turns into a miss on GET; a protocol-1 peer gets
BAD_VERSION; a client refuses a server of another version.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import xxhash

from kvfabric import Client, ClientConfig, transport
from kvfabric import protocol as P
from kvfabric.errors import ErrorCode, KVFabricError
from kvfabric.testing.conformance import SERVER_KINDS, server_kind_unavailable, start_pool_of
from kvfabric.testing.proxy import FrameProxy


@pytest.fixture(scope="module", params=sorted(SERVER_KINDS))
def server(request):
    kind = request.param
    if (why := server_kind_unavailable(kind)) is not None:
        pytest.skip(why)
    with start_pool_of(kind, 1, capacity="32MiB") as pool:
        yield pool[0]
        assert pool[0].alive


# ------------------------------------------------------------------ raw frames


def frame(op: int, meta: dict, payload: bytes = b"", *, rid: int = 9, version: int = P.VERSION) -> bytes:
    m = P.encode_meta(meta)
    return P.HEADER.pack(P.MAGIC, version, op, 0, rid, len(m), len(payload), 0) + m + payload


def connect(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(s: socket.socket) -> tuple[int, P.Header, dict, bytes]:
    """(wire version, header, meta, payload) of the next frame; the version is read before it is checked."""
    head = recv_exact(s, P.HEADER_SIZE)
    version = P.HEADER.unpack_from(head)[1]
    h = P.unpack_header(head)
    meta = P.decode_meta(recv_exact(s, h.meta_len)) if h.meta_len else {}
    return version, h, meta, recv_exact(s, h.payload_len) if h.payload_len else b""


def request(s: socket.socket, op: int, meta: dict, payload: bytes = b"", rid: int = 9) -> tuple[dict, bytes]:
    s.sendall(frame(op, meta, payload, rid=rid))
    _, h, rmeta, rpayload = read_frame(s)
    assert h.request_id == rid and not h.is_error, rmeta
    return rmeta, rpayload


def put(s: socket.socket, key: bytes, value: bytes, csum: int) -> int:
    meta, _ = request(s, P.Op.PUT, {"keys": [key], "sizes": [len(value)], "checksums": [csum]}, value)
    return meta["status"][0]


def get(s: socket.socket, key: bytes) -> tuple[int, int, bytes]:
    meta, payload = request(s, P.Op.GET, {"keys": [key]})
    return meta["sizes"][0], meta["checksums"][0], payload


def rejects(s: socket.socket) -> int:
    return request(s, P.Op.STATS, {})[0]["checksum_rejects"]


def expect_closed(s: socket.socket) -> None:
    s.settimeout(10)
    try:
        assert s.recv(1) == b"", "server kept the connection open"
    except ConnectionResetError:
        pass


# ------------------------------------------------------------------ poisoned keys


def test_poisoned_key_is_refused_counted_and_the_honest_writer_stores_it(server):
    a, b = os.urandom(16), os.urandom(16)
    va, vb = os.urandom(5000), os.urandom(7000)
    with connect(server) as s:
        before = rejects(s)
        # a client sends B's bytes under A, with B's checksum (protocol 2) or the value-only one (protocol 1)
        assert put(s, a, vb, P.checksum(b, vb)) == P.PutStatus.CHECKSUM_MISMATCH
        assert put(s, a, vb, xxhash.xxh3_64_intdigest(vb)) == P.PutStatus.CHECKSUM_MISMATCH
        assert rejects(s) == before + 2
        assert request(s, P.Op.EXISTS, {"keys": [a]})[0]["present"] == [False]
        assert get(s, a) == (-1, 0, b"")  # nothing was planted
        # the honest writer then stores A, and A serves A's bytes under A's checksum
        assert put(s, a, va, P.checksum(a, va)) == P.PutStatus.STORED
        assert get(s, a) == (len(va), P.checksum(a, va), va)
        assert rejects(s) == before + 2  # an honest PUT is not a reject
        # B's own bytes still go in under B
        assert put(s, b, vb, P.checksum(b, vb)) == P.PutStatus.STORED
        assert get(s, b) == (len(vb), P.checksum(b, vb), vb)


def test_a_poisoned_object_in_a_batch_does_not_spoil_the_others(server):
    keys = [os.urandom(16) for _ in range(3)]
    vals = [os.urandom(3000 + i) for i in range(3)]
    sums = [P.checksum(k, v) for k, v in zip(keys, vals)]
    sums[1] = P.checksum(keys[0], vals[1])  # object 1 claims key 0's binding
    with connect(server) as s:
        before = rejects(s)
        meta, _ = request(s, P.Op.PUT, {"keys": keys, "sizes": [len(v) for v in vals], "checksums": sums},
                          b"".join(vals))
        assert meta["status"] == [P.PutStatus.STORED, P.PutStatus.CHECKSUM_MISMATCH, P.PutStatus.STORED]
        assert rejects(s) == before + 1
        assert [get(s, k)[0] for k in keys] == [len(vals[0]), -1, len(vals[2])]


# ------------------------------------------------------------------ keys altered on the wire


class KeyRewritingProxy(FrameProxy):
    """A loopback TCP proxy that rewrites the first key of each PUT or GET request in transit.

    ``rewrite[old] = new`` (same length) names the keys to swap. The request's
    metadata is re-encoded with the new key (checksums untouched, as a bit
    flip on the wire would leave them); replies pass through untouched.
    """

    parse_requests = True

    def __init__(self, target: str) -> None:
        self.rewrite: dict[bytes, bytes] = {}
        self.rewritten = 0
        super().__init__(target)

    def request_frame(self, h, head, meta):
        if h.opcode in (P.Op.PUT, P.Op.GET):
            m = P.decode_meta(meta)
            new = self.rewrite.get(m["keys"][0])
            if new is not None:
                m["keys"][0] = new
                self.rewritten += 1
                meta = P.encode_meta(m)
                head = P.pack_header(h.opcode, h.request_id, len(meta), h.payload_len, h.flags)
        return head, meta


@pytest.fixture
def proxy(server):
    p = KeyRewritingProxy(server.address)
    yield p
    p.close()


def _client(address: str) -> Client:
    return Client([address], config=ClientConfig(transport="tcp", timeout_s=10.0, connect_timeout_s=5.0))


def test_a_key_flipped_in_a_put_frame_is_refused(server):
    """A raw frame whose key bytes were flipped after its checksum was computed for the original key."""
    key, value = os.urandom(16), os.urandom(4096)
    flipped = bytes([key[0] ^ 0x01]) + key[1:]
    good = frame(P.Op.PUT, {"keys": [key], "sizes": [len(value)], "checksums": [P.checksum(key, value)]}, value)
    at = good.index(key)
    bad = good[:at] + flipped + good[at + len(key):]  # same length: header untouched
    with connect(server) as s:
        before = rejects(s)
        s.sendall(bad)
        _, h, meta, _ = read_frame(s)
        assert not h.is_error and meta["status"] == [P.PutStatus.CHECKSUM_MISMATCH]
        assert rejects(s) == before + 1
        assert get(s, flipped)[0] == -1 and get(s, key)[0] == -1
        s.sendall(good)  # the same frame unaltered is stored
        assert read_frame(s)[2]["status"] == [P.PutStatus.STORED]
        assert get(s, key)[2] == value


def test_a_client_put_whose_key_is_altered_on_the_wire_stores_nothing(server, proxy):
    key, other = os.urandom(16), os.urandom(16)
    value = os.urandom(10_000)
    proxy.rewrite[key] = other
    with _client(proxy.address) as via_proxy, _client(server.address) as direct:
        before = direct.stats()["servers"][server.address]["checksum_rejects"]
        res = via_proxy.put([key], [value])
        assert proxy.rewritten == 1
        assert res.stored == 0 and res.dropped == 1
        assert direct.exists([key, other]) == [False, False]
        assert direct.stats()["servers"][server.address]["checksum_rejects"] == before + 1
        assert direct.put([key], [value]).stored == 1  # the honest, unaltered PUT
        assert direct.get([key]) == [value]


def test_a_client_get_whose_key_is_altered_on_the_wire_is_a_miss(server, proxy):
    """Protocol 1 served B's bytes as A's here (their checksum covered the value only)."""
    a, b = os.urandom(16), os.urandom(16)
    va, vb = os.urandom(6000), os.urandom(6000)
    with _client(server.address) as direct, _client(proxy.address) as via_proxy:
        assert direct.put([a, b], [va, vb]).stored == 2
        proxy.rewrite[a] = b  # a GET of A reaches the server as a GET of B
        assert via_proxy.get([a]) == [None]
        assert proxy.rewritten == 2  # asked again, with the server checking: B's bytes again
        assert via_proxy.stats()["client"]["checksum_failures"] == 2
        buf = bytearray(6000)
        assert via_proxy.get_into([a], [buf]) == [None]
        assert via_proxy.stats()["client"]["checksum_failures"] == 4
        del proxy.rewrite[a]
        assert via_proxy.get([a, b]) == [va, vb]


# ------------------------------------------------------------------ versions


@pytest.mark.parametrize("header_version, hello_version", [(1, 1), (2, 2), (3, 1), (3, 2), (2, 3)])
def test_an_older_protocols_hello_gets_bad_version(server, header_version, hello_version):
    with connect(server) as s:
        s.sendall(frame(P.Op.HELLO, {"version": hello_version, "client": "old", "transports": ["tcp"]},
                        rid=3, version=header_version))
        version, h, meta, _ = read_frame(s)
        assert version == 3 and h.is_error and h.request_id == 3
        assert meta["code"] == ErrorCode.BAD_VERSION
        assert meta["message"] == "this server speaks protocol 3: HELLO proves both sides hold the pool token"
        expect_closed(s)


class _OldServer:
    """Answers one HELLO the way a server of another protocol version would, then closes."""

    def __init__(self, header_version: int, hello_version: int) -> None:
        self._ls = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._ls.getsockname()[1]}"
        self._versions = header_version, hello_version
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            c, _ = self._ls.accept()
        except OSError:
            return
        with c:
            head = recv_exact(c, P.HEADER_SIZE)
            h = P.HEADER.unpack_from(head)
            recv_exact(c, h[5])
            reply = P.HelloReply(server="old", server_id="old", transports=("tcp",), limits=P.DEFAULT_LIMITS,
                                 capacity=1 << 20, version=self._versions[1])
            m = P.encode_meta(reply.to_meta())
            c.sendall(P.HEADER.pack(P.MAGIC, self._versions[0], P.Op.HELLO, P.FLAG_REPLY, h[4], len(m), 0, 0) + m)
            try:
                c.recv(1)
            except OSError:
                pass

    def close(self) -> None:
        self._ls.close()


@pytest.mark.parametrize("tname", ["tcp", "native"])
@pytest.mark.parametrize("header_version, hello_version", [(1, 1), (2, 2), (3, 2)])
def test_the_client_refuses_a_server_of_another_version(tname, header_version, hello_version):
    """No server of an older protocol can run here: a socket answers HELLO as one would."""
    if tname not in transport.available():
        pytest.skip(f"transport {tname!r} unavailable here: {transport.unavailable().get(tname)}")
    old = _OldServer(header_version, hello_version)
    try:
        with pytest.raises(KVFabricError) as ei:
            transport.connect(tname, old.address, ClientConfig(connect_timeout_s=5.0))
        assert ei.value.code == ErrorCode.BAD_VERSION
        msg = str(ei.value)
        assert f"protocol {hello_version if header_version == 3 else header_version}" in msg, msg
        assert "protocol 3" in msg, msg
    finally:
        old.close()
