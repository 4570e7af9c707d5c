"""The native server's connection limits, as the Python server has them.

- ``--max-connections``: a peer over the bound gets one BUSY error frame
  (request id 0, byte for byte what protocol.encode_error makes) and is
  closed; the held connections are untouched and a freed slot is reused.
"""

import time

import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, RemoteError
from kvfabric.transport import tcp


def wait_for(cond, timeout_s=15.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def _try_connect(address):
    try:
        return tcp.connect(address, timeout_s=5.0)
    except RemoteError:
        return None


def test_a_connection_over_the_bound_gets_busy_then_a_freed_slot_is_reused(make_server, open_raw):
    srv = make_server(max_connections=2)
    held = [tcp.connect(srv.address, timeout_s=5.0) for _ in range(2)]  # HELLO answered: both counted
    try:
        # raw socket: exactly the Python server's BUSY frame, then EOF
        r = open_raw(srv.address)
        frame = r.recv_frame()
        assert frame == p.encode_error(0, 0, ErrorCode.BUSY, "too many connections (max 2)")
        assert r.closed_by_peer()
        # through a transport: RemoteError(BUSY), every time, none counted against the bound
        for _ in range(2):
            with pytest.raises(RemoteError) as info:
                tcp.connect(srv.address, timeout_s=5.0)
            assert info.value.code == ErrorCode.BUSY
            assert "too many connections" in str(info.value)
        st = held[0].request(p.StatsRequest()).msg.stats  # STATS on the wire
        assert st["connections"] == 2
        assert st["connections_rejected"] >= 3
        assert st["errors"].get("BUSY", 0) >= 3
        # the held connections still work
        for c in held:
            assert isinstance(c.request(p.PingRequest()).msg, p.PingReply)
        # free one slot: a new connection is accepted (the server sees the close asynchronously)
        held.pop().close()
        fresh = []
        assert wait_for(lambda: bool(fresh) or fresh.extend(filter(None, [_try_connect(srv.address)])) or bool(fresh))
        held += fresh
        assert isinstance(held[-1].request(p.PingRequest()).msg, p.PingReply)
    finally:
        for c in held:
            c.close()
