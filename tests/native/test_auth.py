"""Protocol 3's HELLO proofs and AUTH, frame by frame, against the C server and the reference server.

A server with a token proves it over the client's nonce in its HELLO reply; the client's AUTH proves
the client holds it over the server's fresh nonce; until then only HELLO and AUTH are served. The
token never crosses the wire, and a proof from one connection is worthless on the next.
"""

from __future__ import annotations

import json
import pathlib
import random
import socket

import msgpack
import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp

native = pytest.importorskip("kvfabric._native")

TOKEN = "s3cret-pool-token"
GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden_frames.json").read_text())


@pytest.fixture(params=["native", "reference"])
def auth_server(request, make_server):
    """(address, stats(), kind) of a server with TOKEN: the C server in this process, or the reference process."""
    if request.param == "native":
        srv = make_server(auth_token=TOKEN, server_id="pool-a")
        yield srv.address, srv.stats, "native"
        return
    with start_server(capacity="16MiB", module="kvfabric.testing.reference",
                      extra_args=["--auth-token", TOKEN, "--server-id", "pool-a"]) as srv:
        def stats() -> dict:
            with tcp.connect(srv.address, timeout_s=10, auth_token=TOKEN) as c:
                return c.request(p.StatsRequest()).msg.stats

        yield srv.address, stats, "reference"


def exchange(raw, msg: p.Message, rid: int = 1) -> tuple[p.Header, dict]:
    raw.send(p.encode_request(msg, rid))
    frame = raw.recv_frame()
    h = p.unpack_header(frame)
    return h, p.decode_meta(frame[p.HEADER_SIZE:p.HEADER_SIZE + h.meta_len])


def hello(raw, nonce: bytes | None = None) -> tuple[bytes, dict]:
    nonce = nonce or p.new_nonce()
    h, meta = exchange(raw, p.HelloRequest(client="test", nonce=nonce))
    assert not h.is_error, meta
    return nonce, meta


def test_c_hmac_reproduces_the_proof_vectors():
    """The fixed vectors (golden_frames.json, from kvfabric.protocol.auth) by C's kvf_hmac_sha256."""
    assert len(GOLDEN["hello_proofs"]) >= 3
    for v in GOLDEN["hello_proofs"]:
        key, nc, ns = v["token"].encode(), bytes.fromhex(v["client_nonce"]), bytes.fromhex(v["server_nonce"])
        got_s = native.hmac_sha256(key, p.auth.SERVER_LABEL, nc, ns, v["server_id"].encode()).hex()
        got_c = native.hmac_sha256(key, p.auth.CLIENT_LABEL, ns, nc).hex()
        assert (got_s, got_c) == (v["server_proof"], v["client_proof"]), v["token"]
        assert p.server_proof(v["token"], nc, ns, v["server_id"]).hex() == v["server_proof"]


def test_hello_reply_proves_the_token_with_fresh_nonces(auth_server, open_raw):
    address, _, _ = auth_server
    seen = set()
    for _ in range(2):
        raw = open_raw(address)
        nonce = bytes(range(32))  # the same client nonce twice: the server's own nonce still changes
        _, meta = hello(raw, nonce)
        assert meta["auth_required"] is True and meta["server_id"] == "pool-a" and meta["version"] == 3, meta
        assert len(meta["nonce"]) == 32 and meta["nonce"] not in seen
        seen.add(meta["nonce"])
        assert meta["proof"] == p.server_proof(TOKEN, nonce, meta["nonce"], "pool-a"), "the server's proof"
        h, ok = exchange(raw, p.AuthRequest(proof=p.client_proof(TOKEN, meta["nonce"], nonce)), 2)
        assert not h.is_error and h.opcode == p.Op.AUTH and ok == {}, ok
        h, _ = exchange(raw, p.PingRequest(), 3)
        assert not h.is_error and h.opcode == p.Op.PING


@pytest.mark.parametrize("op", [p.PingRequest(), p.StatsRequest(), p.ExistsRequest(keys=[b"k" * 16]),
                                p.GetRequest(keys=[b"k" * 16]), p.LookupRequest(keys=[b"k" * 16]),
                                p.DeleteRequest(keys=[b"k" * 16]), p.ShmAttachRequest()],
                         ids=lambda m: type(m).__name__)
def test_a_connection_that_skips_auth_can_do_nothing_else(auth_server, open_raw, op):
    address, stats, _ = auth_server
    before = stats()["errors"].get("AUTH_FAILED", 0)
    raw = open_raw(address)
    hello(raw)  # the server proved itself; this peer never answers with AUTH
    h, meta = exchange(raw, op, 2)
    assert h.is_error and meta["code"] == ErrorCode.AUTH_FAILED, meta
    assert raw.closed_by_peer()
    assert stats()["errors"]["AUTH_FAILED"] == before + 1


