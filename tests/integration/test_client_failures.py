"""Dead, refusing, stalled and restarted shards: misses and counted drops, never exceptions."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvfabric import sharding
from kvfabric.errors import RemoteError
from kvfabric.testing.conformance import start_pool_of
from kvfabric.testing import wait_for as _wait_for
from kvfabric.testing.ports import free_port


def _data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, [k * 64 for k in keys]  # 1 KiB values derived from the key


def test_shard_killed_mid_test_then_restarted_on_the_same_port(pair, make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses, timeout_s=2.0, reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.5)
    keys, values = _data(300, 21)
    assert client.put(keys, values).stored == 300
    owner = [o[0] for o in sharding.owner_table(keys, pool.addresses)]
    dead = 1
    on_dead = [i for i in range(300) if owner[i] == dead]

    # 4 threads keep working while the shard is SIGKILLed under them.
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        try:
            while not stop.is_set():
                idx = rng.choice(300, 20, replace=False)
                got = client.get([keys[i] for i in idx])
                for i, g in zip(idx, got):
                    assert g is None or g == values[i]
                client.lookup(keys[:50])
                client.exists([keys[i] for i in idx])
                client.put([keys[i] for i in idx[:5]], [values[i] for i in idx[:5]])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    port = pool[dead].port
    pool[dead].kill()
    time.sleep(0.5)
    stop.set()
    for th in threads:
        th.join()
    assert not errors, errors[0]

    # With the shard dead: its keys miss, the others hit, its puts are counted drops.
    got = client.get(keys)
    assert [i for i, g in enumerate(got) if g is None] == on_dead
    assert all(got[i] == values[i] for i in range(300) if owner[i] != dead)
    assert client.exists(keys) == [owner[i] != dead for i in range(300)]
    assert client.lookup(keys) == on_dead[0]
    drops_before = client.stats()["client"]["dropped_puts"]
    res = client.put([keys[i] for i in on_dead[:10]], [values[i] for i in on_dead[:10]])
    assert res.dropped == 10 and res.stored == 0
    st = client.stats()
    assert st["client"]["dropped_puts"] == drops_before + 10
    assert st["client"]["shards"][pool.addresses[dead]]["up"] is False
    assert "error" in st["servers"][pool.addresses[dead]]
    assert st["client"]["shard_errors"] >= 1
    assert client.delete([keys[i] for i in on_dead[:3]]) == 0

    # Restart it on the same port: the background reconnect brings it back.
    (restarted,) = start_pool_of(pair[0], 1, capacity="64MiB", extra_args=["--port", str(port)])
    try:
        assert restarted.port == port
        assert _wait_for(lambda: client.stats()["client"]["shards"][pool.addresses[dead]]["up"])
        st = client.stats()
        assert st["client"]["reconnects"] >= 1
        assert client.put([keys[i] for i in on_dead], [values[i] for i in on_dead]).stored == len(on_dead)
        assert client.get(keys) == values
        assert client.lookup(keys) == 300
    finally:
        restarted.kill()


def test_client_starts_with_a_dead_server(make_pool, make_client):
    pool = make_pool(2)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    addresses = [pool.addresses[0], dead, pool.addresses[1]]
    client = make_client(addresses, reconnect_backoff_s=0.05)
    keys, values = _data(90, 22)
    owner = [o[0] for o in sharding.owner_table(keys, addresses)]
    res = client.put(keys, values)
    assert res.dropped == owner.count(1) > 0 and res.stored == 90 - owner.count(1)
    got = client.get(keys)
    assert [g is None for g in got] == [o == 1 for o in owner]
    st = client.stats()["client"]
    assert st["shards"][dead]["up"] is False and st["shards"][dead]["last_error"]
    # the keys a caller need not wait for: exactly those whose only owner is the dead server
    assert client.unreachable(keys) == [o == 1 for o in owner]


def test_stalled_shard_hits_the_deadline_then_recovers(make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses, timeout_s=0.5, reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.2)
    keys, values = _data(60, 23)
    client.put(keys, values)
    owner = [o[0] for o in sharding.owner_table(keys, pool.addresses)]
    stalled = pool[2]
    with stalled.paused():
        got = client.get(keys)  # the stalled shard's keys miss once the deadline passes
        assert [g is None for g in got] == [o == 2 for o in owner]
        assert client.lookup(keys) <= min(i for i, o in enumerate(owner) if o == 2)
        st = client.stats(timeout_s=0.5)
        assert st["client"]["timeouts"] >= 1
        assert st["client"]["shards"][stalled.address]["up"] is False
    assert _wait_for(lambda: client.stats()["client"]["shards"][stalled.address]["up"])
    assert _wait_for(lambda: client.get(keys) == values)


def test_replicas_survive_one_dead_shard(make_pool, make_client):
    pool = make_pool(3)
    client = make_client(pool.addresses, replicas=2, timeout_s=2.0)
    keys, values = _data(120, 24)
    assert client.put(keys, values).stored == 120
    st = client.stats()["servers"]
    assert sum(s["objects"] for s in st.values()) == 240  # two copies of each
    assert client.unreachable(keys) == [False] * 120
    pool[0].kill()
    assert client.get(keys) == values  # the second owner answers for every key
    assert client.stats()["client"]["shards"][pool[0].address]["up"] is False
    assert client.unreachable(keys) == [False] * 120  # one owner of each key is still up
    assert client.exists(keys) == [True] * 120
    assert client.lookup(keys) == 120
    new_keys, new_values = _data(30, 25)
    res = client.put(new_keys, new_values)
    assert res.stored == 30 and res.dropped == 0
    on_dead = sum(1 for o in sharding.owner_table(new_keys, pool.addresses, 2) if 0 in o)
    assert client.stats()["client"]["replica_puts_dropped"] == on_dead > 0
    assert client.get(new_keys) == new_values


def test_auth_token(pair, make_client):
    (srv,) = start_pool_of(pair[0], 1, capacity="8MiB", extra_args=["--auth-token", "s3cret"])
    try:
        with pytest.raises(RemoteError) as e:
            make_client([srv.address], auth_token="wrong")
        assert e.value.code.name == "AUTH_FAILED"
        client = make_client([srv.address], auth_token="s3cret")
        assert client.put([b"k" * 16], [b"v"]).stored == 1
        assert client.get([b"k" * 16]) == [b"v"]
    finally:
        srv.kill()
