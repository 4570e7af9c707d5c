"""``kvfabric route`` on real vLLM instances and a real pool: where each request goes, checked on prompts
whose residency the test controls.

Two kv_both instances (A, B) with the kvfabric connector on one pool server, vLLM's prefix cache on,
each publishing its KV events (``--kv-events-config``, endpoint discovered by the router from
``/kv_event_sources``), the router in front (its own process, ``python -m kvfabric route``) with the
pool's config and model, so it asks the pool with the connector's keys.

1. a prompt warmed on B only (sent to B directly) goes to B through the router, a prompt warmed on A
   to A, twice each in an order round robin would split, and the engines say they hit their cache;
2. a prompt the pool holds and no engine (sent to A, then A's prefix cache reset, which vLLM
   publishes as AllBlocksCleared): the router's prediction counts its chunks as pool tokens, i.e. its
   LOOKUP of the connector's keys found what the connector saved, and the engine loads them;
3. B killed (its instance and its event publisher): every request still gets an answer, from A.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from kvfabric.route.pool import EngineShape, PoolEventsView, PoolView
from kvfabric.testing import wait_for
from kvfabric.testing.servers import start_pool, stop_process_group
from kvfabric_vllm.tinymodel import random_prompt

from conftest import CHUNK, load_pd_example, wait_healthy

START_TIMEOUT_S = 600
WAIT_S = 120
PROMPT_TOKENS = 1500


pd_example = load_pd_example()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _complete(url: str, model: str, prompt: list[int]) -> tuple[dict, dict]:
    """A non-streamed completion: (answer, headers)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), dict(r.headers)


def _cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class Deployment:
    def __init__(self, model, pool, urls, procs, router, router_proc, extra, pool_events):
        self.model, self.pool, self.urls, self.procs = model, pool, urls, procs
        self.pool_events = pool_events
        self.router, self.router_proc, self.extra = router, router_proc, extra

    def stats(self) -> dict:
        return dict(_get(self.router + "/stats"), route=_get(self.router + "/route"))

    def index(self, url: str) -> dict:
        inst = next(i for i in self.stats()["route"]["instances"] if i["url"] == url)
        return inst["index"] or {}

    def index_entries(self, url: str) -> int:
        return self.index(url).get("entries", 0)


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("route")
    procs: list[subprocess.Popen] = []
    old = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"            # POST /reset_prefix_cache
    try:
        pool_events = f"ipc://{tmp}/pool-events"
        with start_pool(1, capacity="128MiB", extra_args=["--kv-events", pool_events]) as pool:
            try:
                urls, logs = [], []
                for name in ("a", "b"):
                    events = {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"ipc://{tmp}/{name}-events", "topic": "kv"}
                    log = open(tmp / f"{name}.log", "a+")
                    proc, url = pd_example.start_vllm(
                        tiny_model, "kv_both", pool.addresses, log,
                        extra_args=["--enable-prefix-caching", "--seed", "0", "--kv-events-config",
                                    json.dumps(events)])
                    procs.append(proc)
                    urls.append(url)
                    logs.append(log)
                for proc, url, log in zip(procs, urls, logs):
                    wait_healthy(proc, url, log, START_TIMEOUT_S)
                extra = {"servers": pool.addresses, "chunk_tokens": CHUNK}
                router = subprocess.Popen(
                    [sys.executable, "-m", "kvfabric", "route", "--port", "0", "--instance", urls[0],
                     "--instance", urls[1], "--pool-config", json.dumps(extra), "--model", tiny_model,
                     "--poll-s", "0.2", "--pool-timeout-s", "2"],
                    stdout=subprocess.PIPE, stderr=open(tmp / "router.log", "w"), text=True, start_new_session=True)
                procs.append(router)
                line = router.stdout.readline()
                assert line.startswith("kvfabric route listening on "), \
                    (line, (tmp / "router.log").read_text()[-3000:])
                yield Deployment(tiny_model, pool, urls, procs, "http://" + line.split()[-1], router, extra,
                                 pool_events)
            finally:
                for p in reversed(procs):
                    if p.poll() is None:
                        stop_process_group(p)
    finally:
        if old is None:
            os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        else:
            os.environ["VLLM_SERVER_DEV_MODE"] = old


def _warm(dep: Deployment, url: str, prompt: list[int]) -> None:
    """``prompt`` computed on the instance at ``url``, and the router's index of it updated by its events."""
    before = dep.index_entries(url)
    _complete(url, dep.model, prompt)
    blocks = len(prompt) // CHUNK
    assert wait_for(lambda: dep.index_entries(url) >= before + blocks, WAIT_S), dep.stats()