def test_a_put_before_auth_stores_nothing(auth_server, open_raw):
    address, stats, _ = auth_server
    raw = open_raw(address)
    hello(raw)
    key = b"p" * 16
    raw.send(p.encode_request(p.PutRequest(keys=[key], sizes=[1], checksums=[p.checksum(key, b"x")]), 2) + b"x")
    h, meta = p.unpack_header(frame := raw.recv_frame()), p.decode_meta(frame[p.HEADER_SIZE:])
    # refused on its header (pre-auth limits: no payload) or as unauthenticated: either way closed
    assert h.is_error and meta["code"] in (ErrorCode.AUTH_FAILED, ErrorCode.PAYLOAD_TOO_LARGE), meta
    assert raw.closed_by_peer()
    assert stats()["objects"] == 0


def test_wrong_or_missing_proof_is_auth_failed_and_closed(auth_server, open_raw):
    address, stats, _ = auth_server
    before = stats()["errors"].get("AUTH_FAILED", 0)
    for proof_meta in ({"proof": p.client_proof("not-the-token", b"\0" * 32, b"\0" * 32)}, {}, {"proof": b"\0" * 31}):
        raw = open_raw(address)
        nonce, meta = hello(raw)
        frame = p.encode_meta(proof_meta)
        raw.send(p.pack_header(p.Op.AUTH, 2, len(frame), 0) + frame)
        got = raw.recv_frame()
        h, err = p.unpack_header(got), p.decode_meta(got[p.HEADER_SIZE:])
        assert h.is_error and err["code"] == ErrorCode.AUTH_FAILED, (proof_meta, err)
        assert raw.closed_by_peer()
    assert stats()["errors"]["AUTH_FAILED"] == before + 3


def test_a_proof_replayed_from_an_earlier_connection_fails(auth_server, open_raw):
    address, _, _ = auth_server
    first = open_raw(address)
    nonce, meta = hello(first)
    recorded = p.client_proof(TOKEN, meta["nonce"], nonce)
    h, _ = exchange(first, p.AuthRequest(proof=recorded), 2)
    assert not h.is_error
    # an eavesdropper replays both of the first connection's frames verbatim
    second = open_raw(address)
    hello(second, nonce)
    h, err = exchange(second, p.AuthRequest(proof=recorded), 2)
    assert h.is_error and err["code"] == ErrorCode.AUTH_FAILED, "a recorded proof must not authenticate again"
    assert second.closed_by_peer()
    # and one AUTH per HELLO: the first connection's right proof, sent again, answers no HELLO any more
    h, err = exchange(first, p.AuthRequest(proof=recorded), 3)
    assert h.is_error and err["code"] == ErrorCode.AUTH_FAILED, err


def test_hello_needs_a_32_byte_nonce_and_protocol_3(auth_server, open_raw):
    address, _, _ = auth_server
    for meta in ({"version": 3, "client": "x", "transports": []},
                 {"version": 3, "client": "x", "transports": [], "nonce": b"\0" * 16}):
        raw = open_raw(address)
        body = p.encode_meta(meta)
        raw.send(p.pack_header(p.Op.HELLO, 1, len(body), 0) + body)
        got = raw.recv_frame()
        assert p.decode_meta(got[p.HEADER_SIZE:])["code"] == ErrorCode.MALFORMED
    raw = open_raw(address)  # a protocol-2 client's HELLO (the token in clear) in a version-3 header
    body = p.encode_meta({"version": 2, "client": "x", "transports": [], "auth": TOKEN})
    raw.send(p.pack_header(p.Op.HELLO, 1, len(body), 0) + body)
    err = p.decode_meta(raw.recv_frame()[p.HEADER_SIZE:])
    assert (err["code"], err["message"]) == (ErrorCode.BAD_VERSION, p.BAD_VERSION_MESSAGE)
    assert raw.closed_by_peer()


@pytest.mark.parametrize("kind", ["native", "reference"])
def test_a_server_without_a_token_says_so_and_answers_auth_malformed(kind, make_server, open_raw):
    if kind == "native":
        address = make_server().address
        ctx = None
    else:
        ctx = start_server(capacity="16MiB", module="kvfabric.testing.reference")
        address = ctx.address
    try:
        raw = open_raw(address)
        _, meta = hello(raw)
        assert meta["auth_required"] is False and "nonce" not in meta and "proof" not in meta, meta
        h, err = exchange(raw, p.AuthRequest(proof=b"\0" * 32), 2)
        assert h.is_error and err["code"] == ErrorCode.MALFORMED and "no pool token" in err["message"], err
        h, _ = exchange(raw, p.PingRequest(), 3)  # not fatal: the connection is still served
        assert not h.is_error
    finally:
        if ctx is not None:
            ctx.kill()


