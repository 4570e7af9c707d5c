"""Fixtures for the native tests: an in-process native server and raw frames on a socket.

Every test here needs the C extension; without it the whole directory is
skipped with the reason (CI builds it with KVFABRIC_NATIVE_REQUIRED=1, so a
broken build fails there instead of skipping).
"""

from __future__ import annotations

import socket

import pytest

from kvfabric import protocol

native = pytest.importorskip("kvfabric._native", reason="the C extension kvfabric._native is not built")

from kvfabric.server.native import NativeServer  # noqa: E402
from kvfabric.testing.servers import start_server  # noqa: E402


@pytest.fixture
def server():
    """A native server (16 MiB arena, LRU) on a free loopback port; stopped after the test."""
    srv = NativeServer(capacity=16 << 20).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def py_server():
    """A Python (reference) server process with a 64 MiB arena, shared by a module's tests."""
    with start_server(capacity="64MiB", module="kvfabric.testing.reference") as srv:
        yield srv


@pytest.fixture(params=["python", "native"])
def address(request, make_server):
    """The address of a Python server and, in a second run, of a native server (64 MiB each)."""
    if request.param == "python":
        return request.getfixturevalue("py_server").address
    return make_server(capacity=64 << 20).address


@pytest.fixture
def make_server():
    servers = []

    def make(**kw):
        kw.setdefault("capacity", 16 << 20)
        srv = NativeServer(**kw).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


class Raw:
    """A plain blocking socket speaking frames by hand (for byte-exact checks)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=5)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return bytes(buf)

    def recv_frame(self) -> bytes:
        """Header + metadata + payload of one frame, as bytes."""
        head = self.recv_exact(protocol.HEADER_SIZE)
        h = protocol.unpack_header(head)
        return head + self.recv_exact(h.meta_len + h.payload_len)

    def closed_by_peer(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(server):
    r = Raw(server.address)
    yield r
    r.close()


@pytest.fixture
def open_raw():
    """``open_raw(address) -> Raw`` for tests that need several; all closed after the test.

    (A fixture rather than ``from conftest import Raw``: with tests/integration in
    the same pytest run, ``conftest`` names the other folder's module.)"""
    opened: list[Raw] = []

    def open_(address: str) -> Raw:
        r = Raw(address)
        opened.append(r)
        return r

    yield open_
    for r in opened:
        r.close()
