"""The serving benchmark's workload (kvfabric.bench._serve_workload): sessions, scale, token synthesis."""

from __future__ import annotations

import pytest

from kvfabric.bench._serve_workload import build_workload, sample_sessions
from kvfabric.bench.traces import Request, Trace, load_trace

BT = 512


def _trace() -> Trace:
    # two sessions of two turns (sharing their first two blocks), one lone request
    reqs = [Request(0, 1100, 64, [0, 1, 2]),
            Request(10, 1100, 64, [0, 5, 6]),
            Request(20, 1600, 128, [0, 1, 2, 3]),
            Request(30, 2000, 32, [0, 5, 6, 7]),
            Request(40, 600, 16, [9, 10])]
    return Trace(reqs, BT, "t")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_sessions_keep_every_turn_and_drop_lone_requests():
    sessions = sample_sessions(_trace(), 5, seed=0)
    assert sorted(len(s) for s in sessions) == [2, 2], sessions
    assert all(s[0].timestamp < s[1].timestamp for s in sessions)


def test_equal_ids_give_equal_tokens_and_the_scale_is_applied():
    w = build_workload(_trace(), sessions=2, seed=0, block_tokens=32, max_model_len=4096)
    assert w.scale == 32 / BT and len(w.requests) == 4 and w.sessions == 2
    by_ids = {r.hash_ids: r for r in w.requests}
    first, second = by_ids[(0, 1, 2)], by_ids[(0, 1, 2, 3)]
    assert first.prompt_len == -(-1100 * 32 // BT) == 69 and first.max_tokens == round(64 * 32 / BT) == 4
    t1, t2 = first.tokens(32, 2048, 1), second.tokens(32, 2048, 1)
    assert len(t1) == 69 and len(t2) == 100
    # the turns share 3 block ids: 96 tokens, except that the first turn's last block is partial (5 of 32)
    assert _common_prefix(t1, t2) == 69
    other = by_ids[(0, 5, 6)].tokens(32, 2048, 1)
    assert _common_prefix(t2, other) == 32           # only block id 0 is shared
    assert all(8 <= t < 2040 for t in t1 + t2 + other)
    assert second.tokens(32, 2048, 2)[:32] != t2[:32], "another epoch must give other tokens"
    assert second.tokens(32, 2048, 1) == t2, "tokens are deterministic"


def test_prompts_are_cut_to_fit_max_model_len_and_counted():
    w = build_workload(_trace(), sessions=2, seed=0, block_tokens=256, max_model_len=800, output_scale=1.0)
    for r in w.requests:
        assert r.prompt_len + r.max_tokens <= 800, r
        assert r.prompt_len <= len(r.hash_ids) * 256
    assert w.truncated >= 2, w.describe()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_tokens"):
        build_workload(_trace(), sessions=1, seed=0, block_tokens=0, max_model_len=100)
    with pytest.raises(ValueError, match="no room"):
        build_workload(_trace(), sessions=2, seed=0, block_tokens=64, max_model_len=128, output_scale=1.0)
    with pytest.raises(ValueError, match="no two requests"):
        build_workload(Trace([Request(0, 600, 16, [9, 10])], BT, "lone"), sessions=1, seed=0, block_tokens=32,
                       max_model_len=1024)


def test_bundled_conversation_trace_has_reuse_inside_sessions():
    w = build_workload(load_trace("mooncake-conversation"), sessions=12, seed=0, block_tokens=32,
                       max_model_len=3072)
    d = w.describe()
    assert d["sessions"] == 12 and d["requests"] > 12, d
    assert d["infinite_block_hit_rate"] > 0.3, d      # the head of the trace alone has ~4%


def test_reusable_tokens_count_whole_chunks_of_the_seen_prefix_short_of_the_last_token():
    w = build_workload(_trace(), sessions=2, seed=0, block_tokens=32, max_model_len=4096)
    by_ids = {r.hash_ids: r for r in w.requests}
    # second turns: (0,1,2,3) had 3 blocks seen (96 tokens), (0,5,6,7) too; first turns: only block 0 of
    # the session drawn second (32 tokens); everything cut to whole chunks
    assert w.reusable_tokens(32) == 32 + 96 + 96, [(r.hash_ids, r.prompt_len) for r in w.requests]
    assert w.reusable_tokens(64) == 0 + 64 + 64
    assert w.reusable_tokens(128) == 0
    # a prompt no longer than what was seen still computes its last token
    seen_all = build_workload(Trace([Request(0, 512, 16, [0, 1]), Request(1, 512, 16, [0, 1])], BT, "same"),
                              sessions=1, seed=0, block_tokens=32, max_model_len=4096)
    (first, second) = seen_all.requests
    assert second.prompt_len == 32 and seen_all.reusable_tokens(1) == second.prompt_len - 1
