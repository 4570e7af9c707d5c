"""RL rollouts and agent turns on real vLLM (issue 27, parts 1 and 3).

1. Live weight versions (``kvfabric_vllm.weights``): an engine started on the tiny Llama saves a
   prompt's KV, its weights are replaced in place by other random weights (vLLM's own
   ``reload_weights``, as an RL driver does), ``refresh_weights_version`` runs on its workers and
   the prefix cache is reset with the connector's. The same prompt then loads nothing although
   the old weights' KV is still in the pool, and its greedy output equals a cold run of the new
   weights. A second engine, also started on the old weights and updated in place (the workers
   given the model once at start, the update only a reset), loads the KV the first saved after
   its update, and its output equals the cold run too. At TP=2 every rank measures its shard and
   the scheduler binds them together.
2. Read-your-writes between turns: two ``kv_both`` OpenAI servers on one pool of two servers.
   Turn 1 on engine A returns a ticket in ``kv_transfer_params``; turn 2 (turn 1's prompt
   extended) on engine B right after, carrying the ticket, loads turn 1's whole prefix, waiting
   for A's puts when they have not landed; with the server owning the ticket's chunks killed,
   B ends the wait at once (``pd_pool_down``, no ``pd_wait_timeouts``) and recomputes.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvfabric import Client
from kvfabric.testing.servers import start_pool, stop_process_group
from kvfabric_vllm.keys import prompt_keys
from kvfabric_vllm.layout import chunk_object_keys
from kvfabric_vllm.tinymodel import build_tiny_llama, tiny_engine_keys

from conftest import CHUNK, LOADABLE, PROMPT_TOKENS, PROMPTS, EngineRunner, post_json, wait_healthy
from test_pd import REQUEST_TIMEOUT_S, START_TIMEOUT_S, _metrics_when, pd_example

WAIT_MS = 20000   # the ticket wait's bound: far longer than a put on a loaded machine


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> str:
    """The tiny Llama's architecture with other random weights (what a trainer pushes)."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-new"), seed=1))


@pytest.fixture(scope="module")
def cold_new(new_weights, tmp_path_factory) -> list[int]:
    """Greedy output of PROMPTS["rl"] on an engine started on the new weights, without the connector."""
    return EngineRunner(new_weights, tmp_path_factory.mktemp("cold-new"))(["rl"])["outputs"][0]


def _delta(res: dict, i: int, name: str) -> int:
    """Counter ``name``'s growth during prompt ``i`` of an engine_run result."""
    after = res["counters_after"]
    return after[i][name] - (after[i - 1][name] if i else 0)


def test_weights_updated_in_place_never_load_the_old_kv(run_engine, tiny_model, new_weights, cold, cold_new):
    name = "rl"
    assert cold_new != cold[name], "the new weights must change the output, or this test proves nothing"
    reload = ["--reload-path", new_weights]
    with start_pool(1, capacity="64MiB") as pool:
        # engine A: the prompt on the old weights (saved), weights updated in place, the prompt again
        a = run_engine([name, name], pool.addresses, args=["--reload-before", "1", *reload])
        assert a["outputs"][0] == cold[name] and a["cached"] == [0, 0], a["cached"]
        assert _delta(a, 0, "save_chunks") == PROMPT_TOKENS // CHUNK      # every whole chunk of the prompt
        # the old weights' KV is still in the pool under the files' keys: an unversioned engine would load it
        old = prompt_keys(tiny_engine_keys(tiny_model, {"servers": pool.addresses}), PROMPTS[name])
        engine = tiny_engine_keys(tiny_model, {"servers": pool.addresses})
        with Client(pool.addresses) as c:
            objs = chunk_object_keys(engine.hasher, old.chunk_keys, engine.parts())
            assert c.exists(objs) == [True] * len(objs)
        # ... but after the update nothing was loaded, the output is the new weights', and it was saved anew
        assert a["outputs"][1] == cold_new, (a["outputs"][1], cold_new)
        for counter in ("lookup_hit_tokens", "scheduled_load_tokens", "load_chunks", "weights_refused_chunks"):
            assert _delta(a, 1, counter) == 0, (counter, a["counters_after"])
        assert _delta(a, 1, "weights_updates") == 1 and _delta(a, 1, "save_chunks") == PROMPT_TOKENS // CHUNK
        (fp_a,) = a["fingerprints"][0]

        # engine B: started on the old weights too, given the model once, then updated with a reset alone
        b = run_engine([name], pool.addresses, args=["--reload-before", "0", "--reload-mode", "reset", *reload])
        (fp_b_old,) = b["fingerprints"][0]
        assert fp_b_old != fp_a                         # B measured the old weights at start
        assert b["cached"] == [LOADABLE], b["counters"]  # the KV A saved after its update
        assert b["outputs"][0] == cold_new
        # one version bound: the reset's measurement replaced the start's before any step reported it
        assert b["counters"]["weights_updates"] == 1 and b["counters"]["weights_refused_chunks"] == 0


