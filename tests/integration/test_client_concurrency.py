"""8 threads share one client: 400 mixed operations each (3,200 interleaved calls), every hit verified."""

from __future__ import annotations

import functools
import threading

import numpy as np
import xxhash

THREADS = 8
OPS = 400


@functools.lru_cache(maxsize=None)
def value_of(key: bytes) -> bytes:
    """Deterministic content for a key, so any thread can verify any hit."""
    n = 200 + xxhash.xxh3_64_intdigest(key) % 12000
    return np.random.default_rng(xxhash.xxh3_64_intdigest(key, seed=1)).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_eight_threads_mixed_operations(make_pool, make_client):
    pool = make_pool(3, capacity="64MiB")  # big enough: nothing is evicted
    client = make_client(pool.addresses, connections_per_server=4)
    shared = [i.to_bytes(4, "little") + b"shared-key-0" for i in range(200)]
    errors: list[BaseException] = []
    counts = [dict.fromkeys(("put", "get", "exists", "lookup", "delete", "hits"), 0) for _ in range(THREADS)]

    def worker(t: int) -> None:
        rng = np.random.default_rng(100 + t)
        mine: dict[bytes, bool] = {}  # own key -> currently stored
        own = [bytes([t]) + i.to_bytes(4, "little") + b"own-key-000" for i in range(150)]
        c = counts[t]
        try:
            for _ in range(OPS):
                op = rng.choice(["put", "get", "exists", "lookup", "delete"], p=[0.3, 0.35, 0.15, 0.1, 0.1])
                c[op] += 1
                if op == "put":
                    batch = [own[i] for i in rng.choice(len(own), 3, replace=False)]
                    batch.append(shared[int(rng.integers(len(shared)))])
                    res = client.put(batch, [value_of(k) for k in batch])
                    assert res.dropped == 0
                    for k in batch[:3]:
                        mine[k] = True
                elif op == "get":
                    batch = [own[i] for i in rng.choice(len(own), 3, replace=False)]
                    batch += [shared[int(i)] for i in rng.integers(0, len(shared), 3)]
                    bufs = [np.empty(12500, np.uint8) if i % 2 else bytearray(12500) for i in range(len(batch))]
                    got = client.get_into(batch, bufs)
                    for k, b, n in zip(batch, bufs, got):
                        if k in mine:
                            assert (n is not None) == mine[k], "own key: hit iff stored"
                        if n is not None:
                            assert bytes(memoryview(b)[:n]) == value_of(k)
                            c["hits"] += 1
                elif op == "exists":
                    batch = [own[i] for i in rng.choice(len(own), 5, replace=False)]
                    for k, p in zip(batch, client.exists(batch)):
                        assert p == mine.get(k, False)
                elif op == "lookup":
                    start = int(rng.integers(0, len(own) - 8))
                    batch = own[start : start + 8]
                    expect = next((i for i, k in enumerate(batch) if not mine.get(k)), len(batch))
                    assert client.lookup(batch) == expect
                else:
                    batch = [own[i] for i in rng.choice(len(own), 2, replace=False)]
                    expect = sum(1 for k in batch if mine.get(k))
                    assert client.delete(batch) == expect
                    for k in batch:
                        mine[k] = False
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    assert sum(sum(v for k, v in c.items() if k != "hits") for c in counts) == THREADS * OPS
    assert sum(c["hits"] for c in counts) > 0
    st = client.stats()
    assert st["client"]["shard_errors"] == 0 and st["client"]["checksum_failures"] == 0
    assert all(s["evictions"] == 0 for s in st["servers"].values())
