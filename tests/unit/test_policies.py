"""Exact eviction orders of the prefix-aware and frequency-aware policies (pure, no server)."""

from __future__ import annotations

import pytest

from kvfabric.server.eviction import POLICIES, PrefixLFUPolicy, S3FIFOPolicy, TailLRUPolicy, make_policy


def never(key: bytes) -> bool:
    return False


def drain(policy, is_pinned=never) -> list[bytes]:
    out = []
    while (k := policy.evict(is_pinned)) is not None:
        out.append(k)
    return out


def test_registered_by_name():
    assert set(POLICIES) >= {"lru", "tail-lru", "s3fifo", "prefix-lfu"}
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="known"):
        make_policy("nope")


# ---------------------------------------------------------------- tail-lru


def test_tail_lru_eats_a_chain_from_its_tail():
    p = TailLRUPolicy()
    p.on_insert(b"a", 1, None)
    p.on_insert(b"b", 1, b"a")
    p.on_insert(b"c", 1, b"b")
    p.on_insert(b"d", 1, None)
    # Plain LRU would evict a first and leave b, c useless.
    assert drain(p) == [b"c", b"b", b"a", b"d"]
    assert len(p) == 0


def test_tail_lru_access_reorders_among_leaves():
    p = TailLRUPolicy()
    for k, parent in ((b"a", None), (b"b", b"a"), (b"c", b"b"), (b"d", None)):
        p.on_insert(k, 1, parent)
    p.on_access(b"a")  # a is not a leaf; once its chain is gone it is the most recent
    assert drain(p) == [b"c", b"b", b"d", b"a"]


def test_tail_lru_skips_pinned_leaves_and_falls_back_to_lru():
    p = TailLRUPolicy()
    for k, parent in ((b"a", None), (b"b", b"a"), (b"c", b"b"), (b"d", None)):
        p.on_insert(k, 1, parent)
    pinned = {b"c"}
    assert p.evict(pinned.__contains__) == b"d"
    # Only leaf c is pinned: fall back to LRU over unpinned keys (a), orphaning b.
    assert p.evict(pinned.__contains__) == b"a"
    assert p.evict(pinned.__contains__) == b"b"  # b has child c: only the fallback picks it
    assert p.evict(pinned.__contains__) is None
    assert b"c" in p
    assert drain(p) == [b"c"]


def test_tail_lru_remove_middle_of_chain():
    p = TailLRUPolicy()
    for k, parent in ((b"a", None), (b"b", b"a"), (b"c", b"b"), (b"d", None)):
        p.on_insert(k, 1, parent)
    p.on_remove(b"b")  # c becomes a root, a a leaf
    assert b"b" not in p and len(p) == 3
    assert drain(p) == [b"a", b"c", b"d"]


def test_tail_lru_all_pinned_returns_none():
    p = TailLRUPolicy()
    p.on_insert(b"a", 1, None)
    p.on_insert(b"b", 1, b"a")
    assert p.evict(lambda k: True) is None
    assert len(p) == 2


def test_tail_lru_parent_unknown_is_a_root():
    p = TailLRUPolicy()
    p.on_insert(b"x", 1, b"elsewhere")
    p.on_insert(b"y", 1, None)
    assert drain(p) == [b"x", b"y"]


# ---------------------------------------------------------------- s3fifo


def test_s3fifo_exact_order_with_promotion_and_ghost():
    p = S3FIFOPolicy(small_fraction=0.1)
    for k in (b"a", b"b", b"c", b"d"):
        p.on_insert(k, 1, None)
    assert p.evict(never) == b"a"  # oldest in S, never used: to the ghost
    p.on_access(b"b")
    # b was used: promoted to M; then c (unused) goes.
    assert p.evict(never) == b"c"
    p.on_insert(b"a", 1, None)  # ghost hit: straight into M (after b)
    assert drain(p) == [b"d", b"b", b"a"]


def test_s3fifo_main_reinsertion_spends_frequency():
    p = S3FIFOPolicy(small_fraction=0.5)
    for k in (b"a", b"b"):
        p.on_insert(k, 1, None)
        p.on_access(k)
    p.evict(never)  # a promoted to M, then b promoted to M, then M: a (freq 0) evicted
    assert len(p) == 1 and b"b" in p
    p.on_insert(b"c", 1, None)
    p.on_access(b"b")
    p.on_access(b"b")
    # S (c) is half of the bytes: c goes first; then b survives one pass in M.
    assert p.evict(never) == b"c"
    assert p.evict(never) == b"b"


def test_s3fifo_pinned_keep_place_and_remove():
    p = S3FIFOPolicy()
    for k in (b"a", b"b", b"c"):
        p.on_insert(k, 1, None)
    assert p.evict({b"a"}.__contains__) == b"b"
    p.on_remove(b"a")
    assert drain(p) == [b"c"]
    assert p.evict(never) is None


def test_s3fifo_rejects_bad_fraction():
    with pytest.raises(ValueError):
        S3FIFOPolicy(small_fraction=1.5)


# ---------------------------------------------------------------- prefix-lfu


def test_prefix_lfu_frequency_aging_history_and_tail_first():
    p = PrefixLFUPolicy(history_factor=8)
    p.on_insert(b"a", 1, None)
    p.on_insert(b"b", 1, b"a")
    p.on_insert(b"c", 1, None)
    p.on_access(b"c")
    p.on_access(b"c")  # c: priority 3; a, b: 1 (a has child b, so b goes first)
    assert p.evict(never) == b"b"
    assert p.evict(never) == b"a"
    p.on_insert(b"d", 1, None)  # priority L + 1 = 2
    assert p.evict(never) == b"d"
    p.on_insert(b"b", 1, None)  # remembered: freq 1 + 1 -> priority 2 + 2 = 4 > c's 3
    assert p.evict(never) == b"c"
    assert drain(p) == [b"b"]


def test_prefix_lfu_pinned_and_fallback():
    p = PrefixLFUPolicy()
    p.on_insert(b"a", 1, None)
    p.on_insert(b"b", 1, b"a")
    # Only leaf b pinned: fall back to the lowest priority unpinned key, a.
    assert p.evict({b"b"}.__contains__) == b"a"
    assert p.evict({b"b"}.__contains__) is None
    assert drain(p) == [b"b"]


def test_prefix_lfu_remove_and_len():
    p = PrefixLFUPolicy()
    for k in (b"a", b"b", b"c"):
        p.on_insert(k, 1, None)
    p.on_remove(b"b")
    p.on_remove(b"zz")  # unknown: ignored
    assert len(p) == 2 and b"b" not in p
    assert drain(p) == [b"a", b"c"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_tracks_exactly_what_was_inserted(name):
    p = make_policy(name)
    keys = [bytes([i]) for i in range(50)]
    for i, k in enumerate(keys):
        p.on_insert(k, 4096, keys[i - 1] if i % 5 else None)
        if i % 3 == 0:
            p.on_access(keys[i // 2])
    for k in keys[::7]:
        p.on_remove(k)
    left = set(keys) - set(keys[::7])
    assert len(p) == len(left)
    out = drain(p)
    assert sorted(out) == sorted(left) and len(p) == 0
