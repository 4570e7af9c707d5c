"""Rendezvous sharding (kvfabric.sharding): golden owners, movement, balance."""

from __future__ import annotations

import collections

import pytest
import xxhash

from kvfabric import sharding

SERVERS = ["127.0.0.1:7070", "127.0.0.1:7071", "127.0.0.1:7072"]


def test_score_is_the_documented_formula():
    key = bytes(range(16))
    for s in SERVERS:
        seed = xxhash.xxh3_64_intdigest(s.encode())
        assert sharding.score(s, key) == xxhash.xxh3_64_intdigest(key, seed=seed)


# Pinned so that every client version agrees on who owns what: a change here
# silently turns every pool into a cold cache.
GOLDEN = [
    (b"a", [1, 0, 2], 0x553796C4BF81B3F8),
    (b"key-0", [0, 1, 2], 0xED99DB8BA26E8E80),
    (bytes(16), [1, 0, 2], 0x1F4E92681377F977),
    (bytes(range(16)), [1, 2, 0], 0x075E535788C58B0E),
]


@pytest.mark.parametrize("key,ranking,score0", GOLDEN)
def test_golden_owners(key, ranking, score0):
    assert sharding.score(SERVERS[0], key) == score0
    assert sharding.owners(key, SERVERS, replicas=3) == ranking
    assert sharding.owners(key, SERVERS) == ranking[:1]
    assert sharding.owners(key, SERVERS, replicas=2) == ranking[:2]


def _keys(n):
    return [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(n)]


def test_balance_three_servers_100k_keys():
    keys = _keys(100_000)
    groups = sharding.group_by_owner(keys, SERVERS)
    counts = [len(groups.get(i, [])) for i in range(3)]
    assert sum(counts) == 100_000
    for c in counts:
        assert abs(c - 100_000 / 3) / (100_000 / 3) < 0.03, counts


def test_group_by_owner_keeps_key_order_and_matches_owners():
    keys = _keys(500)
    groups = sharding.group_by_owner(keys, SERVERS)
    seen = []
    for server, idx in groups.items():
        assert idx == sorted(idx)
        for i in idx:
            assert sharding.owners(keys[i], SERVERS)[0] == server
        seen += idx
    assert sorted(seen) == list(range(500))


def test_adding_a_server_moves_about_one_over_n():
    keys = _keys(20_000)
    before = [sharding.owners(k, SERVERS)[0] for k in keys]
    grown = SERVERS + ["127.0.0.1:7073"]
    after = [sharding.owners(k, grown)[0] for k in keys]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    # Only keys that now belong to the new server move; nothing is reshuffled
    # among the old ones.
    assert all(a == 3 for _, a in moved)
    assert abs(len(moved) / len(keys) - 1 / 4) < 0.02


def test_removing_a_server_moves_only_its_keys():
    keys = _keys(20_000)
    before = [sharding.owners(k, SERVERS)[0] for k in keys]
    shrunk = SERVERS[:1] + SERVERS[2:]  # drop index 1
    after = [shrunk[sharding.owners(k, shrunk)[0]] for k in keys]
    moved = 0
    for k, b, a in zip(keys, before, after):
        if SERVERS[b] != a:
            assert b == 1, "a key not owned by the removed server moved"
            moved += 1
    assert abs(moved / len(keys) - 1 / 3) < 0.02


def test_replicas_are_distinct_and_ordered_by_score():
    keys = _keys(2000)
    table = sharding.owner_table(keys, SERVERS, replicas=3)
    for k, row in zip(keys, table):
        assert sorted(row) == [0, 1, 2]
        scores = [sharding.score(SERVERS[i], k) for i in row]
        assert scores == sorted(scores, reverse=True)
    two = sharding.owner_table(keys, SERVERS, replicas=2)
    assert all(len(set(r)) == 2 for r in two)


def test_owner_is_independent_of_server_list_order():
    keys = _keys(300)
    rev = list(reversed(SERVERS))
    for k in keys:
        assert SERVERS[sharding.owners(k, SERVERS)[0]] == rev[sharding.owners(k, rev)[0]]


