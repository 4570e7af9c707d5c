"""``transport.native.send_requests``: several connections' requests handed to the kernel in one
io_uring submission (``_native.send_frames``), as the client's single-thread fan-out sends a
lookup's per-shard requests. Each reply comes back in step; a closed connection or a passed
deadline fails only its own request; a request with a payload is refused before anything is sent."""

from __future__ import annotations

import time

import pytest

from kvfabric import protocol
from kvfabric.errors import ConnectionClosed, DeadlineExceeded
from kvfabric.transport import native as tn


def _put(conn, key: bytes) -> None:
    val = key * 4
    reply = conn.request(protocol.PutRequest(keys=[key], sizes=[len(val)], checksums=[protocol.checksum(key, val)]),
                         [val], deadline=time.monotonic() + 10)
    assert list(reply.msg.status) == [protocol.PutStatus.STORED]


def test_requests_on_several_servers_go_out_together_and_each_reply_is_in_step(make_server):
    servers = [make_server(capacity=16 << 20) for _ in range(3)]
    conns = [tn.connect(s.address, timeout_s=5) for s in servers]
    try:
        keys = [bytes([65 + i]) * 16 for i in range(3)]
        for c, k in zip(conns, keys):
            _put(c, k)
        # server i holds key i only: a LOOKUP of [key i, other] counts 1, of [other, key i] counts 0
        msgs = [protocol.LookupRequest(keys=[k, b"z" * 16]) if i % 2 == 0 else protocol.LookupRequest(keys=[b"z" * 16, k])
                for i, k in enumerate(keys)]
        for _ in range(3):  # the thread's ring is reused
            rids = tn.send_requests(conns, msgs, deadline=time.monotonic() + 10)
            assert all(isinstance(r, int) and r > 0 for r in rids), rids
            counts = [c.recv_reply(m, r, deadline=time.monotonic() + 10).msg.count for c, m, r in zip(conns, msgs, rids)]
            assert counts == [1, 0, 1], counts

        conns[1].close()  # a closed connection fails alone
        rids = tn.send_requests(conns, msgs, deadline=time.monotonic() + 10)
        assert isinstance(rids[1], ConnectionClosed), rids
        assert [conns[i].recv_reply(msgs[i], rids[i], deadline=time.monotonic() + 10).msg.count for i in (0, 2)] == [1, 1]

        with pytest.raises(ValueError):  # a payload request: refused, nothing sent
            tn.send_requests([conns[0]], [protocol.GetRequest(keys=keys[:1])])
        assert conns[0].request(protocol.PingRequest(), deadline=time.monotonic() + 10).msg is not None

        late = tn.send_requests([conns[0], conns[2]], msgs[:1] + msgs[2:], deadline=time.monotonic() - 1)
        assert all(isinstance(r, DeadlineExceeded) for r in late), late
        assert conns[0].closed and conns[2].closed  # out of step for the caller: closed
    finally:
        for c in conns:
            c.close()
