"""Planning of grouped keys (kvfabric/_plan.py, issue 23): requests of whole groups, whole-group runs."""

from __future__ import annotations

import random

import pytest

from kvfabric._plan import check_contiguous_groups, plan_groups, whole_group_run, whole_groups


def test_groups_are_never_split_and_parts_are_consecutive():
    # two interleaved groups (layer-major order) become two runs, in order of their first key
    group = [b"a", b"b", b"a", b"b", b"c"]
    reqs, refused = plan_groups(range(5), group.__getitem__, max_keys=8, max_payload=1 << 20)
    assert (reqs, refused) == ([[0, 2, 1, 3, 4]], [])
    reqs, refused = plan_groups(range(5), group.__getitem__, max_keys=3, max_payload=1 << 20)
    assert (reqs, refused) == ([[0, 2], [1, 3, 4]], [])


def test_a_group_over_a_limit_is_refused_whole():
    group = [b"a"] * 4 + [b"b"] * 2 + [b"c"]
    size = [10, 10, 10, 10, 50, 50, 500]
    reqs, refused = plan_groups(range(7), group.__getitem__, max_keys=3, max_payload=200, nbytes=size.__getitem__)
    assert refused == [0, 1, 2, 3]             # 4 keys > max_keys
    assert reqs == [[4, 5], [6]]               # a lone key over max_payload still gets its own request
    reqs, refused = plan_groups(range(6), group.__getitem__, max_keys=8, max_payload=90, nbytes=size.__getitem__)
    assert (reqs, refused) == ([[0, 1, 2, 3]], [4, 5])   # b's 100 bytes > 90


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_keep_limits_and_every_key(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 200)
    group = [bytes([rng.randrange(12)]) for _ in range(n)]
    size = [rng.randint(0, 100) for _ in range(n)]
    max_keys, max_payload = rng.randint(1, 40), rng.randint(50, 2000)
    reqs, refused = plan_groups(list(range(n)), group.__getitem__, max_keys, max_payload, size.__getitem__)
    planned = [i for r in reqs for i in r]
    assert sorted(planned + refused) == list(range(n))
    for r in reqs:
        names = [group[i] for i in r]
        runs = [g for j, g in enumerate(names) if j == 0 or names[j - 1] != g]
        assert len(runs) == len(set(runs)), f"a group appears twice in one request: {names}"
        assert len(r) == 1 or (len(r) <= max_keys and sum(size[i] for i in r) <= max_payload)
    placed = {group[i] for i in planned}
    assert not placed & {group[i] for i in refused}
    for g in placed:  # every key of a planned group is in one request
        assert len({k for k, r in enumerate(reqs) if any(group[i] == g for i in r)}) == 1


def test_whole_group_run_and_presence():
    group = [b"a", b"a", b"b", b"b", b"b", b"c"]
    assert [whole_group_run(r, group) for r in range(7)] == [0, 0, 2, 2, 2, 5, 6]
    present = [True, True, True, False, True, True]
    whole_groups(present, group)
    assert present == [True, True, False, False, False, True]
    check_contiguous_groups(group)
    with pytest.raises(ValueError, match="consecutive"):
        check_contiguous_groups([b"a", b"b", b"a"])