def test_weights_retire_drops_the_old_weights_kv_pool_wide(run_engine, tiny_model, new_weights, cold, cold_new):
    """``weights_retire: true``: the engine's saves carry their namespace's tag, and the update retires the
    files' namespace on every server: the old weights' objects are gone from the pool (not merely never
    asked for), the output is the new weights', and what was saved after the update stays."""
    name = "rl"
    with start_pool(2, capacity="64MiB") as pool:
        a = run_engine([name, name], pool.addresses, args=["--reload-before", "1", "--reload-path", new_weights,
                                                           "--extra", '{"weights_retire": true}'])
        assert a["outputs"] == [cold[name], cold_new], a["outputs"]
        assert a["cached"] == [0, 0], a["cached"]
        assert _delta(a, 1, "save_chunks") == PROMPT_TOKENS // CHUNK, a["counters_after"]
        engine = tiny_engine_keys(tiny_model, {"servers": pool.addresses})
        old = prompt_keys(engine, PROMPTS[name])
        with Client(pool.addresses) as c:
            objs = chunk_object_keys(engine.hasher, old.chunk_keys, engine.parts())
            # the engine's shutdown waited for the retire (the scheduler's counters were read before it)
            assert c.exists(objs) == [False] * len(objs)
            servers = c.stats()["servers"]
            assert [s["retires"] for s in servers.values()] == [1, 1], servers
            held = sum(s["objects"] for s in servers.values())
            assert held == len(objs), (held, len(objs), servers)   # the new weights' objects alone


def test_weights_updated_in_place_on_a_tp2_engine(run_engine, new_weights, cold, cold_new, monkeypatch):
    """The same at TP=2 (worker processes, vLLM's multi-process executor): every rank measures its
    own shard, the scheduler binds the two fingerprints together once both arrived (vLLM aggregates
    the ranks' worker metadata), nothing of the old weights is loaded, and the output is the new
    weights' (a TP=1 cold run: the tiny Llama's TP=1 and TP=2 outputs are identical, test_tp.py)."""
    from test_tp import TP_ARGS

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    name = "rl"
    with start_pool(1, capacity="64MiB") as pool:
        res = run_engine([name, name], pool.addresses, args=[*TP_ARGS, "--reload-before", "1",
                                                               "--reload-path", new_weights])
    assert res["outputs"] == [cold[name], cold_new], res["outputs"]
    assert res["cached"] == [0, 0], res["cached"]
    (fps,) = res["fingerprints"]
    assert len(fps) == 2 and fps[0] != fps[1], fps        # one per rank, each its own shard
    c = res["counters"]    # the scheduler's (this process); the workers' counters live in theirs
    assert c["weights_updates"] == 1 and c["scheduled_load_tokens"] == 0 and c["lookup_hit_tokens"] == 0, c


# ---------------------------------------------------------------------------- tickets between turns


@pytest.fixture(scope="module")
def turns(tiny_model, tmp_path_factory):
    """Two kv_both OpenAI servers (A, B) on one pool of two servers: (pool, url A, url B)."""
    tmp = tmp_path_factory.mktemp("turns")
    procs: list[subprocess.Popen] = []
    logs = []
    with start_pool(2, capacity="64MiB") as pool:
        try:
            urls = []
            for name in ("a", "b"):
                log = open(tmp / f"{name}.log", "a+")
                logs.append(log)
                proc, url = pd_example.start_vllm(tiny_model, "kv_both", pool.addresses, log,
                                                  extra_config={"pd_wait_ms": WAIT_MS},
                                                  extra_args=["--max-num-batched-tokens", "1024", "--seed", "0"])
                procs.append(proc)
                urls.append((proc, url, log))
            for proc, url, log in urls:
                wait_healthy(proc, url, log, START_TIMEOUT_S)
            yield pool, urls[0][1], urls[1][1], tiny_model
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    stop_process_group(p)
            for log in logs:
                log.close()


TURN1_CHUNKS = len(PROMPTS["turn1"]) // CHUNK         # the chunks turn 1 saves (its whole prompt chunks)
TURN2_LOADABLE = (len(PROMPTS["turn2"]) - 1) // CHUNK


