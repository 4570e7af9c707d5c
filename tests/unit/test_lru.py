"""The LRU policy on its own: exact victim order, pins skipped, removals."""

from kvfabric.server.eviction import LRUPolicy, make_policy


def never(_key):
    return False


def test_evicts_in_insertion_order_without_accesses():
    p = make_policy("lru")
    for k in (b"a", b"b", b"c"):
        p.on_insert(k, 1)
    assert [p.evict(never), p.evict(never), p.evict(never), p.evict(never)] == [b"a", b"b", b"c", None]
    assert len(p) == 0


def test_access_moves_to_most_recent():
    p = LRUPolicy()
    for k in (b"a", b"b", b"c"):
        p.on_insert(k, 1)
    p.on_access(b"a")
    p.on_access(b"missing")  # unknown keys are ignored
    assert p.evict(never) == b"b"
    assert p.evict(never) == b"c"
    assert p.evict(never) == b"a"


def test_pinned_keys_are_skipped_and_keep_place():
    p = LRUPolicy()
    for k in (b"a", b"b", b"c"):
        p.on_insert(k, 1)
    pinned = {b"a"}
    assert p.evict(lambda k: k in pinned) == b"b"
    assert b"a" in p and b"b" not in p
    pinned.clear()
    assert p.evict(never) == b"a"
    assert p.evict(lambda k: True) is None
    assert len(p) == 1


def test_remove_forgets_key():
    p = LRUPolicy()
    p.on_insert(b"a", 1)
    p.on_insert(b"b", 1)
    p.on_remove(b"a")
    p.on_remove(b"zzz")
    assert len(p) == 1 and p.evict(never) == b"b"
