"""The simulator's two-level shard (DRAM policy + SSD FIFO log): exact runs and counters worked by hand."""

from __future__ import annotations

import random

import pytest

from kvfabric.bench.belady import infinite
from kvfabric.bench.simulate import default_servers, shard_capacity, simulate
from kvfabric.bench._tiers import TierCount, TieredShard, ssd_bytes_for, tier_stats
from kvfabric.bench.traces import Request, Trace

# One block per request, so every hit is a whole request: 1 2 3 1 4 1 2 3 1.
SINGLES = [1, 2, 3, 1, 4, 1, 2, 3, 1]


def singles() -> Trace:
    return Trace([Request(i, 16, 1, [x]) for i, x in enumerate(SINGLES)], 16)


def test_admit_all_exact():
    # DRAM 2 blocks (LRU), SSD log 2 blocks. By hand (DRAM set, SSD log oldest first):
    # 1,2 -> D{1,2}; 3 evicts 1 -> S[1]; 1: SSD hit, promoted, evicts 2 -> S[1,2];
    # 4 evicts 3 -> S[2,3] (1 overwritten); 1: DRAM hit; 2: SSD hit, evicts 4 -> S[3,4];
    # 3: SSD hit, evicts 1 -> S[4,1]; 1: SSD hit, evicts 2 -> S[1,2].
    r = simulate(singles(), "lru", 2, ssd_blocks_per_shard=2, admit="all")
    assert r.hits.runs == [0, 0, 0, 1, 0, 1, 1, 1, 1]
    assert (r.tiers.dram_blocks, r.tiers.ssd_blocks) == (1, 4)
    assert r.tier_counters == {"dram_objects": 2, "ssd_objects": 2, "evictions": 6, "ssd_writes": 6,
                               "ssd_overwrites": 4, "ssd_admit_skips": 0, "ssd_hits": 4, "promotions": 4}


def test_admit_hit_exact():
    # Only blocks hit while in DRAM go to the log: 1 (hit at request 5) is the only one, written when
    # 3 is PUT at request 7, and read back at request 8; 2, 3, 4, and 1's first copy are skipped.
    r = simulate(singles(), "lru", 2, ssd_blocks_per_shard=2, admit="hit")
    assert r.hits.runs == [0, 0, 0, 0, 0, 1, 0, 0, 1]
    assert (r.tiers.dram_blocks, r.tiers.ssd_blocks) == (1, 1)
    c = r.tier_counters
    assert (c["ssd_writes"], c["ssd_admit_skips"], c["ssd_hits"], c["promotions"]) == (1, 5, 1, 1)


def test_dram_only_is_the_one_level_model():
    t = singles()
    one = simulate(t, "lru", 2)
    assert one.tiers is None and one.tier_counters is None
    assert one.hits.runs == [0, 0, 0, 0, 0, 1, 0, 0, 0]


def test_promoted_block_keeps_its_record():
    # A block read from SSD stays in the log; evicted from DRAM again it is not rewritten.
    s = TieredShard("lru", 1, 4)
    s.put(b"a", None)
    s.put(b"b", None)  # a -> log
    assert s.get(b"a", None) == "ssd"  # promoted; b -> log
    s.put(b"c", None)  # a evicted again: its record is still there
    assert list(s.ssd) == [b"a", b"b"] and s.ssd_writes == 2
    assert s.lookup([b"a", b"b", b"c", b"x"]) == 3
    assert s.get(b"x", None) == "miss"


@pytest.mark.parametrize("policy", ["lru", "prefix-lfu"])
def test_a_log_holding_everything_is_infinite(policy):
    rng = random.Random(3)
    reqs = []
    for t in range(200):
        doc = rng.randrange(30)
        ids = [doc * 10 + j for j in range(rng.randrange(1, 6))]
        reqs.append(Request(t, 16 * len(ids), 1, ids))
    trace = Trace(reqs, 16)
    per = shard_capacity(trace, 0.05, 2)
    big = trace.unique_blocks
    r = simulate(trace, policy, per, default_servers(2), ssd_blocks_per_shard=big, admit="all")
    assert r.hits.runs == infinite(trace).runs
    assert r.tiers.dram_blocks + r.tiers.ssd_blocks == r.hits.hit_blocks
    small = simulate(trace, policy, per, default_servers(2))
    assert small.hits.hit_blocks <= r.hits.hit_blocks


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


def test_errors_and_sizes():
    with pytest.raises(ValueError):
        TieredShard("lru", 2, 2, "sometimes")
    with pytest.raises(ValueError):
        simulate(singles(), "lru", 2, ssd_blocks_per_shard=2, admit="never")
    assert ssd_bytes_for(10, 8192) == 10 * 12288
    assert ssd_bytes_for(1, 1 << 20) == (1 << 20) + 4096


def test_tier_stats_sums_and_mean_read_time():
    s = tier_stats({"a": {"ssd_reads": 2, "ssd_read_us_total": 300, "ssd_hits": 2},
                    "b": {"ssd_reads": 1, "ssd_read_us_total": 300}, "c": "down"})
    assert (s["ssd_reads"], s["ssd_hits"], s["ssd_read_us"]) == (3, 2, 200)
    assert tier_stats({})["ssd_read_us"] is None