def _turn(url: str, model: str, name: str, ticket: dict | None = None) -> dict:
    """PROMPTS[name] as a completion at ``url`` carrying ``ticket`` (the previous turn's kv_transfer_params)."""
    body = {"model": model, "prompt": PROMPTS[name], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    if ticket is not None:
        body["kv_transfer_params"] = ticket
    return post_json(url + "/v1/completions", body, REQUEST_TIMEOUT_S)


def _tokens_cached(res: dict) -> tuple[list[int], int]:
    return (res["choices"][0]["token_ids"],
            (res["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _turn2_objects(model: str, pool, chunks: int | None = None) -> list[bytes]:
    """Every pool object of turn 2's first ``chunks`` whole chunks (default all; turn 1's are the
    first TURN1_CHUNKS), keyed as the engines key them."""
    engine = tiny_engine_keys(model, {"servers": pool.addresses})
    pk = prompt_keys(engine, PROMPTS["turn2"])
    return chunk_object_keys(engine.hasher, pk.chunk_keys[:chunks], engine.parts())


def _ticket_of_turn1(a: str, model: str) -> dict:
    res = _turn(a, model, "turn1")
    ticket = res["kv_transfer_params"]
    assert ticket["kvfabric"]["chunks"] == TURN1_CHUNKS, ticket
    return ticket


def test_next_turn_on_another_engine_loads_the_previous_turn(turns, cold):
    """Turn 1 on A, turn 2 on B at once with A's ticket: B loads turn 1's whole prefix."""
    pool, a, b, model = turns
    ticket = _ticket_of_turn1(a, model)
    tokens, cached = _tokens_cached(_turn(b, model, "turn2", ticket))
    assert tokens == cold["turn2"]
    assert cached == TURN1_CHUNKS * CHUNK, cached
    after = _metrics_when(b, lambda t: True)
    assert after("pd_wait_timeouts") == 0 and after("pd_pool_down") == 0


def test_next_turn_waits_for_puts_that_have_not_landed(turns, cold):
    """The race a ticket closes: B gets turn 2 with A's ticket before A's puts are in the pool (taken
    out here); B waits (``pd_waits``), A's turn 1 puts them (run again: its lookup finds nothing),
    and B loads them all; no wait ran out."""
    pool, a, b, model = turns
    ticket = _ticket_of_turn1(a, model)
    with Client(pool.addresses) as c:
        c.delete(_turn2_objects(model, pool))
        assert c.lookup(_turn2_objects(model, pool)) == 0
    base = _metrics_when(b, lambda t: True)
    waits, timeouts = base("pd_waits"), base("pd_wait_timeouts")
    with ThreadPoolExecutor(1) as ex:
        second = ex.submit(_turn, b, model, "turn2", ticket)
        waiting = _metrics_when(b, lambda t: t("pd_waits") > waits or second.done())
        assert not second.done() and waiting("pd_waits") == waits + 1, "turn 2 did not wait for the ticket"
        assert _turn(a, model, "turn1")["kv_transfer_params"] == ticket     # the puts land now
        tokens, cached = _tokens_cached(second.result(timeout=REQUEST_TIMEOUT_S))
    after = _metrics_when(b, lambda t: True)
    assert tokens == cold["turn2"]
    assert cached == TURN1_CHUNKS * CHUNK, cached
    assert after("pd_wait_timeouts") == timeouts


def test_next_turn_does_not_wait_for_a_dead_owner(turns, cold):
    """The server owning the ticket's chunks is killed before turn 2: B's lookup marks it down and its
    wait ends at once (``pd_pool_down``; no ``pd_wait_timeouts``, so not the WAIT_MS bound); B
    recomputes: the same tokens, nothing cached. Runs last: it kills a pool server."""
    pool, a, b, model = turns
    ticket = _ticket_of_turn1(a, model)
    objs = _turn2_objects(model, pool, TURN1_CHUNKS)
    owners = []
    for server in pool:
        with Client([server.address]) as c:
            if any(c.exists(objs)):
                owners.append(server)
    assert len(owners) == 1, [s.address for s in owners]   # one segment, one replica: one owner
    with Client(pool.addresses) as c:
        c.delete(objs)                                       # A's puts "have not landed" ...
    owners[0].kill()                                         # ... and never will
    base = _metrics_when(b, lambda t: True)
    timeouts, down = base("pd_wait_timeouts"), base("pd_pool_down")
    tokens, cached = _tokens_cached(_turn(b, model, "turn2", ticket))
    after = _metrics_when(b, lambda t: t("pd_pool_down") > down)
    assert tokens == cold["turn2"] and cached == 0, cached
    assert after("pd_pool_down") == down + 1 and after("pd_wait_timeouts") == timeouts

