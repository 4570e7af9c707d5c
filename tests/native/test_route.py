"""Batch rendezvous routing in C (csrc/kvf_route.c) against the pure-Python spec (kvfabric.sharding).

The C path must give the reference's answer bit for bit: the same owners in
the same order for every key, server list and replica count, the same
grouping (dict order included), and the same errors, because a client that
routes differently from its peers turns the pool into a cold cache.
"""

from __future__ import annotations

import random
import threading
from array import array

import pytest
import xxhash

from kvfabric import sharding

native = pytest.importorskip("kvfabric._native")


def _servers(rng: random.Random, n: int) -> list[str]:
    out: set[str] = set()
    while len(out) < n:
        out.add(f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(1, 65536)}")
    return sorted(out, key=lambda _: rng.random())


def _keys(rng: random.Random, n: int, lengths=(1, 2, 8, 15, 16, 17, 31, 32, 33, 64)) -> list[bytes]:
    return [rng.randbytes(rng.choice(lengths)) for _ in range(n)]


def test_the_public_functions_use_the_c_path():
    assert sharding._c_owners is native.route_owners
    assert sharding._c_groups is native.route_groups


@pytest.mark.parametrize("seed", range(12))
def test_owner_table_matches_the_reference(seed):
    rng = random.Random(seed)
    servers = _servers(rng, rng.randint(1, 12))
    keys = _keys(rng, rng.randint(1, 600))
    for replicas in sorted({1, 2, len(servers), rng.randint(1, len(servers))}):
        if replicas > len(servers):
            continue
        assert sharding.owner_table(keys, servers, replicas) == sharding.reference_owner_table(keys, servers, replicas)


@pytest.mark.parametrize("seed", range(12))
def test_group_by_owner_matches_the_reference_including_dict_order(seed):
    rng = random.Random(100 + seed)
    servers = _servers(rng, rng.randint(1, 12))
    keys = _keys(rng, rng.randint(1, 2500))
    got = sharding.group_by_owner(keys, servers)
    want = sharding.reference_group_by_owner(keys, servers)
    assert list(got.items()) == list(want.items())


def test_long_prompt_keys_and_long_keys():
    # The benchmark's shape (2,000 16-byte chained keys over 4 shards) and keys past xxh3's
    # short-input paths (129..240 and > 240 bytes take other code in xxHash).
    servers = [f"127.0.0.1:{7000 + i}" for i in range(4)]
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(2000)]
    keys += _keys(random.Random(7), 200, lengths=(65, 128, 129, 200, 240, 241, 1000, 5000))
    assert sharding.group_by_owner(keys, servers) == sharding.reference_group_by_owner(keys, servers)
    for r in (1, 3, 4):
        assert sharding.owner_table(keys, servers, r) == sharding.reference_owner_table(keys, servers, r)


def test_ties_rank_the_lower_index_first():
    # Equal seeds give equal scores for every key: the reference's (-score, index) sort puts the
    # lower index first, and a tie with the worst kept owner does not displace it.
    rng = random.Random(3)
    seeds = [11, 22, 11, 33, 22, 11]
    packed = array("Q", seeds).tobytes()
    for key in _keys(rng, 200):
        want_all = [i for _, i in sorted((-xxhash.xxh3_64_intdigest(key, seed=s), i) for i, s in enumerate(seeds))]
        for r in range(1, len(seeds) + 1):
            assert native.route_owners([key], packed, r) == [want_all[:r]]
        assert native.route_groups([key], packed) == {want_all[0]: [0]}


def test_golden_owners_through_the_batch_path():
    servers = ["127.0.0.1:7070", "127.0.0.1:7071", "127.0.0.1:7072"]
    golden = [(b"a", [1, 0, 2]), (b"key-0", [0, 1, 2]), (bytes(16), [1, 0, 2]), (bytes(range(16)), [1, 2, 0])]
    keys = [k for k, _ in golden]
    assert sharding.owner_table(keys, servers, 3) == [r for _, r in golden]
    assert sharding.group_by_owner(keys, servers) == {1: [0, 2, 3], 0: [1]}