def test_the_native_server_logs_refused_peers_with_their_address(make_server, open_raw, caplog):
    srv = make_server(auth_token=TOKEN)
    with caplog.at_level("WARNING", logger="kvfabric.server.native"):
        raw = open_raw(srv.address)
        nonce, meta = hello(raw)
        exchange(raw, p.AuthRequest(proof=b"\1" * 32), 2)
        local = "%s:%d" % raw.sock.getsockname()[:2]
        assert wait_for(lambda: any(local in r.getMessage() and "AUTH_FAILED" in r.getMessage()
                                    for r in caplog.records), timeout_s=30), [r.getMessage() for r in caplog.records]


def test_the_reference_server_logs_refused_peers_with_their_address(open_raw):
    with start_server(capacity="16MiB", module="kvfabric.testing.reference", extra_args=["--auth-token", TOKEN]) as srv:
        raw = open_raw(srv.address)
        hello(raw)
        exchange(raw, p.AuthRequest(proof=b"\1" * 32), 2)
        local = "%s:%d" % raw.sock.getsockname()[:2]
        assert wait_for(lambda: local in srv.stderr_text(), timeout_s=30), srv.stderr_text()
        assert "AUTH_FAILED" in srv.stderr_text()


def test_a_server_without_a_token_warns_once_at_start_up():
    for module in ("kvfabric", "kvfabric.testing.reference"):
        with start_server(capacity="16MiB", module=module) as srv:
            log = srv.stderr_text()
        assert log.count("no --auth-token: any peer that can reach this server's port can read and write") == 1, log
    with start_server(capacity="16MiB", extra_args=["--auth-token", TOKEN]) as srv:
        assert "no --auth-token" not in srv.stderr_text()


def _fuzzed(rng: random.Random, nonce: bytes, server_nonce: bytes) -> bytes:
    """A HELLO or AUTH frame, mutated: fields dropped, resized, retyped, bytes flipped, truncated."""
    if rng.random() < 0.5:
        meta = {"version": rng.choice([3, 3, 3, 2, -1, "3"]), "client": rng.choice(["x", 5, None]),
                "transports": rng.choice([["tcp"], ["native"] * 20, "tcp", [1]]),
                "nonce": rng.choice([nonce, nonce[:rng.randint(0, 31)], nonce + b"x", "n" * 32, None, 7])}
        op = p.Op.HELLO
    else:
        proof = p.client_proof(TOKEN, server_nonce, nonce)
        meta = {"proof": rng.choice([proof, bytes(a ^ 1 for a in proof), proof[:16], proof * 2, None, "p" * 32])}
        op = p.Op.AUTH
    for k in [k for k in meta if rng.random() < 0.15]:
        del meta[k]
    body = msgpack.packb(meta, use_bin_type=True)
    if rng.random() < 0.2:
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] = rng.getrandbits(8)
        body = bytes(b)
    if rng.random() < 0.1:
        body = body[:rng.randint(0, len(body))]
    frame = p.pack_header(op, rng.getrandbits(64), len(body), rng.choice([0, 0, 0, 0, 1, 5000])) + body
    if rng.random() < 0.05:
        frame = frame[:rng.randint(0, len(frame))]
    return frame


def test_fuzzed_hello_and_auth_frames_never_hurt_the_c_server():
    """Seeded: 300 mutated HELLO/AUTH frames over 100 connections to a `kvfabric serve` with a token; then a
    fresh connection still authenticates and answers PING, nothing authenticated by accident, RSS bounded."""
    rng = random.Random(22)
    with start_server(capacity="16MiB", extra_args=["--auth-token", TOKEN]) as srv:
        rss0 = srv.rss_bytes()
        authed_by_accident = 0
        for _ in range(100):
            with socket.create_connection((srv.host, srv.port), timeout=5) as s:
                s.settimeout(5)
                try:
                    nonce = p.new_nonce()
                    server_nonce = b"\0" * 32
                    for _ in range(3):
                        s.sendall(_fuzzed(rng, nonce, server_nonce))
                    s.sendall(p.encode_request(p.PingRequest(), 99))
                    s.shutdown(socket.SHUT_WR)
                    got = b""
                    while chunk := s.recv(65536):
                        got += chunk
                    # PING is answered only on an authenticated connection: the fuzz never knew the server nonce
                    authed_by_accident += p.encode_reply(p.PingReply(), 99) in got
                except OSError:
                    pass
        assert authed_by_accident == 0
        with tcp.connect(srv.address, timeout_s=10, auth_token=TOKEN) as c:
            assert c.request(p.PingRequest()).msg == p.PingReply()
            st = c.request(p.StatsRequest()).msg.stats
        assert st["errors"].get("AUTH_FAILED", 0) > 0 and st["errors"].get("MALFORMED", 0) > 0, st["errors"]
        assert srv.alive
        assert srv.rss_bytes() < rss0 + (32 << 20), (rss0, srv.rss_bytes())
