"""The simulator's two-level shard (DRAM policy + SSD log): exact runs and counters worked by hand."""

from __future__ import annotations

import random

import pytest

from kvfabric.bench.belady import infinite
from kvfabric.bench.simulate import default_servers, shard_capacity, simulate
from kvfabric.bench._tiers import TierCount, TieredShard, ssd_geometry, tier_stats
from kvfabric.bench.traces import Request, Trace

# One block per request, so every hit is a whole request: 1 2 3 1 4 1 2 3 1.
SINGLES = [1, 2, 3, 1, 4, 1, 2, 3, 1]


def singles() -> Trace:
    return Trace([Request(i, 16, 1, [x]) for i, x in enumerate(SINGLES)], 16)


def test_admit_all_exact():
    # DRAM 2 blocks (LRU), SSD log 3 records. By hand (DRAM set, log oldest first):
    # 1,2 -> D{1,2}; 3 evicts 1 -> L[1]; 1: LOOKUP promotes it, evicting 2 -> L[1,2];
    # 4 evicts 3 -> L[1,2,3]; 1: DRAM hit; 2: promoted, evicts 4 -> L[2,3,4] (1 overwritten);
    # 3: promoted, evicts 1 -> L[3,4,1]; 1: promoted, evicts 2 -> L[4,1,2].
    r = simulate(singles(), "lru", 2, ssd_blocks_per_shard=3, admit="all")
    assert r.hits.runs == [0, 0, 0, 1, 0, 1, 1, 1, 1]
    assert (r.tiers.dram_blocks, r.tiers.ssd_blocks) == (1, 4)
    assert r.tier_counters == {"dram_objects": 2, "ssd_objects": 3, "evictions": 6, "ssd_writes": 6,
                               "ssd_overwrites": 3, "ssd_admit_skips": 0, "ssd_hits": 4, "ssd_misses": 0,
                               "promotions": 4, "lookup_self_evictions": 0}


def test_admit_hit_exact():
    # Only blocks read by a GET while in DRAM go to the log: 1 (GET at request 5) is the only one,
    # written when 3 is PUT at request 7 and read back at request 8; 1 (first copy), 2, 3, 4, 2 skipped.
    r = simulate(singles(), "lru", 2, ssd_blocks_per_shard=3, admit="hit")
    assert r.hits.runs == [0, 0, 0, 0, 0, 1, 0, 0, 1]
    assert (r.tiers.dram_blocks, r.tiers.ssd_blocks) == (1, 1)
    c = r.tier_counters
    assert (c["ssd_writes"], c["ssd_admit_skips"], c["ssd_hits"], c["promotions"]) == (1, 5, 1, 1)


def test_dram_only_is_the_one_level_model():
    one = simulate(singles(), "lru", 2)
    assert one.tiers is None and one.tier_counters is None
    assert one.hits.runs == [0, 0, 0, 0, 0, 1, 0, 0, 0]


def test_promotion_keeps_the_record_and_put_ignores_the_log():
    s = TieredShard("lru", 2, 8, promote_max=2)
    for k in (b"a", b"b", b"c", b"d"):
        s.put(k, None)  # a, b -> log
    assert s.get(b"a", None) == "ssd"  # promoted, evicting c; its record stays
    s.put(b"e", None)  # evicts d
    s.put(b"f", None)  # evicts a, whose record is still on the log: not written again
    assert list(s.ssd) == [b"a", b"b", b"c", b"d"] and s.ssd_writes == 4 and s.ssd_admit_skips == 1
    # LOOKUP promotes the leading run's log keys (evicting e and f), then answers from DRAM
    assert s.lookup([b"a", b"b", b"x"]) == 2 and s.last_promoted == {b"a", b"b"} and s.dram == {b"a", b"b"}
    assert s.get(b"x", None) == "miss"
    s.put(b"c", None)  # on the log only: PUT stores it into DRAM again
    assert b"c" in s.dram and s.ssd_writes == 6