def test_odd_keys_fall_back_to_the_reference():
    servers = ["a:1", "b:2", "c:3"]
    mixed = [b"x", bytearray(b"y"), memoryview(b"z"), b"w"]
    assert sharding.owner_table(mixed, servers, 2) == sharding.reference_owner_table(mixed, servers, 2)
    assert sharding.group_by_owner(mixed, servers) == sharding.reference_group_by_owner(mixed, servers)
    assert sharding.group_by_owner(iter([b"x", b"y"]), servers) == sharding.reference_group_by_owner([b"x", b"y"], servers)
    assert sharding.group_by_owner([], servers) == {} and sharding.owner_table([], servers) == []
    with pytest.raises(TypeError, match="a key must be bytes, got str"):
        sharding.group_by_owner([b"x", "y"], servers)
    with pytest.raises(ValueError, match="must not be empty"):
        sharding.owner_table([b"x", b""], servers)
    with pytest.raises(ValueError, match="replicas"):
        sharding.owner_table([b"x"], servers, 4)
    with pytest.raises(TypeError):
        sharding.owner_table([b"x"], servers, True)
    with pytest.raises(ValueError, match="duplicate"):
        sharding.group_by_owner([b"x"], ["a:1", "a:1"])
    with pytest.raises(ValueError):
        sharding.group_by_owner([b"x"], [])
    with pytest.raises(TypeError):
        sharding.group_by_owner([b"x"], "a:1")


def test_binding_checks_its_arguments():
    packed = array("Q", [1, 2]).tobytes()
    with pytest.raises(ValueError):
        native.route_owners([b"k"], b"", 1)
    with pytest.raises(ValueError):
        native.route_owners([b"k"], b"1234567", 1)
    with pytest.raises(ValueError):
        native.route_owners([b"k"], packed, 3)
    with pytest.raises(ValueError):
        native.route_owners([b"k"], packed, 0)
    with pytest.raises(TypeError):
        native.route_groups(5, packed)
    assert native.route_owners([b"k", b""], packed, 1) is None
    assert native.route_groups([b"k", bytearray(b"k")], packed) is None


def test_many_threads_route_at_once():
    # The hashing runs with the GIL released: concurrent callers each get the reference's answer.
    servers = [f"h{i}:1" for i in range(5)]
    keys = _keys(random.Random(9), 3000)
    want = sharding.reference_owner_table(keys, servers, 2)
    got: list = [None] * 6

    def work(i: int) -> None:
        got[i] = [sharding.owner_table(keys, servers, 2) == want for _ in range(5)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[True] * 5] * 6


def test_check_keys_is_the_clients_key_check():
    from kvfabric.client import Client

    ok = [b"k" * n for n in (1, 16, 64)]
    assert native.check_keys(ok, 64) and native.check_keys(tuple(ok), 64) and native.check_keys([], 64)
    for bad in ([b""], [b"k" * 65], [bytearray(b"k")], ["k"], [memoryview(b"k")], [1]):
        assert not native.check_keys(ok + bad, 64)
        with pytest.raises((TypeError, ValueError)):
            Client._keys(ok + bad)
    assert not native.check_keys(iter(ok), 64)  # not a list or tuple: the caller's loop decides
    assert Client._keys(iter(ok)) == ok and Client._keys(tuple(ok)) == ok


@pytest.mark.parametrize("seed", range(6))
def test_repeated_placement_keys_route_like_the_reference(seed):
    # Placement keys repeat for every part of a group (chunk-major: L copies in a row); the C
    # path routes a key equal to the previous one once and copies its owners. Runs of equal keys,
    # equal keys that are not adjacent, and equal bytes in distinct objects all give the spec's answer.
    rng = random.Random(500 + seed)
    servers = _servers(rng, rng.randint(1, 10))
    base = _keys(rng, 40)
    keys: list[bytes] = []
    for _ in range(300):
        k = rng.choice(base)
        keys.extend(bytes(bytearray(k)) if rng.random() < 0.5 else k for _ in range(rng.randint(1, 33)))
    for replicas in sorted({1, 2, len(servers)}):
        if replicas <= len(servers):
            assert sharding.owner_table(keys, servers, replicas) == sharding.reference_owner_table(keys, servers, replicas)
    assert list(sharding.group_by_owner(keys, servers).items()) == list(sharding.reference_group_by_owner(keys, servers).items())
