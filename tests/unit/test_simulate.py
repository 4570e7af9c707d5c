"""The offline simulator: exact runs on hand-worked traces, sharding, and gap arithmetic."""

from __future__ import annotations

import pytest

from kvfabric.bench.belady import belady, infinite
from kvfabric.bench.simulate import default_servers, gap_closed, main, shard_capacity, simulate
from kvfabric.bench.traces import Request, Trace


def small() -> Trace:
    ids = [[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2]]
    return Trace([Request(i, 16 * len(x), 1, x) for i, x in enumerate(ids)], 16)


def test_lru_exact_runs():
    # Worked by hand in the module's model: LOOKUP/GET hits touch, PUT inserts after evicting.
    r = simulate(small(), "lru", 3)
    assert r.hits.runs == [0, 2, 0, 0]
    assert r.evictions == 6


def test_tail_lru_exact_runs_keep_the_head():
    # tail-lru evicts 3, then 1 (leaves) when 4, 5 arrive, so 0 survives for request 4.
    r = simulate(small(), "tail-lru", 3)
    assert r.hits.runs == [0, 2, 0, 1]


@pytest.mark.parametrize("policy", ["lru", "tail-lru", "s3fifo", "prefix-lfu"])
def test_bounded_by_belady_and_infinite(policy):
    import random

    rng = random.Random(1)
    reqs = []
    for t in range(300):
        doc = rng.choice(range(40)) if rng.random() < 0.7 else 1000 + t
        ids = [doc * 10 + j for j in range(rng.randrange(1, 6))]
        reqs.append(Request(t, 16 * len(ids), 1, ids))
    trace = Trace(reqs, 16)
    for shards in (1, 3):
        per = shard_capacity(trace, 0.1, shards)
        r = simulate(trace, policy, per, default_servers(shards))
        assert r.hits.hit_blocks <= belady(trace, per * shards).hit_blocks <= infinite(trace).hit_blocks
        assert r.hits.total_blocks == trace.total_blocks


def test_huge_capacity_equals_infinite():
    t = small()
    assert simulate(t, "s3fifo", 100, default_servers(2)).hits.runs == infinite(t).runs


def test_errors():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        simulate(small(), "nope", 3)
    with pytest.raises(ValueError):
        simulate(small(), "lru", 0)
    with pytest.raises(ValueError):
        shard_capacity(small(), 0, 1)


def test_gap_closed():
    assert gap_closed(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert gap_closed(0.2, 0.2, 0.2) is None


def test_cli_prints_table(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        f'{{"timestamp": {i}, "input_length": {16 * len(x)}, "output_length": 1, "hash_ids": {x}}}\n'
        for i, x in enumerate([[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2]])))
    assert main([str(path), "--capacity", "0.5", "--block-tokens", "16", "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "prefix-lfu" in out
    assert (tmp_path / "o.json").exists()
    assert main([str(tmp_path / "missing.jsonl")]) == 2
