"""A server over its connection bound: BUSY (request id 0) is a RemoteError, and the client degrades to misses.

``kvfabric serve --max-connections 1`` answers a connection over the bound
with one BUSY error frame whose request id is 0, then closes it
(kvfabric/testing/reference/tcp.py; the native server, csrc/kvf_server.c, sends the
same frame; both kinds run here). The transports must report that as
``RemoteError(BUSY)``, not as a malformed reply, and a ``Client`` on such a
server must turn it into misses and counted drops without raising, then
reconnect once a connection is free again.
"""

from __future__ import annotations

import os
import time

import pytest

from kvfabric import protocol, transport
from kvfabric.client import Client
from kvfabric.config import ClientConfig
from kvfabric.errors import ErrorCode, RemoteError
from kvfabric.testing.conformance import SERVER_KINDS, server_kind_unavailable
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp
from kvfabric.testing import wait_for as _wait_for


@pytest.fixture(params=["reference", "native"])
def busy_server(request):
    """A server of each kind (Python reference, native io_uring) that takes one connection at a time."""
    kw = SERVER_KINDS[request.param]
    if (why := server_kind_unavailable(request.param)) is not None:
        pytest.skip(why)
    with start_server(capacity="16MiB", extra_args=[*kw.get("extra_args", ()), "--max-connections", "1"],
                      **{k: v for k, v in kw.items() if k != "extra_args"}) as srv:
        yield srv


def _connect_fn(name: str):
    if name not in transport.available():
        pytest.skip(f"transport {name!r} unavailable here: {transport.unavailable().get(name)}")
    if name == "tcp":
        return tcp.connect
    from kvfabric.transport import native

    return native.connect


@pytest.mark.parametrize("tname", ["tcp", "native"])
def test_second_connection_gets_busy_as_remote_error(busy_server, tname):
    connect = _connect_fn(tname)
    held = connect(busy_server.address, timeout_s=5.0)
    try:
        for _ in range(3):  # every refused attempt says BUSY; none counts against the bound
            with pytest.raises(RemoteError) as info:
                connect(busy_server.address, timeout_s=5.0)
            assert info.value.code == ErrorCode.BUSY, info.value
            assert "too many connections" in str(info.value)
        # The held connection is untouched by the refusals.
        assert isinstance(held.request(protocol.PingRequest(), deadline=time.monotonic() + 5).msg, protocol.PingReply)
    finally:
        held.close()
    # Once it is released, a new connection is accepted.
    assert _wait_for(lambda: _try_connect(connect, busy_server.address) is not None)


def _try_connect(connect, address):
    try:
        conn = connect(address, timeout_s=2.0)
    except RemoteError:
        return None
    conn.close()
    return conn


def test_client_on_a_busy_server_degrades_to_misses(busy_server):
    addr = busy_server.address
    held = tcp.connect(addr, timeout_s=5.0)
    keys = [os.urandom(16) for _ in range(4)]
    values = [bytes([i]) * 1000 for i in range(4)]
    cfg = ClientConfig(transport="tcp", timeout_s=2.0, connect_timeout_s=2.0,
                       reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.2)
    client = Client([addr], config=cfg)  # must not raise
    try:
        result = client.put(keys, values)
        assert (result.stored, result.existed, result.dropped) == (0, 0, len(keys))
        assert client.get(keys) == [None] * len(keys)
        bufs = [bytearray(1000) for _ in keys]
        assert client.get_into(keys, bufs) == [None] * len(keys)
        assert client.exists(keys) == [False] * len(keys)
        assert client.lookup(keys) == 0
        assert client.delete(keys) == 0
        stats = client.stats()
        shard = stats["client"]["shards"][addr]
        assert shard["up"] is False
        # Reported as the BUSY it is, not as a malformed reply.
        assert "RemoteError" in shard["last_error"] and "BUSY" in shard["last_error"], shard
        assert "MALFORMED" not in shard["last_error"]
        assert "error" in stats["servers"][addr]
        assert stats["client"]["dropped_puts"] == len(keys)
        assert stats["client"]["misses"] >= 2 * len(keys)

        # Free the one slot: the background reconnector brings the shard back.
        held.close()
        held = None
        assert _wait_for(lambda: client.stats()["client"]["shards"][addr]["up"]), client.stats()["client"]
        assert client.put(keys, values).stored == len(keys)
        assert client.get(keys) == values
    finally:
        if held is not None:
            held.close()
        client.close()
