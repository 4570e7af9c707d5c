"""End-to-end placement (issue 23): a chunk's layer objects live on one server, so a dead server of two
costs only its own chunks. Real vLLM engines (tiny Llama, CPU) and two real pool servers.

Before issue 23 every layer object was routed by its own key: after one of two servers died the
survivor gave 0 hits and kept partial chunks it could never serve. Now (``segment_tokens``) a
segment of chunks is placed by its first chunk's key (segments of 8 chunks here, so the 31-chunk
prompt spans several segments): the test computes which server owns
which chunk of its prompt, kills the one that does not own chunk 0, and checks that the survivor's
leading chunks are loaded with identical greedy tokens, and that each server holds whole chunks only
(every layer object of a chunk, or none), also for a prompt saved while the other server was dead.
"""

from __future__ import annotations

from kvfabric import Client, KeyHasher
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.keys import prompt_keys
from kvfabric_vllm.layout import chunk_placement
from kvfabric_vllm.tinymodel import tiny_engine_keys

from conftest import CHUNK, LONG_LOADABLE, PARTS, PROMPTS

SEGMENT = 8 * CHUNK
EXTRA = ["--extra", f'{{"segment_tokens": {SEGMENT}}}']


def _chunk_owners(tiny_model: str, prompt: list[int], addresses: list[str]) -> list[str]:
    """The address of the server that owns each whole chunk of ``prompt`` (segments of ``SEGMENT`` tokens)."""
    engine = tiny_engine_keys(tiny_model, {"servers": addresses, "chunk_tokens": CHUNK, "segment_tokens": SEGMENT})
    pk = prompt_keys(engine, prompt)
    keys, placement = pk.chunk_keys, pk.placement
    assert engine.segment_chunks == SEGMENT // CHUNK and placement is not None
    with Client(addresses) as c:
        by_id = {s["route_id"]: addr for addr, s in c.stats()["client"]["shards"].items()}
        return [by_id[row[0]] for row in c.route(keys, placement=placement)]


def _objects(addresses: list[str]) -> dict[str, int]:
    """Objects per server, after checking that every one of them is a part of a whole chunk group
    (server-side groups: STATS ``group_objects`` == ``objects``, ``groups_incomplete`` 0)."""
    with Client(addresses) as c:
        stats = c.stats()["servers"]
    for a, s in stats.items():
        assert (s["group_objects"], s["groups_incomplete"]) == (s["objects"], 0), (a, s["objects"], s["group_objects"],
                                                                                   s["groups_incomplete"])
        assert s["groups"] * PARTS == s["objects"], (a, s["groups"], s["objects"])
    return {a: s["objects"] for a, s in stats.items()}


def test_a_dead_server_of_two_costs_only_its_chunks(run_engine, cold, tiny_model):
    with start_pool(2, capacity="64MiB") as pool:
        addrs = pool.addresses
        owners = _chunk_owners(tiny_model, PROMPTS["killed"], addrs)
        spread = _chunk_owners(tiny_model, PROMPTS["spread"], addrs)
        survivor = owners[0]
        victim = next(a for a in addrs if a != survivor)
        run = next((c for c, o in enumerate(owners) if o != survivor), len(owners))  # survivor's leading chunks
        assert run >= min(SEGMENT // CHUNK, len(owners)), (run, owners)

        a = run_engine(["killed"], addrs, args=EXTRA)                      # saves every chunk of the prompt
        assert a["outputs"] == [cold["killed"]]
        assert a["counters"]["save_chunks"] == len(owners)
        held = _objects(addrs)
        want = {addr: PARTS * owners.count(addr) for addr in addrs}
        assert held == want, f"objects per server {held}, whole chunks by placement would be {want}"

        pool[addrs.index(victim)].kill()                          # SIGKILL, reaped

        b = run_engine(["killed", "spread"], addrs, args=EXTRA)             # loads what survived, saves a new prompt
        expect = min(run * CHUNK, LONG_LOADABLE)
        assert b["cached"][0] >= expect > 0, (b["cached"], run, b["counters"])
        assert b["outputs"] == [cold["killed"], cold["spread"]]   # identical greedy tokens
        assert b["counters"]["load_failed_chunks"] == 0
        # the chunks past the loaded run and all of "spread" were saved with the victim dead: its
        # chunks were dropped, whole, and the survivor took whole chunks only
        lost = owners[run:].count(victim) + spread.count(victim)
        assert b["counters"].get("save_dropped_chunks", 0) == lost, (b["counters"], owners, spread)
        after = _objects([survivor])[survivor]
        assert after == PARTS * (owners.count(survivor) + spread.count(survivor)), (after, owners, spread)


def test_worker_saves_a_chunks_layers_on_one_server_and_loads_them_by_placement():
    """Without an engine: the worker's put and layer-by-layer load and the scheduler's lookup all route
    a chunk's layer objects by its placement key (segments of 2 chunks here)."""
    import os
    import time

    import torch
    from kvfabric import sharding
    from kvfabric_vllm.layout import layer_keys
    from kvfabric_vllm.meta import LoadSpec, SaveSpec
    from kvfabric_vllm.metrics import Counters
    from kvfabric_vllm.scheduler import SchedulerSide

    from test_zero_copy import BLOCK, NAMES, NL, engine_keys, make_worker

    with start_pool(2, capacity="16MiB") as pool:
        a, kv_a = make_worker(pool.addresses)
        b, kv_b = make_worker(pool.addresses, load_async=False, load_layerwise=True)
        sched = SchedulerSide(a.cfg, Client(config=a.cfg.client), engine_keys(a.cfg), BLOCK, Counters(), lambda: None)
        try:
            for t in kv_a:
                t.copy_(torch.randn_like(t))
            keys = [os.urandom(16) for _ in range(6)]
            place = chunk_placement(keys, 2)
            spec = SaveSpec("r", keys, [None, *keys[:-1]], [[blk] for blk in range(1, 7)], placement=place)
            a.gather_layer(NAMES[0], [spec])
            a.submit_saves([spec])
            deadline = time.monotonic() + 60
            while a.counters.snapshot()["save_jobs_done"] < a.counters.snapshot()["save_jobs"]:
                assert time.monotonic() < deadline, "save did not finish"
                time.sleep(0.01)
            assert a.counters.snapshot()["save_chunks"] == 6
            hasher = KeyHasher()
            with Client(pool.addresses) as c:
                members = c.members
            for pos, addr in enumerate(pool.addresses):
                with Client([addr]) as one:
                    for ci, k in enumerate(keys):
                        held = one.exists(layer_keys(hasher, k, NL))
                        mine = sharding.owners(place[ci], members)[0] == pos
                        assert held == [mine] * NL, (addr, ci, held)
            assert sched._lookup_all_parts(keys, 0, place).count == 6
            with Client(pool.addresses) as c:   # one layer of chunk 3 deleted: the server drops its whole group
                assert c.delete([layer_keys(hasher, keys[3], NL)[1]], placement=[place[3]]) == NL
            assert sched._lookup_all_parts(keys, 0, place).count == 3
            b.load([LoadSpec("r", keys[:4], [[9], [10], [11], [12]], placement=place[:4])])
            for li, name in enumerate(NAMES):
                b.wait_layer(name)
                for dst, src in ((9, 1), (10, 2), (11, 3)):
                    assert torch.equal(kv_b[li][dst], kv_a[li][src]), (li, dst)
            assert b.take_failed_block_ids() == {12}
        finally:
            a.shutdown()
            b.shutdown()
            sched.shutdown()
