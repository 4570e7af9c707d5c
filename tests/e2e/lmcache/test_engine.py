"""Real LMCache engines (CPU stand-in for the GPU connector) over real kvfabric server processes.

Every engine here runs with LMCache's local CPU cache off (``local_cpu: false``),
so a hit can only come from the pool.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import msgpack

import pytest
import torch

from kvfabric import Client, sharding
from kvfabric.testing.ports import free_port
from kvfabric_lmcache import value
from kvfabric_lmcache.keymap import KeyMapper
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache_helpers import CHUNK, HIDDEN, LAYERS, DTYPE, engine_config, kvfabric_connector, wait_until

pytestmark = pytest.mark.lmcache

TOKENS = 1000  # three full 256-token chunks and one of 232 (save_unfull_chunk)
CHUNKS = 4


def prompt(seed: int, n: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a ``[2, L, n, D]`` KV tensor with random bits (every byte matters)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n,), generator=g)
    kv = torch.randint(-(2**15), 2**15, (2, LAYERS, n, HIDDEN), dtype=torch.int16, generator=g).view(DTYPE)
    return tokens, kv


def url_of(pool, **opts) -> str:
    """The pool's URL; generous deadlines by default, so a loaded CI machine is not a "dead shard"."""
    opts = {"timeout_s": 10, "connect_timeout_s": 5, **opts}
    return "kvfabric://" + ",".join(pool.addresses) + "?" + "&".join(f"{k}={v}" for k, v in opts.items())


def pool_engine(engines, pool, **opts):
    """An engine on ``pool`` whose client has every shard up (it reconnects in the background otherwise)."""
    name, engine = engines(engine_config(url_of(pool, **opts)))
    client = kvfabric_connector(engine).client
    wait_until(lambda: all(s["up"] for s in client.stats()["client"]["shards"].values()), what="all shards up")
    return name, engine


def chunk_keys(engine, tokens) -> list[CacheEngineKey]:
    return [key for _, _, key in engine.token_database.process_tokens(tokens)]


def store_and_wait(engine, tokens, kv) -> None:
    conn = kvfabric_connector(engine)
    before = conn.counts()
    engine.store(tokens, kv=kv)
    wait_until(lambda: conn.counts()["puts"] >= before["puts"] + CHUNKS, what="the engine's puts to reach the pool")
    assert conn.counts()["puts_stored"] - before["puts_stored"] == CHUNKS


def test_second_engine_retrieves_bit_identical_kv_from_two_servers(pool, engines) -> None:
    name1, e1 = pool_engine(engines, pool)
    # Placement depends on the servers' (random) ports: pick a prompt whose chunks land on both shards.
    keymap = kvfabric_connector(e1).keymap
    for seed in range(1, 100):
        tokens, kv = prompt(seed)
        if len(sharding.group_by_owner(keymap.many(chunk_keys(e1, tokens)), pool.addresses)) == 2:
            break
    store_and_wait(e1, tokens, kv)
    assert kvfabric_connector(e1).stats()["puts_stored"] == CHUNKS

    with Client(pool.addresses) as probe:
        per_server = {a: s["objects"] for a, s in probe.stats()["servers"].items()}
    assert sum(per_server.values()) == CHUNKS
    assert all(n > 0 for n in per_server.values()), f"both shards hold chunks: {per_server}"

    LMCacheEngineBuilder.destroy(name1)  # nothing of the first engine survives but the pool
    _, e2 = pool_engine(engines, pool)
    assert e2.lookup(tokens) == TOKENS
    out = torch.zeros_like(kv)
    mask = e2.retrieve(tokens, kv=out)
    assert int(mask.sum()) == TOKENS
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))  # bit-identical, NaN payloads included

    st = kvfabric_connector(e2).stats()
    assert (st["get_hits"], st["get_misses"], st["bad_values"], st["pool_errors"]) == (CHUNKS, 0, 0, 0)
    assert st["client"]["hits"] >= CHUNKS
    # the 3 full chunks were received straight into LMCache's memory objects; only the
    # 232-token chunk (its own, smaller shape) took a copy
    assert st["get_copies"] == 1


def test_a_different_model_or_prompt_does_not_hit(pool, engines) -> None:
    tokens, kv = prompt(seed=2)
    _, e1 = pool_engine(engines, pool)
    store_and_wait(e1, tokens, kv)
    other_tokens, _ = prompt(seed=3)
    assert e1.lookup(other_tokens) == 0
    # Same prompt, one token changed in the second chunk: only the first chunk still matches.
    edited = tokens.clone()
    edited[300] = (edited[300] + 1) % 32000
    assert e1.lookup(edited) == 256


