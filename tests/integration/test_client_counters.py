"""The client's counters: a block looked up and then fetched is one GET hit (and one lookup hit), not two."""

from __future__ import annotations

from kvfabric import Client, ClientConfig
from kvfabric.metrics import CLIENT


def test_lookup_then_get_counts_each_block_once(make_pool):
    pool = make_pool(2)
    with Client(pool.addresses, config=ClientConfig(timeout_s=30, connect_timeout_s=30)) as c:
        keys = [bytes([i]) * 16 for i in range(3)]
        assert c.put(keys, [b"v" * 100] * 3).stored == 3
        assert c.lookup(keys + [b"\xee" * 16]) == 3
        assert c.get(keys) == [b"v" * 100] * 3
        st = c.stats()["client"]
    assert (st["hits"], st["misses"]) == (3, 0)  # the GET
    assert (st["lookup_hits"], st["lookup_misses"]) == (3, 1)  # the lookup
    assert set(CLIENT) <= set(st)  # every declared client counter is reported
