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

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import pytest

from kvfabric import protocol, transport
from kvfabric.client import Client
from kvfabric.config import ClientConfig
from kvfabric.testing.conformance import TRANSPORT_PAIRS, pair_id, server_kind_unavailable, start_pool_of
from kvfabric.testing.proxy import FrameProxy


@pytest.fixture
def tier_dir() -> Iterator[str]:
    """A fresh directory for SSD tier files (``KVFABRIC_TIER_TEST_DIR``: a filesystem with O_DIRECT;
    default the system's temporary directory), removed after the test."""
    d = tempfile.mkdtemp(prefix="kvf-tier-", dir=os.environ.get("KVFABRIC_TIER_TEST_DIR") or None)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=TRANSPORT_PAIRS, ids=pair_id)
def pair(request) -> tuple[str, str]:
    server_kind, tname = request.param
    if (why := server_kind_unavailable(server_kind)) is not None:
        pytest.skip(why)
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
    """``make_client(addresses, namespace=None, allow_rejects=False, **ClientConfig fields)`` forcing the pair's
    transport; closed after."""
    clients = []

    def make(addresses, namespace=None, allow_rejects=False, **cfg) -> Client:
        cfg.setdefault("transport", pair[1])
        cfg.setdefault("timeout_s", 10.0)
        cfg.setdefault("connect_timeout_s", 2.0)
        c = Client(list(addresses), namespace=namespace, config=ClientConfig(**cfg), allow_rejects=allow_rejects)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


class CorruptingProxy(FrameProxy):
    """A loopback TCP proxy to ``target``; ``arm(n)`` corrupts the next ``n`` GET reply payloads.

    Requests pass through untouched. For an armed GET reply with a payload,
    one payload byte is flipped in transit: the first, or the one at
    ``arm(n, at=OFFSET)`` (an offset into the reply's payload; negative
    counts from its end).
    """

    parse_replies = True

    def __init__(self, target: str) -> None:
        self._lock = threading.Lock()
        self._armed = 0
        self._at = 0
        self.corrupted = 0
        super().__init__(target)

    def arm(self, n: int = 1, at: int = 0) -> None:
        with self._lock:
            self._armed += n
            self._at = at

    def _take(self) -> bool:
        with self._lock:
            if self._armed:
                self._armed -= 1
                self.corrupted += 1
                return True
            return False

    def reply_frame(self, h, head, rest):
        if h.opcode == protocol.Op.GET and h.payload_len and not h.is_error and self._take():
            rest[h.meta_len + self._at % h.payload_len] ^= 0xFF
        return bytes(head) + bytes(rest)


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
