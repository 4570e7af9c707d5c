"""End-to-end: real vLLM engines (CPU, float32, tiny random Llama) on real pool servers.

Prefix caching is off in every engine, so any cached token came from the pool.
Every engine is its own process (``engine_run.py``); ``cold`` is an engine
without the connector.
"""

from __future__ import annotations

from kvfabric import Client
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.keys import prompt_keys
from kvfabric_vllm.tinymodel import tiny_engine_keys

from conftest import CHUNK, LOADABLE, LONG_LOADABLE, PARTS, PROMPTS

SAVED = len(PROMPTS["single"]) // CHUNK   # whole chunks a 1500-token prompt saves
LOADED = LOADABLE // CHUNK                # whole chunks it can load (last token computed)


def pool_stats(addresses: list[str]) -> dict[str, dict]:
    with Client(addresses) as c:
        return c.stats()["servers"]


def test_second_engine_loads_prefix_then_multiprocess_engine(run_engine, cold):
    with start_pool(1, capacity="64MiB") as pool:
        a = run_engine(["single"], pool.addresses)
        assert a["cached"] == [0]                   # empty pool: a cold run
        assert a["outputs"] == [cold["single"]]
        assert a["counters"]["save_chunks"] == SAVED

        b = run_engine(["single"], pool.addresses)  # independent process, other PYTHONHASHSEED
        assert b["cached"][0] >= LOADABLE, b["counters"]
        assert b["outputs"] == [cold["single"]]
        assert b["counters"]["load_chunks"] == LOADED
        assert b["counters"]["load_failed_chunks"] == 0

        # vLLM's default mode: engine core (scheduler + worker) in a child process
        before = pool_stats(pool.addresses)[pool.addresses[0]]
        m = run_engine(["single", "mp_new"], pool.addresses, mp=True)
        assert m["cached"][0] >= LOADABLE
        assert m["outputs"] == [cold["single"], cold["mp_new"]]
        after = pool_stats(pool.addresses)[pool.addresses[0]]
        assert after["hits"] - before["hits"] >= LOADED
        assert after["objects"] - before["objects"] == SAVED * PARTS    # it saved its new prompt too
        # the engine core process drained its saves on the SIGTERM of its shutdown, within the bound
        said = m["stdout"] + m["log"]
        assert "kvfabric worker shut down" in said and "0 abandoned" in said, said[-4000:]


def test_two_servers_chunks_spread_then_shard_killed_mid_run(run_engine, cold):
    with start_pool(2, capacity="64MiB") as pool:
        # chunks placed one by one (segment_tokens = chunk_tokens), so 31 chunks spread over both servers
        per_chunk = ["--extra", f'{{"segment_tokens": {CHUNK}}}']
        a = run_engine(["spread", "killed"], pool.addresses, role="kv_producer", args=per_chunk)   # saves only
        assert a["cached"] == [0, 0]
        assert a["counters"]["lookups"] == 2            # a producer looks up only to skip what the pool holds
        assert a["counters"]["scheduled_load_tokens"] == 0 and a["counters"]["save_known_chunks"] == 0
        stats = pool_stats(pool.addresses)
        assert all(s["objects"] > 0 for s in stats.values()), stats   # chunks on both servers
        assert sum(s["objects"] for s in stats.values()) == PARTS * sum(len(PROMPTS[n]) // CHUNK
                                                                         for n in ("spread", "killed"))

        hits: dict[str, int] = {}

        def kill_shard(i: int) -> None:
            hits.update({addr: s["hits"] for addr, s in pool_stats(pool.addresses).items()})
            pool[1].kill()   # a shard dies mid-run: the engine holds connections to it

        b = run_engine(["spread", "killed"], pool.addresses, between=kill_shard, role="kv_consumer",
                       args=per_chunk)  # loads only
        assert b["cached"][0] >= LONG_LOADABLE, b["counters"]
        assert all(h > 0 for h in hits.values()), hits   # the first load read from both servers
        assert b["outputs"] == [cold["spread"], cold["killed"]]   # identical to cold, nothing raised
        assert b["cached"][1] < LONG_LOADABLE             # the dead shard's chunks were recomputed
        assert b["counters"]["load_errors"] == 0
        assert b["counters"]["save_jobs"] == 0     # a consumer never saves what it recomputed


def test_pool_down_serves_identically(run_engine, cold):
    with start_pool(1, capacity="16MiB") as pool:
        dead = pool.addresses
    # the server is gone: its port refuses connections from the start
    r = run_engine(["down", "single"], dead)
    assert r["outputs"] == [cold["down"], cold["single"]]
    assert r["cached"] == [0, 0]
    assert r["counters"]["save_dropped_chunks"] == 2 * SAVED   # counted ...
    # ... and warned once, in vLLM's log output (its handler writes to stdout)
    assert (r["stdout"] + r["log"]).count("the pool did not take") == 1


def test_chunks_that_fail_to_load_are_recomputed(run_engine, cold, tiny_model):
    """The pool answers the lookup but the chunks it returns are unusable (wrong size):
    vLLM must recompute them (sync-load invalid blocks -> recompute), with identical output."""
    engine = tiny_engine_keys(tiny_model, {"servers": ["127.0.0.1:1"], "chunk_tokens": CHUNK})
    keys = prompt_keys(engine, PROMPTS["corrupt"][:LOADABLE]).objects(engine)[0]
    parts = len(engine.parts())          # each layer, each KV head (layout 3)
    with start_pool(1, capacity="16MiB") as pool:
        with Client(pool.addresses) as c:   # every object of every loadable chunk
            assert c.put(keys, [b"not a KV chunk"] * len(keys)).stored == LOADED * parts
        r = run_engine(["corrupt"], pool.addresses)
    assert r["counters"]["scheduled_load_tokens"] == LOADABLE   # the engine's keys matched ours
    assert r["counters"]["load_failed_chunks"] == LOADED
    # had vLLM used the blocks those chunks should have filled, the output would differ from cold
    assert r["outputs"] == [cold["corrupt"]]