def test_bad_input():
    with pytest.raises(ValueError):
        sharding.owners(b"k", [])
    with pytest.raises(ValueError):
        sharding.owners(b"k", ["a:1", "a:1"])
    with pytest.raises(ValueError):
        sharding.owners(b"k", SERVERS, replicas=4)
    with pytest.raises(ValueError):
        sharding.owners(b"k", SERVERS, replicas=0)
    with pytest.raises(TypeError):
        sharding.owners("k", SERVERS)
    with pytest.raises(ValueError):
        sharding.owners(b"", SERVERS)
    with pytest.raises(TypeError):
        sharding.owners(b"k", "127.0.0.1:7070")
    with pytest.raises(ValueError):
        sharding.owners(b"k", [""])


def test_single_server_owns_everything():
    keys = _keys(100)
    assert sharding.group_by_owner(keys, ["h:1"]) == {0: list(range(100))}
    assert collections.Counter(r[0] for r in sharding.owner_table(keys, ["h:1"])) == {0: 100}


@pytest.mark.parametrize("table,groups", [
    (sharding.owner_table, sharding.group_by_owner),
    (sharding.reference_owner_table, sharding.reference_group_by_owner),
], ids=["public", "reference"])
def test_batch_functions_agree_with_owners(table, groups):
    # The public batch functions run in C when the extension is built; the reference is what a
    # client-only install runs. Both must give owners()'s answer (tests/native/test_route.py
    # compares them on random inputs).
    keys = [k for k, _, _ in GOLDEN] + _keys(300)
    for r in (1, 2, 3):
        assert table(keys, SERVERS, r) == [sharding.owners(k, SERVERS, r) for k in keys]
    want: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        want.setdefault(sharding.owners(k, SERVERS)[0], []).append(i)
    assert list(groups(keys, SERVERS).items()) == list(want.items())


def test_without_the_extension_the_public_functions_run_the_reference(monkeypatch):
    # A client-only install has no kvfabric._native: the batch functions must still answer.
    keys = _keys(200)
    want_table = sharding.reference_owner_table(keys, SERVERS, 2)
    want_groups = sharding.reference_group_by_owner(keys, SERVERS)
    monkeypatch.setattr(sharding, "_c_owners", None)
    monkeypatch.setattr(sharding, "_c_groups", None)
    assert sharding.owner_table(keys, SERVERS, 2) == want_table
    assert list(sharding.group_by_owner(keys, SERVERS).items()) == list(want_groups.items())


# Routing by placement key (kvfabric.Client's placement=): pinned like GOLDEN. Every object routed by
# a placement key gets exactly that key's ranking, whatever its own key is.
SERVERS4 = SERVERS + ["127.0.0.1:7073"]
GOLDEN_PLACEMENT = [
    (b"chunk-0", [2, 3, 0, 1], 0xB22C9AD3ED873DD5),
    (bytes(16), [1, 3, 0, 2], 0x1F4E92681377F977),
    (bytes(range(16, 32)), [3, 2, 1, 0], 0x06D8FECA4D35E2309),
    (b"segment-a", [2, 3, 1, 0], 0x031C41B47C167624),
]


@pytest.mark.parametrize("placement,ranking,score0", GOLDEN_PLACEMENT)
@pytest.mark.parametrize("batch", [sharding.owner_table, sharding.reference_owner_table])
def test_golden_owners_by_placement_key(placement, ranking, score0, batch):
    assert sharding.score(SERVERS4[0], placement) == score0
    objects = [placement + b"|layer-%d" % l for l in range(32)]  # 32 layer objects of one chunk
    route = sharding.route_keys(objects, [placement] * len(objects))
    for replicas in (1, 2, 4):
        table = batch(route, SERVERS4, replicas)
        assert table == [ranking[:replicas]] * len(objects), (replicas, table[:3])
    # their own keys would have spread them: the placement key is what keeps them together
    assert len({tuple(r) for r in sharding.owner_table(objects, SERVERS4, 1)}) > 1


def test_route_keys_checks_lengths_and_types():
    keys = [b"a", b"b"]
    assert sharding.route_keys(keys, None) is keys
    assert sharding.route_keys(keys, (b"p", b"p")) == (b"p", b"p")
    with pytest.raises(ValueError, match="2 keys but 1 placement"):
        sharding.route_keys(keys, [b"p"])
    with pytest.raises(TypeError, match="not a single key"):
        sharding.route_keys(keys, b"pp")
    with pytest.raises(ValueError, match="must not be empty"):
        sharding.reference_owner_table(sharding.route_keys(keys, [b"p", b""]), SERVERS)