def test_lookup_promotes_at_most_the_dram_and_ends_the_run_at_a_victim():
    s = TieredShard("lru", 2, 8, promote_max=2)
    for k in (b"a", b"b", b"c", b"d"):
        s.put(k, None)  # D{c,d}, log [a,b]
    # a, b promoted: their two slots evict c and d, the run's own DRAM blocks -> the run is a, b
    assert s.lookup([b"a", b"b", b"c", b"d"]) == 2 and s.self_evictions == 2
    t = TieredShard("lru", 1, 8, promote_max=2)
    for k in (b"a", b"b", b"c"):
        t.put(k, None)  # D{c}, log [a,b]
    assert t.lookup([b"a", b"b"]) == 1 and t.ssd_misses == 1  # one slot: b is a miss
    u = TieredShard("lru", 8, 8)  # the default cap: a quarter of the DRAM, 2 blocks
    for i in range(12):
        u.put(bytes([i]), None)  # 0..3 -> log
    assert u.lookup([bytes([i]) for i in range(4)]) == 2 and u.last_promoted == {b"\x00", b"\x01"}


def test_segments_drop_together():
    s = TieredShard("lru", 1, 4, segment_blocks=2)
    for i in range(7):
        s.put(bytes([i]), None)  # k0..k5 written at positions 0..5; writing k4 enters segment 0 again
    assert list(s.ssd) == [bytes([i]) for i in (2, 3, 4, 5)] and s.ssd_overwrites == 2
    s.put(b"\x07", None)  # k6 at position 6 drops k2, k3
    assert list(s.ssd) == [bytes([i]) for i in (4, 5, 6)]
    with pytest.raises(ValueError):
        TieredShard("lru", 1, 5, segment_blocks=2)


@pytest.mark.parametrize("policy", ["lru", "prefix-lfu"])
def test_a_log_holding_everything_is_infinite(policy):
    # One-block prompts, so a LOOKUP's promotions never evict a block of its own run (see the test above).
    rng = random.Random(3)
    trace = Trace([Request(t, 16, 1, [rng.randrange(60)]) for t in range(400)], 16)
    per = shard_capacity(trace, 0.05, 2)
    r = simulate(trace, policy, per, default_servers(2), ssd_blocks_per_shard=trace.unique_blocks, admit="all")
    assert r.hits.runs == infinite(trace).runs
    assert r.tiers.dram_blocks + r.tiers.ssd_blocks == r.hits.hit_blocks and r.tiers.ssd_blocks > 0
    small = simulate(trace, policy, per, default_servers(2))
    assert small.hits.hit_blocks < r.hits.hit_blocks


def test_useful_uses_the_ssd_read_time():
    # A 16-token block recomputes in 2000 us at 8000 tokens/s: an SSD read of 1500 us is useful, 2500 us not.
    t = Trace([Request(0, 16, 1, [7]), Request(1, 16, 1, [7])], 16)
    for us, want in ((1500.0, 1), (2500.0, 0)):
        c = TierCount(ssd_us=us)
        c.add(t, 0, 0, 0)
        c.add(t, 1, 1, 1)
        assert c.useful.hit_blocks == want
        assert c.as_dict()["ssd_block_hit_rate"] == 0.5
    assert "useful" not in TierCount().as_dict()


def _server_records(cap: int, block_bytes: int) -> tuple[int, int]:
    """The server's own arithmetic (csrc/kvf_tier.c, one path): (records, records per segment)."""
    seg = min(max(cap // 16, 1 << 20), 64 << 20) // 4096 * 4096
    segs = (cap - 4096) // seg
    rec = 4096 + -(-block_bytes // 4096) * 4096
    return segs * (seg // rec), seg // rec


@pytest.mark.parametrize("blocks,block_bytes", [(45697, 8192), (10, 8192), (1361, 8192), (5, 1 << 20),
                                                (100000, 1 << 20), (3, 4096), (777, 3000)])
def test_geometry_matches_the_server_layout(blocks, block_bytes):
    cap, records, per_seg = ssd_geometry(blocks, block_bytes)
    assert records >= blocks and (records, per_seg) == _server_records(cap, block_bytes)
    assert records % per_seg == 0


def test_errors():
    with pytest.raises(ValueError):
        TieredShard("lru", 2, 2, "sometimes")
    with pytest.raises(ValueError):
        simulate(singles(), "lru", 2, ssd_blocks_per_shard=2, admit="never")
    with pytest.raises(ValueError):
        ssd_geometry(0, 8192)


def test_tier_stats_sums_and_mean_read_time():
    s = tier_stats({"a": {"ssd_reads": 2, "ssd_read_us_total": 300, "ssd_hits": 2},
                    "b": {"ssd_reads": 1, "ssd_read_us_total": 300}, "c": "down"})
    assert (s["ssd_reads"], s["ssd_hits"], s["ssd_read_us"]) == (3, 2, 200)
    assert tier_stats({})["ssd_read_us"] is None
