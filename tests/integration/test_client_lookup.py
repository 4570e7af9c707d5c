"""Client.lookup/exists fan-out on the calling thread (kvfabric/client.py ``_converse``), real shards.

Small per-shard requests go out from the caller's thread, all shards at
once, and replies are read as they arrive. These tests pin what that must
keep from the threaded fan-out: a stalled shard, or one whose reply stops
halfway, costs only its own keys (the others' answers still count) and
nothing waits past the deadline or raises; conversations of several
requests per shard (small batches) still stop at a shard's first miss.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvfabric import protocol, sharding
from kvfabric.testing import wait_for
from kvfabric.testing.proxy import FrameProxy


def _keys(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def _spy_pool(client) -> list:
    """Record what the client hands to its thread pool from now on."""
    handed: list = []
    real = client._pool.submit

    def submit(*a, **kw):
        handed.append(a)
        return real(*a, **kw)

    client._pool.submit = submit
    return handed


def test_small_lookups_stay_on_the_calling_thread(make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses)
    keys = _keys(200, 1)
    assert client.put(keys[:150], [k * 4 for k in keys[:150]]).stored == 150
    assert client.lookup(keys) == 150  # every shard has an idle pooled connection from here on
    handed = _spy_pool(client)
    for n in (1, 3, 149, 150, 151, 200):
        assert client.lookup(keys[:n]) == min(n, 150)
    assert client.exists(keys) == [True] * 150 + [False] * 50
    assert client.lookup(keys, lease_ms=1000) == 150
    assert handed == []
    assert client.stats()["client"]["shard_errors"] == 0


def test_many_requests_per_shard_stop_at_the_first_miss(make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses, max_batch_keys=7)  # ~30 LOOKUPs per shard, one after another
    keys = _keys(300, 2)
    assert client.put(keys, [k for k in keys]).stored == 300
    owner = [o[0] for o in sharding.owner_table(keys, pool.addresses)]
    assert client.lookup(keys) == 300
    for gone in (0, 5, 77, 250, 299):
        assert client.delete([keys[gone]]) == 1
        requests = client.stats()["client"]["requests"]
        assert client.lookup(keys) == gone
        # the shard holding the gap sends nothing after the chunk that has it
        mine = [i for i in range(300) if owner[i] == owner[gone]]
        chunk_of_gap = mine.index(gone) // 7
        others = sum(-(-sum(1 for o in owner if o == s) // 7) for s in range(3) if s != owner[gone])
        assert client.stats()["client"]["requests"] - requests == others + chunk_of_gap + 1
        client.put([keys[gone]], [keys[gone]])
    assert client.lookup(keys) == 300


def test_stalled_shard_costs_only_its_keys(pair, make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses, timeout_s=3.0, reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.2)
    keys = _keys(120, 3)
    assert client.put(keys, keys).stored == 120
    owner = [o[0] for o in sharding.owner_table(keys, pool.addresses)]
    assert client.lookup(keys) == 120
    stalled = pool[2]
    with stalled.paused():
        # The shard is still marked up: its LOOKUP goes out and is never answered.
        assert client.lookup(keys) == owner.index(2)
        st = client.stats(timeout_s=0.5)["client"]
        assert st["timeouts"] >= 1 and st["shards"][stalled.address]["up"] is False
        elsewhere = [k for k, o in zip(keys, owner) if o != 2]
        assert client.lookup(elsewhere) == len(elsewhere)  # the others' connections are fine
        assert client.exists(keys) == [o != 2 for o in owner]
    assert wait_for(lambda: client.stats()["client"]["shards"][stalled.address]["up"])
    assert wait_for(lambda: client.lookup(keys) == 120)


class HalfReplyProxy(FrameProxy):
    """A loopback TCP proxy to ``target``; once armed, the next LOOKUP reply stops after 10 bytes
    and nothing more is forwarded on that connection (the server looks alive, the reply never ends)."""

    parse_replies = True

    def __init__(self, target: str) -> None:
        self.armed = threading.Event()
        self.cut = threading.Event()
        super().__init__(target)

    def reply_frame(self, h, head, rest):
        if h.opcode == protocol.Op.LOOKUP and self.armed.is_set():
            self.cut.set()
            return None
        return bytes(head) + bytes(rest)


def test_reply_stopping_halfway_costs_only_its_shard(pair, make_pool, make_client):
    if pair[1] == "shm":
        pytest.skip("shm requests bypass a TCP proxy (they go to the server's unix socket)")
    pool = make_pool(3)
    proxy = HalfReplyProxy(pool[2].address)
    try:
        addresses = [pool[0].address, pool[1].address, proxy.address]
        client = make_client(addresses, timeout_s=3.0, reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.2)
        # Prompt order: shard 0, shard 1, three more of shard 0, the key of shard 1 that is
        # missing (index 5), then the proxied shard's keys. Shard 1 answering "first miss at 5"
        # is what makes the run 5; losing its answer would make it 1.
        # keys route over the ids the servers report (the proxied shard's is pool[2]'s own address)
        client.exists([b"warm-up"])  # every shard has said HELLO
        ids = [s.address for s in pool]
        assert sorted(client.members) == sorted(ids)
        by_owner: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
        for k in _keys(400, 4):
            by_owner[sharding.owners(k, ids)[0]].append(k)
        keys = [by_owner[0][0], by_owner[1][0], *by_owner[0][1:4], by_owner[1][1], *by_owner[2][:5]]
        assert client.put(keys, keys).stored == len(keys)
        assert client.delete([keys[5]]) == 1
        assert client.lookup(keys) == 5
        proxy.armed.set()
        assert client.lookup(keys) == 5
        assert proxy.cut.is_set()
        st = client.stats(timeout_s=0.5)["client"]
        assert st["timeouts"] >= 1 and st["shards"][proxy.address]["up"] is False
    finally:
        proxy.close()
