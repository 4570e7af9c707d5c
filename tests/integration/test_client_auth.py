"""Protocol 3 from the Client's side, on every (server kind, transport) pair: a server is used only
once it proved it holds the pool token, and a server that cannot is refused, counted, and costs misses.

The forged-member finding of issue 22: a server that etcd (or a config) names but that does not hold
the token must get no key, PUT, GET or LOOKUP, and never see the token. ``FakeServer`` is that server:
a plain listening socket that records every byte it receives and answers each HELLO without a valid
proof (claiming no token is needed, with a made-up proof, or replaying a real server's reply).
"""

from __future__ import annotations

import logging
import socket
import threading

import numpy as np
import pytest

from kvfabric import protocol as p
from kvfabric import sharding
from kvfabric.errors import AuthError, RemoteError
from kvfabric.testing.poll import wait_for
from kvfabric.testing.proxy import recv_exact
from kvfabric.transport import tcp
from kvfabric.transport.base import parse_address

TOKEN = "pool-token-22"


class FakeServer:
    """A socket that answers HELLO without a valid proof; ``received`` is every byte it got, per connection.

    ``mode``: ``"no-auth"`` says ``auth_required: false``; ``"bad-proof"`` says true with a random nonce and
    proof; ``"replay"`` sends back ``replayed``, a real server's HELLO reply recorded on an earlier connection.
    """

    def __init__(self, mode: str, replayed: bytes = b"") -> None:
        self.mode, self.replayed = mode, replayed
        self._ls = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._ls.getsockname()[1]}"
        self.received: list[bytearray] = []
        self.opcodes: list[int] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._ls.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        log = bytearray()
        with self._lock:
            self.received.append(log)
        with c:
            try:
                while (head := recv_exact(c, p.HEADER_SIZE)) is not None:
                    log += head
                    _, _, op, _, rid, mlen, plen, _ = p.HEADER.unpack(head)
                    body = recv_exact(c, mlen + plen)
                    if body is None:
                        return
                    log += body
                    with self._lock:
                        self.opcodes.append(op)
                    if op != p.Op.HELLO:
                        continue  # would be a leak: recorded, never answered
                    if self.mode == "replay":
                        c.sendall(self.replayed[:8] + rid.to_bytes(8, "little") + self.replayed[16:])
                        continue
                    reply = p.HelloReply(server="fake", server_id="pool-x", transports=("tcp", "native"),
                                         limits=p.DEFAULT_LIMITS, capacity=1 << 30,
                                         auth_required=self.mode == "bad-proof",
                                         nonce=p.new_nonce() if self.mode == "bad-proof" else None,
                                         proof=p.new_nonce() if self.mode == "bad-proof" else None)
                    c.sendall(p.encode_reply(reply, rid))
            except OSError:
                return

    def close(self) -> None:
        self._ls.close()


def _recorded_hello_reply(address: str) -> bytes:
    """A real server's HELLO reply frame (with its proof over someone else's nonce), as an eavesdropper saw it."""
    with socket.create_connection(parse_address(address), timeout=10) as s:
        s.sendall(p.encode_request(p.HelloRequest(client="eavesdropped"), 1))
        head = bytes(recv_exact(s, p.HEADER_SIZE))
        return head + bytes(recv_exact(s, p.unpack_header(head).meta_len))


def _split(keys: list[bytes], ids: list[str]) -> list[int]:
    return [sharding.owner_table([k], ids)[0][0] for k in keys]


def _stats(address: str, token: str | None) -> dict:
    with tcp.connect(address, timeout_s=10, auth_token=token) as c:
        return c.request(p.StatsRequest()).msg.stats


def test_the_right_token_works(make_pool, make_client):
    pool = make_pool(2, extra_args=["--auth-token", TOKEN])
    c = make_client(pool.addresses, auth_token=TOKEN)
    keys = [bytes([i]) * 16 for i in range(20)]
    assert c.put(keys, [k * 10 for k in keys]).stored == 20
    assert c.get(keys) == [k * 10 for k in keys]
    st = c.stats()["client"]
    assert st["servers_refused"] == 0 and all(s["up"] for s in st["shards"].values()), st