def test_requests_go_where_their_prefix_is_cached(dep):
    a, b = dep.urls
    p, q = random_prompt(PROMPT_TOKENS, seed=41), random_prompt(PROMPT_TOKENS, seed=42)
    _warm(dep, b, p)
    _warm(dep, a, q)
    shared = 10 * CHUNK                               # the variants share 10 whole blocks with the warmed prompt
    for i, (prompt, want) in enumerate(((p, b), (p, b), (q, a), (q, a))):
        variant = prompt[:shared] + random_prompt(200, seed=100 + i)
        answer, headers = _complete(dep.router, dep.model, variant)
        pred = json.loads(headers["X-KVFabric-Prediction"])
        assert headers["X-KVFabric-Instance"] == want, (i, want, pred, dep.stats()["route"]["instances"])
        assert pred["from_cache"] == shared, pred
        assert _cached(answer) >= shared, answer["usage"]      # the engine hit its own cache (or the pool)
    chosen = {i["url"]: i["chosen"] for i in dep.stats()["route"]["instances"]}
    assert chosen == {a: 2, b: 2}, chosen


def test_pool_residency_is_seen_with_the_connectors_keys(dep):
    a, _ = dep.urls
    r = random_prompt(PROMPT_TOKENS, seed=43)
    _warm(dep, a, r)
    view = PoolView(dep.extra, EngineShape(dep.model), timeout_s=5.0)
    try:
        # the connector saved every whole chunk; the router's keys find them
        assert wait_for(lambda: view.leading_tokens(r) == PROMPT_TOKENS // CHUNK * CHUNK, WAIT_S), view.counts
        assert view.leading_run(r) == (PROMPT_TOKENS // CHUNK * CHUNK, 0), view.counts   # all in DRAM
    finally:
        view.close()
    # the same from the pool server's KV events (kvfabric route --pool-events): the chunks the connector
    # saved came as BlockStored of their groups. The subscriber joins now, so a second prompt is warmed
    # after it: its chunks are found, the first prompt's (published before it joined) are not.
    events_view = PoolEventsView(dep.extra, EngineShape(dep.model), [dep.pool_events])
    try:
        joined = events_view.subscribers[0]
        for n in range(100):   # a SUB socket connects asynchronously: new chunks saved until one batch arrives
            if joined.counts["batches"]:
                break
            _complete(a, dep.model, random_prompt(CHUNK + 10, seed=1000 + n))
            wait_for(lambda: joined.counts["batches"] > 0, 2)
        assert joined.counts["batches"] > 0, joined.snapshot()
        r2 = random_prompt(PROMPT_TOKENS, seed=47)
        _warm(dep, a, r2)
        assert wait_for(lambda: events_view.leading_tokens(r2) == PROMPT_TOKENS // CHUNK * CHUNK, WAIT_S), \
            (events_view.counts, events_view.index.counts, events_view.subscribers[0].snapshot())
        assert events_view.index.counts["bad_events"] == 0, events_view.index.counts
        assert events_view.leading_run(r2)[1] == 0, events_view.counts   # in DRAM: no chunk on SSD only
    finally:
        events_view.close()
    req = urllib.request.Request(a + "/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=60):
        pass
    # vLLM publishes the AllBlocksCleared at its next engine step: give it one (a prompt of one block)
    _complete(a, dep.model, random_prompt(CHUNK + 10, seed=45))
    assert wait_for(lambda: dep.index(a)["cleared"] >= 1, WAIT_S), dep.stats()
    shared = 10 * CHUNK
    answer, headers = _complete(dep.router, dep.model, r[:shared] + random_prompt(200, seed=44))
    pred = json.loads(headers["X-KVFabric-Prediction"])
    assert pred["from_cache"] == 0 and pred["from_pool"] == shared, (pred, dep.stats()["route"]["pool"])
    assert _cached(answer) >= shared, answer["usage"]          # loaded from the pool by the connector


def test_a_dead_instance_and_publisher_do_not_hang_routing(dep):
    a, b = dep.urls
    stop_process_group(dep.procs[1])                            # B and its event publisher
    p = random_prompt(PROMPT_TOKENS, seed=41)                   # warmed on B by the first test
    for i in range(3):
        answer, headers = _complete(dep.router, dep.model, p[:1000] + [8 + i] * 50)
        assert headers["X-KVFabric-Instance"] == a, headers
        assert answer["usage"]["completion_tokens"] == 2, answer
    st = dep.stats()
    inst_b = next(i for i in st["route"]["instances"] if i["url"] == b)
    # B refused a request (retried on A) or its /metrics poll failed first: either way it is marked down
    assert inst_b["down"] and (st["retries"] == inst_b["failures"]), (st["retries"], inst_b)
