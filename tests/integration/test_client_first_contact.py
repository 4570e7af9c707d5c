"""First contact with a configured server: a server that accepts but answers HELLO late is slow, not down.

The client reaches a server within ``connect_timeout_s`` (0.5 s by default: the TCP handshake, which
the kernel answers however loaded the server is) and then gives its HELLO the call deadline
(``timeout_s``), so a loaded or sanitizer-slowed server is not marked down, its reads do not miss
and its puts are not dropped (docs/notes/client.md, "Connect timeout").
"""

from __future__ import annotations

import time

from kvfabric import Client, ClientConfig, protocol
from kvfabric.testing.ports import free_port
from kvfabric.testing.proxy import FrameProxy


class SlowHelloProxy(FrameProxy):
    """Holds every HELLO reply for ``delay_s`` (a server busy when the client first calls)."""

    parse_replies = True
    delay_s = 1.5

    def reply_frame(self, h, head, rest):
        if h.opcode == protocol.Op.HELLO:
            time.sleep(self.delay_s)
        return bytes(head) + bytes(rest)


def test_a_late_hello_is_not_a_dead_shard(make_pool):
    pool = make_pool(1)
    proxy = SlowHelloProxy(pool.addresses[0])
    try:
        cfg = ClientConfig(transport="tcp", timeout_s=30)
        assert cfg.connect_timeout_s == 0.5 < SlowHelloProxy.delay_s  # the default, shorter than the HELLO
        with Client([proxy.address], config=cfg) as c:
            st = c.stats()["client"]
            assert st["shards"][proxy.address]["up"] is True
            keys = [bytes([i]) * 16 for i in range(4)]
            assert c.put(keys, [b"z" * 64] * 4).stored == 4
            assert c.get(keys) == [b"z" * 64] * 4
            st = c.stats()["client"]
        assert (st["skipped_down"], st["dropped_puts"], st["misses"]) == (0, 0, 0)
    finally:
        proxy.close()


def test_a_refused_server_is_still_down_at_once():
    port = free_port()  # nobody listens on it; outside the ephemeral range, so no other part's server takes it
    with Client([f"127.0.0.1:{port}"], config=ClientConfig(transport="tcp", timeout_s=30)) as c:
        assert c.stats()["client"]["shards"][f"127.0.0.1:{port}"]["up"] is False
        assert c.get([b"k" * 16]) == [None]
        assert c.stats()["client"]["skipped_down"] >= 1  # the get did not wait on it: the shard is down
