"""A server that closes idle connections (--idle-timeout) costs a quiet client one reconnect, never a miss."""

from __future__ import annotations

import pytest

from kvfabric import Client, ClientConfig, transport
from kvfabric.testing import start_server, wait_for


@pytest.mark.parametrize("transport_name", ["tcp", "native", "shm"])
def test_pooled_connections_closed_by_the_server_are_replaced_quietly(transport_name):
    if transport_name not in transport.available():
        pytest.skip(f"{transport_name}: {transport.unavailable().get(transport_name)}")
    args = ["--idle-timeout", "1", "--transports", "tcp,native,shm"]
    with start_server("16MiB", extra_args=args) as srv:
        cfg = ClientConfig(transport=transport_name, timeout_s=10, connect_timeout_s=10)
        with Client([srv.address], config=cfg) as c, Client([srv.address], config=ClientConfig(transport="tcp")) as probe:
            keys = [bytes([i]) * 16 for i in range(4)]
            values = [bytes([i]) * 9000 for i in range(4)]
            assert c.put(keys, values).stored == 4
            before = probe.stats()["servers"][srv.address]["idle_timeouts"]
            # the engine goes quiet; the server closes its pooled connection(s)
            wait_for(lambda: probe.stats()["servers"][srv.address]["idle_timeouts"] > before, timeout_s=60)
            assert c.get(keys) == values
            assert c.lookup(keys) == 4
            st = c.stats()["client"]
            assert st["shards"][srv.address]["up"] and st["shard_errors"] == 0 and st["timeouts"] == 0
