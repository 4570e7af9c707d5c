"""The RAG trace generator: determinism, prefix structure, tenants, follow-ups, parameters."""

from __future__ import annotations

import pytest

from kvfabric.bench.ragtrace import RagConfig, _Interner, block_ids, generate, main
from kvfabric.bench.traces import load_trace


def test_block_ids_pieces_and_partial_block():
    intern = _Interner()
    a, n = block_ids([("sys", 10), ("d1", 7)], 8, "root", intern)
    assert n == 17 and len(a) == 3  # 8 + 8 + 1 (partial)
    b, _ = block_ids([("sys", 10), ("d1", 7), ("q", 5)], 8, "root", intern)
    assert b[:2] == a[:2] and b[2] != a[2]  # the partial block differs once it grows
    c, _ = block_ids([("sys", 10), ("d2", 7)], 8, "root", intern)
    assert c[0] == a[0] and c[1] != a[1]  # block 1 mixes sys and the document
    d, _ = block_ids([("sys", 10), ("d1", 7)], 8, "other-tenant", intern)
    assert not set(d) & set(a)


def test_deterministic_for_a_seed():
    cfg = RagConfig(requests=200, seed=3)
    assert [r.to_json() for r in generate(cfg)] == [r.to_json() for r in generate(cfg)]
    other = generate(RagConfig(requests=200, seed=4))
    assert [r.hash_ids for r in other] != [r.hash_ids for r in generate(cfg)]


def test_structure_followups_tenants_and_reuse():
    cfg = RagConfig(requests=600, seed=1, tenants=3, followup_prob=0.5, max_turns=3)
    t = generate(cfg)
    assert len(t) == 600 and t.block_tokens == cfg.block_tokens
    ts = [r.timestamp for r in t]
    assert ts == sorted(ts)
    by_session: dict[str, list] = {}
    for r in t:
        by_session.setdefault(r.session, []).append(r)
        assert r.tenant in {"t0", "t1", "t2"}
        assert len(r.hash_ids) == -(-r.input_length // cfg.block_tokens)
    multi = [rs for rs in by_session.values() if len(rs) > 1]
    assert multi and max(len(rs) for rs in multi) <= cfg.max_turns
    for rs in multi:  # a follow-up holds every whole block of the previous turn as its prefix
        for prev, nxt in zip(rs, rs[1:]):
            whole = prev.input_length // cfg.block_tokens
            assert nxt.hash_ids[:whole] == prev.hash_ids[:whole]
            assert nxt.input_length > prev.input_length
    ids_by_tenant: dict[str, set] = {}
    for r in t:
        ids_by_tenant.setdefault(r.tenant, set()).update(r.hash_ids)
    sets = list(ids_by_tenant.values())
    assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    assert t.unique_blocks < t.total_blocks  # popular documents and templates repeat


def test_more_skew_more_reuse():
    def reuse(zipf):
        t = generate(RagConfig(requests=400, seed=2, zipf=zipf, followup_prob=0.0))
        return 1 - t.unique_blocks / t.total_blocks

    assert reuse(1.4) > reuse(0.2)


@pytest.mark.parametrize("kw", [dict(requests=0), dict(top_k=5000), dict(zipf=-1), dict(followup_prob=2),
                                dict(doc_tokens_min=10, doc_tokens_max=5), dict(rate=0)])
def test_bad_parameters(kw):
    with pytest.raises(ValueError):
        generate(RagConfig(**kw))


def test_cli_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "rag.jsonl"
    assert main(["--out", str(out), "--requests", "50", "--block-tokens", "128", "--tenants", "1"]) == 0
    t = load_trace(out)
    assert len(t) == 50 and t.block_tokens == 128
    assert main(["--out", str(out), "--requests", "-1"]) == 2


def test_documents_are_written_as_chunks_with_position_independent_ids():
    from kvfabric.bench.traces import check_chained

    t = generate(RagConfig(requests=300, seed=3, block_tokens=64))
    check_chained(t)
    by_len: dict[int, list[int]] = {}
    for r in t.requests:
        assert r.chunks
        for start, n, ids in r.chunks:
            assert start + n <= r.input_length and len(ids) == -(-n // 64)
            by_len.setdefault(ids[0], []).append(start)
    # Some document's chunk appears at two different positions.
    assert any(len(set(starts)) > 1 for starts in by_len.values())


def test_musique_preset_and_flags_override_it(capsys):
    import argparse

    from kvfabric.bench.ragtrace import PRESETS, add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--preset", "musique", "--requests", "40"]))
    assert cfg.requests == 40 and cfg.top_k == 10 and cfg.followup_prob == 0.0 and cfg.block_tokens == 16
    assert config_from_args(p.parse_args([])) == RagConfig()
    t = generate(RagConfig(**PRESETS["musique"]))
    from kvfabric.bench.belady import infinite_chunks

    pre, ch = infinite_chunks(t)
    # Calibrated on the bundled MuSiQue traces: ~1% prefix reuse, ~16% of tokens reusable as chunks.
    assert pre.token_hit_rate < 0.03 and 0.12 < ch.token_hit_rate < 0.2


def test_workload_shares_count_followups_and_their_reuse_by_hand():
    from kvfabric.bench.ragtrace import workload_shares
    from kvfabric.bench.traces import Request, Trace

    bt = 4
    reqs = [
        Request(0.0, 8, 1, [1, 2], "t0", "s0"),        # first turn: nothing seen
        Request(1.0, 12, 1, [1, 2, 3], "t0", "s0"),    # follow-up: 2 blocks (8 tokens) reused
        Request(2.0, 6, 1, [1, 9], "t0", "s1"),        # first turn of another session: 1 block (4 tokens)
        Request(3.0, 4, 1, [1], "t0", ""),              # no session: its own conversation, 4 tokens
    ]
    sh = workload_shares(Trace(reqs, bt, "hand"))
    total = 8 + 12 + 6 + 4
    assert (sh.requests, sh.conversations, sh.followups, sh.tenants) == (4, 3, 1, 1), sh
    assert sh.followup_share == 0.25, sh
    assert sh.reuse_tokens == pytest.approx((8 + 4 + 4) / total), sh
    assert sh.followup_reuse_tokens == pytest.approx(8 / total), sh
    line = sh.line()
    assert "25.0% are follow-up turns" in line and "26.7 points are in follow-up turns" in line, line


def test_default_workload_is_followup_heavy_and_described_from_its_parameters():
    from kvfabric.bench.ragtrace import describe, workload_shares

    cfg = RagConfig(requests=600, seed=0)
    sh = workload_shares(generate(cfg))
    assert sh.tenants == cfg.tenants and sh.requests == 600, sh
    # follow-ups happen with followup_prob per turn: between none and all of them is all we pin
    assert 0.1 < sh.followup_share < 0.5, sh
    assert 0 < sh.followup_reuse_tokens < sh.reuse_tokens <= 1, sh
    none = workload_shares(generate(RagConfig(requests=300, seed=0, followup_prob=0.0)))
    assert none.followups == 0 and none.followup_reuse_tokens == 0, none
    text = describe(cfg)
    for part in ("2 tenant(s) x 3 system template(s) of ~600 tokens", "3000 documents", "top-4", "Zipf(1)",
                 "follow-up probability 0.35"):
        assert part in text, text
