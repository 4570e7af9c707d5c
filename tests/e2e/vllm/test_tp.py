"""Tensor parallelism through the pool, and KV shared between engines of different TP sizes
(issue 13 item 4; issue 23 part 4, layout version 3: ``kvfabric_vllm/layout.py``).

vLLM 0.32's CPU build runs TP=2 here only with ``VLLM_CPU_OMP_THREADS_BIND=nobind``:
its automatic binding asserts "Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers. Allowed NUMA nodes are [0]" on a one-NUMA-node machine. Each rank is a
worker process holding its share of the tiny Llama's 2 KV heads (one per rank); the pool
objects are one per (chunk, layer, KV head), keyed without the TP rank or size, so a
TP=2 engine loads what a TP=1 engine saved, and back, each rank exactly its own head.
"""

from __future__ import annotations

from kvfabric import Client
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_pool
from kvfabric_vllm.keys import prompt_keys
from kvfabric_vllm.tinymodel import tiny_engine_keys

from conftest import CHUNK, LOADABLE, PARTS, PROMPTS

TP = 2
TP_ARGS = ["--tp", str(TP), "--kv-cache-mb", "64", "--max-model-len", "2048"]
CHUNKS = len(PROMPTS["single"]) // CHUNK     # whole chunks of a 1500-token prompt, saved


def _pool_objects(tiny_model: str, addresses: list[str], name: str) -> list[bool]:
    """Which of PROMPTS[name]'s pool objects (every chunk, layer and KV head) the pool holds, keys
    derived here by the connector's public function, with no TP rank or size anywhere."""
    engine = tiny_engine_keys(tiny_model, {"servers": addresses, "chunk_tokens": CHUNK})
    keys, place, _ = prompt_keys(engine, PROMPTS[name]).objects(engine)
    assert len(keys) == CHUNKS * PARTS
    with Client(addresses) as c:
        return c.exists(keys, placement=place)


def _groups(addresses: list[str]) -> dict[str, int]:
    """The pool's group gauges (server-side groups, issue 23 part 2), summed over servers."""
    with Client(addresses) as c:
        servers = c.stats()["servers"].values()
    return {k: sum(s[k] for s in servers) for k in ("objects", "groups", "group_objects", "groups_incomplete")}


def test_tp1_and_tp2_engines_load_each_others_kv(run_engine, tiny_model, monkeypatch):
    """TP=1 saves "single"; a TP=2 engine loads it (each rank its own head's objects) and saves
    "mp_new" (each rank its own part, one server group per rank and chunk); a TP=1 engine loads
    that. Every loaded run is token-identical to a cold run of the same prompt on the loading
    engine (the same prompt under a ``cache_salt``, so its keys differ: computed, not loaded)
    and to the saving engine's cold run. vLLM's local prefix cache is off: hits are the pool's."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with start_pool(1, capacity="64MiB") as pool:
        addrs = pool.addresses
        tp1_save = run_engine(["single"], addrs)
        assert tp1_save["cached"] == [0]
        assert wait_for(lambda: all(_pool_objects(tiny_model, addrs, "single")), timeout_s=120), \
            "the TP=1 engine's objects are not all in the pool under the TP-independent keys"
        g = _groups(addrs)   # TP=1: one group per chunk holding every layer and head
        assert g == {"objects": CHUNKS * PARTS, "groups": CHUNKS, "group_objects": CHUNKS * PARTS,
                     "groups_incomplete": 0}, g

        def tp2_saved(i: int) -> None:
            if i != 1:
                return
            held = wait_for(lambda: all(_pool_objects(tiny_model, addrs, "mp_new")), timeout_s=120)
            assert held, "the TP=2 engine's saves of mp_new did not all reach the pool"
            g = _groups(addrs)   # TP=2: each rank put its head's objects as its own group
            assert g == {"objects": 2 * CHUNKS * PARTS, "groups": CHUNKS + TP * CHUNKS,
                         "group_objects": 2 * CHUNKS * PARTS, "groups_incomplete": 0}, g

        tp2 = run_engine(["mp_new", "single", "single"], addrs, args=TP_ARGS, between=tp2_saved,
                         salts=[None, None, "tp2-cold"])
        assert tp2["cached"] == [0, LOADABLE, 0], tp2["cached"]      # "single" loaded from TP=1's KV
        assert tp2["outputs"][1] == tp2["outputs"][2] == tp1_save["outputs"][0], tp2["outputs"]
        assert tp2["counters"]["scheduled_load_tokens"] == LOADABLE   # scheduler side (this process)

        tp1_load = run_engine(["mp_new", "mp_new"], addrs, salts=[None, "tp1-cold"])
    assert tp1_load["cached"] == [LOADABLE, 0], tp1_load["cached"]   # "mp_new" loaded from TP=2's KV
    assert tp1_load["outputs"][0] == tp1_load["outputs"][1] == tp2["outputs"][0], tp1_load["outputs"]
    c = tp1_load["counters"]   # TP=1 runs its worker in this engine's process: every chunk loaded whole
    assert c["load_chunks"] == LOADABLE // CHUNK and c["load_failed_chunks"] == 0, c