def test_pool_killed_after_store_lookups_zero_retrieves_miss_nothing_raises(pool, engines) -> None:
    tokens, kv = prompt(seed=4)
    _, e1 = pool_engine(engines, pool, timeout_s=0.5, connect_timeout_s=0.2)
    store_and_wait(e1, tokens, kv)
    assert e1.lookup(tokens) == TOKENS
    for server in pool:
        server.kill()

    assert e1.lookup(tokens) == 0
    out = torch.zeros_like(kv)
    mask = e1.retrieve(tokens, kv=out)
    assert int(mask.sum()) == 0
    assert torch.count_nonzero(out.view(torch.int16)) == 0  # nothing half-written
    conn = kvfabric_connector(e1)
    before = conn.counts()
    tokens5, kv5 = prompt(seed=5)
    e1.store(tokens5, kv=kv5)  # puts to a dead pool are counted drops
    wait_until(lambda: conn.counts()["puts"] >= before["puts"] + CHUNKS, what="dropped puts to be counted")
    after = conn.counts()
    assert after["puts_dropped"] - before["puts_dropped"] == CHUNKS
    assert after["puts_stored"] == before["puts_stored"]


def test_pool_never_reachable_engine_still_runs(engines) -> None:
    url = f"kvfabric://127.0.0.1:{free_port()},127.0.0.1:{free_port()}?timeout_s=0.5&connect_timeout_s=0.2"
    _, e = engines(engine_config(url))
    kvfabric_connector(e)  # the plugin was built although no server answers
    tokens, kv = prompt(seed=6)
    e.store(tokens, kv=kv)
    assert e.lookup(tokens) == 0
    assert int(e.retrieve(tokens, kv=torch.zeros_like(kv)).sum()) == 0


