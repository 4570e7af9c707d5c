"""The router's index of what the pool servers hold, from their KV events (kvfabric/route/pool.py
``PoolIndex``): per server, per medium, AllBlocksCleared per server, bounded, bad events counted. The
stream of a real server into it is tested in tests/e2e/vllm/test_route.py."""

from __future__ import annotations

from kvfabric.protocol.kv_events import MEDIUM_DRAM, MEDIUM_SSD, all_blocks_cleared, block_removed, block_stored
from kvfabric.route.pool import PoolIndex


def test_stored_removed_by_medium_and_cleared_per_server():
    idx = PoolIndex()
    a, b = idx.source("a"), idx.source("b")
    a.apply([block_stored([b"k1", b"k2"], MEDIUM_DRAM)])
    b.apply([block_stored([b"k3"], MEDIUM_DRAM)])
    assert idx.holds(b"k1") and idx.holds(b"k3") and not idx.holds(b"k4")
    a.apply([block_stored([b"k1"], MEDIUM_SSD), block_removed([b"k1"], MEDIUM_DRAM)])   # moved to SSD
    assert idx.holds(b"k1")
    a.apply([block_removed([b"k1"], MEDIUM_SSD)])
    assert not idx.holds(b"k1")
    a.apply([all_blocks_cleared()])             # a's view lost: only a's blocks go
    assert not idx.holds(b"k2") and idx.holds(b"k3")
    assert idx.counts["cleared"] == 1 and idx.counts["bad_events"] == 0


def test_bounded_and_bad_events_counted():
    idx = PoolIndex(max_entries=2)
    src = idx.source("a")
    src.apply([block_stored([b"1"], MEDIUM_DRAM), block_stored([b"2"], MEDIUM_DRAM), block_stored([b"3"], MEDIUM_DRAM)])
    assert not idx.holds(b"1") and idx.holds(b"2") and idx.holds(b"3") and idx.counts["forgotten"] == 1
    src.apply([{"type": "Nonsense"}, {"type": "BlockStored"}, block_removed([b"zz"], MEDIUM_DRAM)])
    assert idx.counts["bad_events"] == 2 and idx.holds(b"3")
