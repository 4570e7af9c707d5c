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


# --- issue 15: capacity arguments, chunk mode -------------------------------------------------------------------


@pytest.mark.parametrize("cap", ["inf", "nan", "0", "-1", "11"])
def test_bad_capacity_is_a_usage_error(cap, capsys):
    from kvfabric.bench.belady import main as belady_main

    assert main(["mooncake-synthetic", "--limit", "20", "--capacity", cap]) == 2
    assert belady_main(["mooncake-synthetic", "--capacity", cap]) == 2
    assert "(0, 10]" in capsys.readouterr().err


def test_belady_cli_floors_the_cache_at_one_block(capsys):
    from kvfabric.bench.belady import main as belady_main

    assert belady_main(["mooncake-synthetic", "--capacity", "0.000001"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[1] == "1"  # blocks


def chunk_trace() -> Trace:
    """Passage P (ids 100, 101) appears at two positions; passage Q (200) once; 16-token blocks."""
    return Trace([
        Request(0, 64, 1, [0, 1, 2, 3], chunks=[(16, 24, [100, 101])]),
        Request(1, 64, 1, [0, 4, 5, 6], chunks=[(32, 24, [100, 101])]),
        Request(2, 64, 1, [0, 1, 2, 3], chunks=[(16, 24, [100, 101]), (40, 16, [200])]),
    ], 16)


def test_chunk_mode_exact_counts():
    from kvfabric.bench.belady import infinite_chunks

    t = chunk_trace()
    big = simulate(t, "lru", 100, chunks=True)
    pre, ch = infinite_chunks(t)
    # Request 1: prefix hit = block 0 (16 tokens); P sits at 32..56 and was stored under chunk keys: 24 tokens.
    # Request 2: the whole prompt is a prefix hit, so its passages add nothing beyond it.
    assert big.hits.runs == pre.runs == [0, 1, 4]
    assert big.chunk_hits.hit_tokens == ch.hit_tokens == 24
    assert big.chunk_hits.hit_blocks == ch.hit_blocks == 2
    assert big.chunk_hits.total_tokens == pre.total_tokens == 192
    # Without chunk keys the prefix level is the same here, and no chunk level is reported.
    assert simulate(t, "lru", 100).chunk_hits is None
    assert simulate(t, "lru", 100).hits.runs == [0, 1, 4]


def test_chunk_hits_count_only_tokens_past_the_prefix_hit():
    from kvfabric.bench.belady import chunk_hit_blocks

    r = Request(0, 64, 1, [0, 1, 2, 3], chunks=[(8, 40, [7, 8, 9])])  # blocks of P: 8..24, 24..40, 40..48
    assert chunk_hit_blocks(r, 16, 0, [3]) == [(0, 0, 16), (0, 1, 16), (0, 2, 8)]
    assert chunk_hit_blocks(r, 16, 1, [3]) == [(0, 0, 8), (0, 1, 16), (0, 2, 8)]  # prefix covers 0..16
    assert chunk_hit_blocks(r, 16, 3, [3]) == []  # prefix covers 0..48
    assert chunk_hit_blocks(r, 16, 0, [1]) == [(0, 0, 16)]
    # Whole blocks only (a converted trace): tokens past the last whole block are in no denominator.
    short = Request(0, 50, 1, [0, 1, 2], chunks=[(8, 40, [7, 8, 9])])  # blocks cover 0..48; P ends at 48
    assert chunk_hit_blocks(short, 16, 0, [3]) == [(0, 0, 16), (0, 1, 16), (0, 2, 8)]
    cut = Request(0, 50, 1, [0, 1], chunks=[(8, 40, [7, 8, 9])])  # blocks cover 0..32 only
    assert chunk_hit_blocks(cut, 16, 0, [3]) == [(0, 0, 16), (0, 1, 8)]


def test_chunk_mode_never_beats_infinite_and_min_reference_is_between():
    from kvfabric.bench.belady import belady_chunks, infinite_chunks
    from kvfabric.bench.traces import load_trace

    t = load_trace("musique-b256").head(60)
    ip, ic = infinite_chunks(t)
    for cap in (5, 50, 200):
        bp, bc = belady_chunks(t, cap)
        r = simulate(t, "lru", cap, chunks=True)
        for p, c in ((bp, bc), (r.hits, r.chunk_hits)):
            assert p.hit_tokens <= ip.hit_tokens
            # prefix and chunk hits cover disjoint tokens, so their sum is what the pool reused
            assert p.hit_tokens + c.hit_tokens <= ip.hit_tokens + ic.hit_tokens