def test_destroy_with_puts_queued_behind_a_dead_pool_reads_no_freed_memory(engines) -> None:
    # LMCache's destroy frees its allocator's arena (LocalCPUBackend.close) before it closes the
    # remote backend, whatever the reference counts say. Puts it queued on its event loop just
    # before must not read the memory objects then: they did twice (a segfault in encode_into,
    # first from an I/O thread, then from the loop while the main thread was in free_pinned_ptr).
    # Here the loop is held until the arena is freed, so every put coroutine is still queued:
    # without the memory guard each one would copy from freed memory.
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections (backlog), never answers
    url = f"kvfabric://127.0.0.1:{silent.getsockname()[1]}?timeout_s=0.5&connect_timeout_s=0.3&io_threads=1"
    name, e = engines(engine_config(url))
    conn = kvfabric_connector(e)
    allocator = e.storage_manager.local_cpu_backend.memory_allocator
    guarded_close, freed, release = allocator.close, threading.Event(), threading.Event()

    def close_and_tell() -> None:
        guarded_close()
        freed.set()

    allocator.close = close_and_tell
    conn.loop.call_soon_threadsafe(release.wait, 120)  # holds LMCache's event loop
    for seed in range(6):
        tokens, kv = prompt(seed=40 + seed)
        e.store(tokens, kv=kv)
    destroy = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(name,))
    destroy.start()
    try:
        assert freed.wait(120), "LMCache did not free its arena"
    finally:
        release.set()
        destroy.join(120)
        silent.close()
    assert not destroy.is_alive()
    counts = conn.counts()
    assert counts["puts"] == counts["puts_dropped"] == 6 * -(-TOKENS // CHUNK), counts  # every chunk settled


def test_a_get_receiving_when_lmcache_frees_its_memory_holds_the_free_back(pool, engines) -> None:
    # The other side of the guard: a get still receiving into LMCache's memory objects on an
    # I/O thread when teardown starts. The free waits for it; a get after that is a miss that
    # allocates nothing.
    tokens, kv = prompt(seed=11)
    _, e = pool_engine(engines, pool)
    store_and_wait(e, tokens, kv)
    conn = kvfabric_connector(e)
    allocator = e.storage_manager.local_cpu_backend.memory_allocator
    guarded_close, freed = allocator.close, threading.Event()
    allocator.close = lambda: (guarded_close(), freed.set())
    keys = chunk_keys(e, tokens)
    in_get, go_on = threading.Event(), threading.Event()
    fetch_into = conn._fetch_into

    def slow_fetch(ks):
        in_get.set()
        go_on.wait(120)
        return fetch_into(ks)

    conn._fetch_into = slow_fetch
    got: list = []
    getter = threading.Thread(target=lambda: got.append(conn._get_batch(keys)))
    getter.start()
    assert in_get.wait(120)
    closer = threading.Thread(target=allocator.close)
    closer.start()
    closer.join(1.0)
    assert not freed.is_set()  # the free waits for the get in progress
    go_on.set()
    getter.join(120)
    closer.join(120)
    assert freed.is_set()
    assert all(o is not None for o in got[0])  # that get landed before the memory went
    for o in got[0]:
        o.ref_count_down()
    before = conn.counts()
    assert conn._get_batch(keys) == [None] * len(keys)  # after the free: a miss, nothing allocated
    after = conn.counts()
    assert (after["get_misses"] - before["get_misses"], after["alloc_failures"]) == (len(keys), before["alloc_failures"])


@pytest.mark.parametrize("garbage_bytes", [1000, 600_000])  # fits the receive buffer / larger than a chunk
def test_corrupt_stored_object_is_a_counted_miss_never_kv(pool, engines, garbage_bytes: int) -> None:
    tokens, kv = prompt(seed=7)
    _, e1 = pool_engine(engines, pool)
    store_and_wait(e1, tokens, kv)
    conn = kvfabric_connector(e1)
    last = conn.keymap(chunk_keys(e1, tokens)[-1])
    # Replace the last chunk by an object that is not a valid chunk (no header).
    assert conn.client.delete([last]) == 1
    assert conn.client.put([last], [bytes(garbage_bytes)]).stored == 1

    _, e2 = pool_engine(engines, pool)
    out = torch.zeros_like(kv)
    mask = e2.retrieve(tokens, kv=out)
    assert int(mask.sum()) == 768
    assert torch.equal(out[:, :, :768].view(torch.int16), kv[:, :, :768].view(torch.int16))
    assert torch.count_nonzero(out[:, :, 768:].view(torch.int16)) == 0
    assert kvfabric_connector(e2).stats()["bad_values"] == 1


def test_objects_in_the_previous_unpadded_format_still_load_bit_identical(pool, engines) -> None:
    # Objects written by the plugin before the header was padded to 256 bytes (value version 1):
    # the scatter GET sees a header that ends early, fetches such an object whole and copies it.
    tokens, kv = prompt(seed=9)
    _, e1 = pool_engine(engines, pool)
    store_and_wait(e1, tokens, kv)
    conn = kvfabric_connector(e1)
    keys = conn.keymap.many(chunk_keys(e1, tokens))
    old = []
    for raw in conn.client.get(keys):
        meta, payload = value.decode(raw)
        m = msgpack.packb({"fmt": meta.fmt.value, "shapes": [list(s) for s in meta.shapes],
                           "dtypes": [str(d).removeprefix("torch.") for d in meta.dtypes], "nbytes": meta.nbytes})
        old.append(struct.pack("<4sBBH", b"KFLC", 1, 0, len(m)) + m + bytes(payload))
    assert conn.client.delete(keys) == CHUNKS
    assert conn.client.put(keys, old).stored == CHUNKS

    _, e2 = pool_engine(engines, pool)
    out = torch.zeros_like(kv)
    assert int(e2.retrieve(tokens, kv=out).sum()) == TOKENS
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    st = kvfabric_connector(e2).stats()
    assert (st["get_hits"], st["get_copies"], st["bad_values"]) == (CHUNKS, CHUNKS, 0)


def test_connector_async_and_single_key_paths(pool, engines) -> None:
    tokens, kv = prompt(seed=8)
    _, e = pool_engine(engines, pool)
    store_and_wait(e, tokens, kv)
    conn = kvfabric_connector(e)
    loop = e.storage_manager.storage_backends["RemoteBackend-kvfabric"].loop
    keys = chunk_keys(e, tokens)
    missing = CacheEngineKey(keys[0].model_name, keys[0].world_size, keys[0].worker_id, 12345, keys[0].dtype)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=20)

    assert run(conn.batched_async_contains("lookup-1", keys, pin=True)) == CHUNKS
    assert run(conn.batched_async_contains("lookup-2", [keys[0], missing, keys[1]])) == 1
    assert conn.batched_contains(keys[:2] + [missing]) == 2
    assert run(conn.exists(keys[2])) and conn.exists_sync(keys[3]) and not conn.exists_sync(missing)

    objs = run(conn.batched_get_non_blocking("lookup-1", [keys[0], keys[1], missing, keys[2]]))
    try:
        assert len(objs) == 2
        assert torch.equal(objs[1].tensor.view(torch.int16), kv[:, :, 256:512].view(torch.int16))
    finally:
        for o in objs:
            o.ref_count_down()
    single = run(conn.get(keys[3]))
    try:
        assert list(single.tensor.shape) == [2, LAYERS, TOKENS - 768, HIDDEN]
        assert torch.equal(single.tensor.view(torch.int16), kv[:, :, 768:].view(torch.int16))
    finally:
        single.ref_count_down()
    assert run(conn.get(missing)) is None

    assert conn.remove_sync(keys[3]) and not conn.exists_sync(keys[3])
    with pytest.raises(NotImplementedError, match="cannot list"):
        run(conn.list())


def test_keys_are_the_same_in_a_fresh_mapper(pool, engines) -> None:
    """The key of a chunk depends on config only, so another process (another mapper) finds it."""
    tokens, kv = prompt(seed=9)
    _, e = pool_engine(engines, pool)
    store_and_wait(e, tokens, kv)
    conn = kvfabric_connector(e)
    fresh = KeyMapper(conn.keymap.hasher.__class__(), chunk_tokens=256)
    with Client(pool.addresses) as c:
        assert c.lookup(fresh.many(chunk_keys(e, tokens))) == CHUNKS
