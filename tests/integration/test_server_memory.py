"""The hard memory bound, measured on a real server process.

Stated bound (docs/notes/server.md): resident memory of ``kvfabric serve``
stays within ``capacity + 48 MiB + 1 KiB x stored objects`` however much is
written: the arena is preallocated and never grows, the 48 MiB covers the
interpreter, libraries and connection threads, and each stored object costs
an index entry (~0.6 KiB measured). Objects occupy at least one 4 KiB page,
so the per-object term is at most ``capacity / 4``, reached only with
objects of 4 KiB or less.
"""

from __future__ import annotations

import os

import pytest

from kvfabric import protocol as P
from kvfabric.testing import start_server
from kvfabric.transport.tcp import connect

MiB = 1 << 20
FIXED_OVERHEAD = 48 * MiB
PER_OBJECT = 1024


@pytest.mark.parametrize("module", ["kvfabric", "kvfabric.testing.reference"])
@pytest.mark.parametrize("object_size", [256 * 1024, 4096])
def test_rss_bounded_after_writing_three_times_capacity(object_size, module):
    capacity = 64 * MiB
    with start_server(capacity=str(capacity), module=module) as srv:
        c = connect(srv.address, timeout_s=60)
        batch = max(1, (4 * MiB) // object_size)
        data = os.urandom(object_size)
        written, n = 0, 0
        while written < 3 * capacity:
            keys = [b"%012d" % (n + j) for j in range(batch)]
            n += batch
            sums = [P.checksum(k, data) for k in keys]
            status = c.request(P.PutRequest(keys, [object_size] * batch, sums), [data] * batch).msg.status
            assert set(status) == {P.PutStatus.STORED}
            written += object_size * batch
        # read some back too (GET pins and sends from the arena, no copies)
        got = c.request(P.GetRequest([b"%012d" % (n - 1 - j) for j in range(batch)])).msg
        assert got.sizes == [object_size] * batch
        st = c.request(P.StatsRequest()).msg.stats
        rss = srv.rss_bytes()
        # full, up to the headroom the product server keeps free ahead of demand (at most 10%)
        assert st["evictions"] > 0 and st["bytes_used"] >= capacity * 0.85
        bound = capacity + FIXED_OVERHEAD + PER_OBJECT * st["objects"]
        assert rss <= bound, f"VmRSS {rss / MiB:.1f} MiB over the bound {bound / MiB:.1f} MiB"
        assert rss >= capacity * 0.9  # the arena really was filled (the check is not vacuous)
        c.close()
