"""Placement keys (``Client.put/get/lookup/exists/delete(..., placement=)``, issue 23) against real servers.

A chunk's parts (its layer objects) share one placement key, so they live on
one owner set: a dead server costs only the chunks it owned, a prompt's
lookup is one request per shard, a PUT never splits a group over two frames
(a group over a frame's limits is refused whole), and LOOKUP/EXISTS count a
chunk present only when every part of it is.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric import Client, ClientConfig, sharding
from kvfabric.testing.servers import start_pool

L = 16  # parts (layer objects) per chunk


def _chunks(n: int, seed: int) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """``n`` chunks of ``L`` parts, chunk-major: (object keys, placement keys, values)."""
    rng = np.random.default_rng(seed)
    chunk_keys = [rng.bytes(16) for _ in range(n)]
    keys = [rng.bytes(16) for _ in range(n * L)]
    placement = [c for c in chunk_keys for _ in range(L)]
    values = [rng.bytes(int(rng.integers(64, 512))) for _ in keys]
    return keys, placement, values


@pytest.fixture
def pool4():
    with start_pool(4, capacity="64MiB") as pool:
        yield pool


def _client(pool, **cfg) -> Client:
    cfg.setdefault("timeout_s", 10.0)
    cfg.setdefault("connect_timeout_s", 2.0)
    return Client(pool.addresses, config=ClientConfig(**cfg))


def _requests(client: Client) -> int:
    return client.stats()["client"]["requests"]


def test_a_chunks_parts_live_on_its_placement_owner_only(pool4):
    keys, placement, values = _chunks(24, 1)
    with _client(pool4) as c:
        assert c.put(keys, values, placement=placement).stored == len(keys)
        want = sharding.owner_table(placement, c.members, 1)
        assert c.route(keys, placement=placement) == [[c.members[o[0]]] for o in want]
        for pos, addr in enumerate(pool4.addresses):
            with Client([addr], config=ClientConfig(timeout_s=10.0)) as one:
                held = one.exists(keys)
            mine = [o[0] == pos for o in want]
            assert held == mine, f"server {addr}: holds {sum(held)} objects, owns {sum(mine)}"
        assert c.get(keys, placement=placement) == values
        # each server holds its chunks as whole groups (server-side groups, issue 23 part 2)
        chunk_owner = [o[0] for o in want[::L]]
        for pos, (addr, st) in enumerate(c.stats()["servers"].items()):
            n = chunk_owner.count(pos)
            got = (st["groups"], st["group_objects"], st["groups_incomplete"])
            assert got == (n, n * L, 0), f"{addr}: (groups, group_objects, incomplete) {got}, owns {n} chunks"


def test_one_request_per_shard_per_call(pool4):
    keys, placement, values = _chunks(40, 2)
    with _client(pool4) as c:
        shards = len({o[0] for o in sharding.owner_table(placement, c.members, 1)})
        assert shards == 4, "40 chunks should reach all 4 servers"
        before = _requests(c)
        assert c.put(keys, values, placement=placement).stored == len(keys)
        after_put = _requests(c)
        assert c.lookup(keys, placement=placement) == len(keys)
        after_lookup = _requests(c)
        bufs = [bytearray(len(v)) for v in values]
        assert c.get_into(keys, bufs, placement=placement) == [len(v) for v in values]
        after_get = _requests(c)
        assert all(c.exists(keys, placement=placement))
        after_exists = _requests(c)
        counts = [after_put - before, after_lookup - after_put, after_get - after_lookup, after_exists - after_get]
        assert counts == [shards] * 4, f"requests per call (put, lookup, get, exists): {counts}, shards {shards}"


def test_a_chunk_counts_only_when_all_its_parts_are_present(pool4):
    keys, placement, values = _chunks(6, 3)
    with _client(pool4) as c:
        # each part its own server group (groups=keys), so that one part can go alone
        assert c.put(keys, values, placement=placement, groups=keys).stored == len(keys)
        assert c.lookup(keys, placement=placement) == len(keys)
        # drop one part (layer 5) of chunk 2: chunks 0 and 1 remain the leading run
        gone = 2 * L + 5
        assert c.delete([keys[gone]], placement=[placement[gone]]) == 1
        assert c.lookup(keys, placement=placement) == 2 * L
        assert c.lookup(keys) <= gone, "without placement the parts are routed by their own keys"
        present = c.exists(keys, placement=placement)
        assert present == [not 2 * L <= i < 3 * L for i in range(len(keys))]
        assert c.exists(keys[:gone] + keys[gone + 1:], placement=placement[:gone] + placement[gone + 1:]).count(False) == 0
        # stored as one server group per chunk, a chunk goes whole: deleting one part removes all L
        k2, p2, v2 = _chunks(3, 33)
        assert c.put(k2, v2, placement=p2).stored == len(k2)
        assert c.delete([k2[L + 3]], placement=[p2[L + 3]]) == L
        assert c.lookup(k2, placement=p2) == L
        assert c.exists(k2[L:2 * L], placement=p2[L:2 * L]) == [False] * L
        with pytest.raises(ValueError, match="consecutive"):
            c.lookup(keys[:L] + keys[2 * L:3 * L] + keys[L:2 * L] + keys[:1],
                     placement=placement[:L] + placement[2 * L:3 * L] + placement[L:2 * L] + placement[:1])


def test_a_group_over_a_frames_limit_is_refused_whole_and_others_still_go(pool4):
    keys, placement, values = _chunks(4, 4)
    small_keys, small_place, small_vals = _chunks(3, 5)
    small_keys, small_place, small_vals = small_keys[::2], small_place[::2], small_vals[::2]  # 8 parts each
    with _client(pool4, max_batch_keys=L - 1) as c:
        res = c.put(keys + small_keys, values + small_vals, placement=placement + small_place)
        assert (res.stored, res.dropped) == (len(small_keys), len(keys)), res
        assert not any(c.exists(keys)), "no part of a refused group may be stored"
        assert c.lookup(small_keys, placement=small_place) == len(small_keys)
        assert c.get(small_keys, placement=small_place) == small_vals


def test_segments_place_several_chunks_by_one_key_and_count_whole_chunks(pool4):
    # placement = the segment's first chunk key, groups = the chunk key: 3 chunks of a segment live
    # together, each chunk is its own group
    keys, chunk_place, values = _chunks(6, 6)
    segment = [chunk_place[(i // (3 * L)) * 3 * L] for i in range(len(keys))]
    with _client(pool4) as c:
        assert c.put(keys, values, placement=segment, groups=chunk_place).stored == len(keys)
        owners = sharding.owner_table(segment, c.members, 1)
        assert len({tuple(o) for o in owners[: 3 * L]}) == 1
        gone = 4 * L + 1  # a part of chunk 4 (second segment)
        c.delete([keys[gone]], placement=[segment[gone]])
        assert c.lookup(keys, placement=segment, groups=chunk_place) == 4 * L
        with pytest.raises(ValueError, match="two placement keys"):
            c.put(keys[:2], values[:2], placement=[segment[0], segment[-1]], groups=[chunk_place[0]] * 2)
        with pytest.raises(ValueError, match="needs placement"):
            c.exists(keys, groups=chunk_place)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dead_server_costs_only_its_chunks(pool4, replicas):
    keys, placement, values = _chunks(40, 7 + replicas)
    with _client(pool4, replicas=replicas, timeout_s=5.0) as c:
        assert c.put(keys, values, placement=placement).stored == len(keys)
        dead = 1
        pool4[dead].kill()  # SIGKILL and reaped
        owners = sharding.owner_table(placement, c.members, replicas)
        lost = [all(o == dead for o in row) for row in owners]
        got = c.get(keys, placement=placement)
        assert [g is None for g in got] == lost, f"lost {sum(lost)} objects, missed {sum(g is None for g in got)}"
        assert [g for g in got if g is not None] == [v for v, x in zip(values, lost) if not x]
        present = c.exists(keys, placement=placement)
        assert present == [not x for x in lost]
        first_lost = lost.index(True) if True in lost else len(keys)
        assert first_lost % L == 0
        assert c.lookup(keys, placement=placement) == first_lost
        if replicas == 2:
            assert first_lost == len(keys), "with two replicas one dead server loses nothing"