def test_a_wrong_token_is_refused_and_no_data_moves(make_pool, make_client):
    pool = make_pool(2, extra_args=["--auth-token", TOKEN])
    with pytest.raises(RemoteError) as e:  # every server refused: the constructor says so, naming one
        make_client(pool.addresses, auth_token="not-the-token", allow_rejects=True)
    assert e.value.code.name == "AUTH_FAILED" and any(a in str(e.value) for a in pool.addresses), e.value
    assert "did not prove it holds the pool token" in str(e.value)
    for a in pool.addresses:
        st = _stats(a, TOKEN)
        assert (st["puts"], st["hits"], st["misses"], st["objects"]) == (0, 0, 0, 0), st


def test_a_client_without_a_token_is_told_the_server_needs_one(make_pool, make_client):
    pool = make_pool(1, extra_args=["--auth-token", TOKEN])
    with pytest.raises(RemoteError, match="requires a pool token") as e:
        make_client(pool.addresses)
    assert isinstance(e.value, AuthError) and pool.addresses[0] in str(e.value), e.value


def test_a_server_without_the_token_is_refused_and_gets_no_keys(make_pool, make_client, caplog):
    good = make_pool(1, extra_args=["--auth-token", TOKEN])
    open_ = make_pool(1)  # no token: it could be anyone's
    ids = [good.addresses[0], open_.addresses[0]]
    with caplog.at_level(logging.ERROR, logger="kvfabric.client"):
        c = make_client(ids, auth_token=TOKEN, allow_rejects=True)
    keys = [bytes(np.random.default_rng(i).bytes(16)) for i in range(40)]
    owner = _split(keys, ids)
    assert 0 < owner.count(1) < len(keys)
    res = c.put(keys, [k * 3 for k in keys])
    assert (res.stored, res.dropped) == (owner.count(0), owner.count(1))
    assert c.get(keys) == [k * 3 if o == 0 else None for k, o in zip(keys, owner)]
    assert c.lookup([k for k, o in zip(keys, owner) if o == 1]) == 0
    st = c.stats()["client"]
    assert st["servers_refused"] >= 1 and not st["shards"][ids[1]]["up"], st
    assert any(ids[1] in r.getMessage() and "did not prove" in r.getMessage() for r in caplog.records)
    reached = _stats(ids[1], None)
    assert (reached["puts"], reached["hits"], reached["misses"], reached["objects"]) == (0, 0, 0, 0), reached


@pytest.mark.parametrize("mode", ["no-auth", "bad-proof", "replay"])
def test_a_fake_server_never_sees_the_token_or_a_key(make_pool, make_client, mode):
    real = make_pool(1, extra_args=["--auth-token", TOKEN])
    fake = FakeServer(mode, _recorded_hello_reply(real.addresses[0]) if mode == "replay" else b"")
    try:
        ids = [real.addresses[0], fake.address]
        c = make_client(ids, auth_token=TOKEN, allow_rejects=True)
        keys = [bytes(np.random.default_rng(100 + i).bytes(16)) for i in range(40)]
        owner = _split(keys, ids)
        assert 0 < owner.count(1) < len(keys)
        res = c.put(keys, [k * 2 for k in keys])
        assert (res.stored, res.dropped) == (owner.count(0), owner.count(1))
        assert c.get(keys) == [k * 2 if o == 0 else None for k, o in zip(keys, owner)]  # its keys: misses
        assert c.exists(keys) == [o == 0 for o in owner]
        st = c.stats()["client"]
        assert st["servers_refused"] >= 1 and not st["shards"][fake.address]["up"], st
        assert wait_for(lambda: fake.received, timeout_s=10)
        with fake._lock:
            got = b"".join(fake.received)
            ops = sorted(set(fake.opcodes))
        assert TOKEN.encode() not in got, "the token crossed the wire"
        assert ops == [p.Op.HELLO], f"the fake server received more than HELLO: opcodes {ops}"
    finally:
        fake.close()
