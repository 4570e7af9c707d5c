"""Fixtures for the client integration tests: real server pools per transport pair.

Every test that takes ``pair`` (directly or through ``make_pool`` /
``make_client``) runs once per entry of
``kvfabric.testing.conformance.TRANSPORT_PAIRS``, so those tests are the
transport conformance suite. A pair whose client transport is unavailable
here is skipped with the reason.

``CorruptingProxy`` sits between a client and one server on loopback and, when
armed, flips one byte in the payload of the next GET replies: the client side
of the wire is where its checksum check must catch it.
"""

from __future__ import annotations

import socket
import threading

import pytest

from kvfabric import protocol, transport
from kvfabric.client import Client
from kvfabric.config import ClientConfig
from kvfabric.testing.conformance import TRANSPORT_PAIRS, pair_id, start_pool_of


@pytest.fixture(params=TRANSPORT_PAIRS, ids=pair_id)
def pair(request) -> tuple[str, str]:
    server_kind, tname = request.param
    if server_kind == "native" and "native" not in transport.available():
        # the native server kind needs the same C extension as the native client transport
        pytest.skip(f"native server unavailable here: {transport.unavailable().get('native')}")
    if tname not in transport.available():
        pytest.skip(f"transport {tname!r} unavailable here: {transport.unavailable().get(tname)}")
    return request.param


@pytest.fixture
def make_pool(pair):
    """``make_pool(n=3, capacity="64MiB", extra_args=())`` -> ServerPool; stopped after the test."""
    pools = []

    def make(n: int = 3, **kwargs):
        kwargs.setdefault("capacity", "64MiB")
        p = start_pool_of(pair[0], n, **kwargs)
        pools.append(p)
        return p

    yield make
    for p in pools:
        for s in p:
            s.kill()


@pytest.fixture
def make_client(pair):
    """``make_client(addresses, namespace=None, **ClientConfig fields)`` forcing the pair's transport; closed after."""
    clients = []

    def make(addresses, namespace=None, **cfg) -> Client:
        cfg.setdefault("transport", pair[1])
        cfg.setdefault("timeout_s", 10.0)
        cfg.setdefault("connect_timeout_s", 2.0)
        c = Client(list(addresses), namespace=namespace, config=ClientConfig(**cfg))
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


class CorruptingProxy:
    """A loopback TCP proxy to ``target``; ``arm(n)`` corrupts the next ``n`` GET reply payloads.

    Requests pass through untouched. Replies are read frame by frame (header
    via ``protocol.unpack_header``) and forwarded; for an armed GET reply with
    a payload, the first payload byte is flipped in transit.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self._ls = socket.socket()
        self._ls.bind(("127.0.0.1", 0))
        self._ls.listen(16)
        self.address = f"127.0.0.1:{self._ls.getsockname()[1]}"
        self._lock = threading.Lock()
        self._armed = 0
        self.corrupted = 0
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, n: int = 1) -> None:
        with self._lock:
            self._armed += n

    def _take(self) -> bool:
        with self._lock:
            if self._armed:
                self._armed -= 1
                self.corrupted += 1
                return True
            return False

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._ls.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            self._socks += [c, s]
            threading.Thread(target=self._pipe, args=(c, s), daemon=True).start()
            threading.Thread(target=self._replies, args=(s, c), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytearray | None:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        return buf

    def _replies(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                head = self._exact(src, protocol.HEADER_SIZE)
                if head is None:
                    break
                h = protocol.unpack_header(head)
                rest = self._exact(src, h.meta_len + h.payload_len)
                if rest is None:
                    break
                if h.opcode == protocol.Op.GET and h.payload_len and not h.is_error and self._take():
                    rest[h.meta_len] ^= 0xFF
                dst.sendall(head + rest)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._ls.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def make_proxy():
    proxies = []

    def make(target: str) -> CorruptingProxy:
        p = CorruptingProxy(target)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()
