"""Prefill/decode disaggregation through the pool (issue 13 item 2).

The worker test runs without an engine on a real server: a producer's held
request is reported (vLLM's ``finished_sending``) only once its put was
acknowledged. The e2e tests share one deployment (module fixture ``pd``): a
real ``kvfabric serve``, two real OpenAI servers (``kv_producer``,
``kv_consumer``) started by the example's own ``start_vllm``
(``examples/pd/run.py``) and ``examples/pd/proxy.py``. They run in file
order; the last two kill the pool, then the engines.

1. two prompts at once through the proxy: identical to a single instance,
   the consumer loaded all but the last partial block, and its counters in
   vLLM's ``/metrics`` say so (no PD wait ran out); the producer released
   every request it held;
2. a streamed request (with ``min_tokens``, which the proxy must not send to
   the prefill instance) and a chat completion (``max_completion_tokens``)
   through the proxy: token-identical, loaded;
   a batch of two prompts through the proxy: one prefill per prompt, both
   prompts' entries to the decode instance, both loaded;
3. ``examples/pd/run.py`` itself, as a subprocess, pointed at the running
   instances (no engine of its own): what it prints;
4. the consumer gets the producer's ``kv_transfer_params`` before the
   producer's puts land: it waits (``pd_waits``), then loads them all;
   a consumer request with ``prompt_logprobs`` (vLLM reads no cached prefix
   for it) does not wait for chunks that are not there;
5. the pool killed after the producer's prefills: the consumer recomputes
   at once (its lookup marked the server down: no pd_wait_ms wait,
   ``pd_pool_down``), identical outputs, never a hang;
6. the prefill instance stopped: the proxy sends the request to the decode
   instance alone (identical output); the decode instance stopped too: the
   proxy answers 502 / 503 at once, no hang.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvfabric import Client, KeyHasher
from kvfabric.testing.servers import ServerPool, start_pool, stop_process_group
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.keys import prompt_keys
from kvfabric_vllm.meta import SaveSpec
from kvfabric_vllm.metrics import Counters
from kvfabric_vllm.layout import chunk_major_layer_keys, chunk_object_keys
from kvfabric_vllm.tinymodel import tiny_engine_keys
from kvfabric_vllm.worker import WorkerSide

from conftest import PARTS, PROMPTS, load_pd_example, metric_total, post_json, scrape_metrics, wait_healthy

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 300      # generous: "never hangs" means it answers well within this
EXAMPLE_TIMEOUT_S = 900      # the example's four requests on a loaded machine
VLLM_BLOCK = 128             # vLLM's CPU block size; PD chunks are one block
# the consumer's bounded wait for the producer's chunks: long enough for the late-puts test to see
# the consumer waiting and then run the producer (a prefill, seconds on a loaded machine) within it;
# (the dead-pool test no longer pays it: a pool whose servers are down ends the wait at once)
PD_WAIT_MS = 20000
METRICS_WAIT_S = 120         # vLLM records a step's connector stats after the step
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


pd_example = load_pd_example()


# ---------------------------------------------------------------------------- worker, no engine

def test_held_request_is_reported_only_after_its_put_is_acknowledged():
    block, layers, names = 32, 2, ["l0", "l1"]
    with start_pool(1, capacity="16MiB") as pool:
        cfg = parse_extra_config({"servers": pool.addresses, "chunk_tokens": block, "save_timeout_s": 60.0,
                                  "timeout_s": 60.0, "connect_timeout_s": 60.0}, "kv_producer", block)
        assert cfg.hold_until_saved and not cfg.load
        w = WorkerSide(cfg, Client(config=cfg.client), 0, block, names, Counters())
        kv = [torch.randn((8, 2, block, 16)) for _ in range(layers)]
        w.register(dict(zip(names, kv)))
        keys = [os.urandom(16), os.urandom(16)]
        spec = SaveSpec("p1", keys, [None, keys[0]], [[1], [5]])
        try:
            assert w.client.lookup(keys) == 0                # connected before the server stops
            with pool[0].paused():                         # stopped: the put cannot be acknowledged now
                w.submit_saves([spec])
                # the step where vLLM passes the finished request and the scheduler's hold
                assert w.finished_saves({"p1", "other"}, ["p1"]) == set(), {k: v for k, v in w.counters.snapshot().items() if v}
                for _ in range(5):
                    assert w.finished_saves(set(), []) == set(), {k: v for k, v in w.counters.snapshot().items() if v}
            deadline = time.monotonic() + 60
            reported: set[str] = set()
            while not reported:
                assert time.monotonic() < deadline, "held request never reported"
                reported = w.finished_saves(set(), [])
            assert reported == {"p1"}                      # never "other": it was not held
            with Client(pool.addresses) as c:                  # reported => in the pool (every layer)
                assert c.lookup(chunk_major_layer_keys(KeyHasher(), keys, layers)) == 2 * layers
            c = w.counters.snapshot()
            assert c["held_released"] == 1 and c["save_chunks"] == 2
            assert w.finished_saves(set(), []) == set()        # reported once
        finally:
            w.shutdown()


# ---------------------------------------------------------------------------- e2e


@dataclass
class PD:
    model: str
    pool: ServerPool
    prefill: str            # base URLs
    decode: str
    proxy: str
    consumer_log: Path
    prefill_proc: subprocess.Popen
    decode_proc: subprocess.Popen

    def complete(self, name: str, **extra) -> tuple[list[int], int]:
        """PROMPTS[name] through the proxy (streamed with ``stream=True``): (generated ids, cached tokens)."""
        body = {"model": self.model, "prompt": PROMPTS[name], "max_tokens": 12, "temperature": 0.0,
                "ignore_eos": True, **extra}
        tokens, prompt, cached = pd_example.complete(self.proxy, body)
        assert prompt == len(PROMPTS[name])
        return tokens, cached

    def proxy_counts(self) -> dict:
        return _get(self.proxy + "/stats")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _loadable(name: str) -> int:
    """Tokens a consumer loads: every whole block but the one holding the last prompt token."""
    return (len(PROMPTS[name]) - 1) // VLLM_BLOCK * VLLM_BLOCK


def _metrics_when(url: str, ready: Callable[[Callable[[str], float]], bool]) -> Callable[[str], float]:
    """vLLM's /metrics at ``url`` once ``ready(total)`` holds (or after METRICS_WAIT_S: the caller's
    assertions then say what is missing); ``total("load_tokens")`` sums ``vllm:kvfabric_load_tokens_total``."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        samples = scrape_metrics(url)

        def total(name: str, samples=samples) -> float:
            return metric_total(samples, f"vllm:kvfabric_{name}_total")

        if ready(total) or time.monotonic() > deadline:
            return total
        time.sleep(0.5)


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    procs: list[subprocess.Popen] = []
    with start_pool(1, capacity="64MiB") as pool:
        try:
            engines = {}
            for role in ("kv_producer", "kv_consumer"):
                log = open(tmp / f"{role}.log", "a+")    # O_APPEND: the test reads it while vLLM writes
                proc, url = pd_example.start_vllm(
                    tiny_model, role, pool.addresses, log, extra_config={"pd_wait_ms": PD_WAIT_MS},
                    extra_args=["--max-num-batched-tokens", "1024", "--seed", "0",
                                "--chat-template", str(tmp / "chat.jinja")])
                procs.append(proc)
                engines[role] = (proc, url, log)
            for proc, url, log in engines.values():
                wait_healthy(proc, url, log, START_TIMEOUT_S)
            purl, curl = engines["kv_producer"][1], engines["kv_consumer"][1]
            proxy, url = pd_example.start_proxy(purl, curl)
            procs.append(proxy)
            yield PD(tiny_model, pool, purl, curl, url, tmp / "kv_consumer.log",
                     engines["kv_producer"][0], engines["kv_consumer"][0])
        finally:
            for p in reversed(procs):
                if p.poll() is None:                     # the last test stops the engines itself
                    stop_process_group(p)
            for _, _, log in engines.values():
                log.close()


def test_pd_proxy_decodes_from_the_pool(pd, cold):
    names = ["single", "openai"]                 # 1500-token prompts, run at once through the proxy
    with ThreadPoolExecutor(2) as ex:
        results = dict(zip(names, ex.map(pd.complete, names)))
    with Client(pd.pool.addresses) as c:
        stats = c.stats()["servers"][pd.pool.addresses[0]]
    loaded = sum(_loadable(n) for n in names)
    consumer = _metrics_when(pd.decode, lambda t: t("load_tokens") >= loaded)
    producer = _metrics_when(pd.prefill, lambda t: t("held_requests") >= len(names)
                             and t("held_released") >= t("held_requests"))

    for n in names:
        tokens, cached = results[n]
        assert tokens == cold[n], n                                  # identical to a single instance
        # the consumer computed at most one partial block: everything before it came from the pool
        assert cached == _loadable(n) and len(PROMPTS[n]) - cached <= VLLM_BLOCK, (n, cached)
    # every request went to the consumer with the producer's kv_transfer_params
    assert pd.proxy_counts() == {"requests": 2, "prefill_failures": 0, "with_params": 2}
    assert _get(pd.proxy + "/health") == {"unhealthy": []}
    whole = sum(len(PROMPTS[n]) // VLLM_BLOCK for n in names)
    assert stats["objects"] == whole * PARTS             # the producer saved every whole block (per layer, head)
    assert stats["hits"] >= sum(_loadable(n) // VLLM_BLOCK for n in names)
    assert "kvfabric connector (SCHEDULER)" in pd.consumer_log.read_text()

    # the consumer's own counters (vLLM's /metrics): it loaded exactly those tokens from the pool,
    # found them (waiting for the producer's puts if it had to), and no wait ran out
    assert consumer("load_tokens") == loaded
    assert consumer("lookup_hit_tokens") == loaded
    assert consumer("load_chunks") == loaded // VLLM_BLOCK
    assert consumer("pd_wait_timeouts") == 0, consumer("pd_waits")
    assert consumer("load_errors") == consumer("load_failed_chunks") == 0
    assert consumer("save_chunks") == 0                  # a consumer never saves
    # the producer saved every whole block and held each request until its puts were acknowledged
    assert producer("save_chunks") == whole
    assert producer("held_requests") == producer("held_released") == len(names)
    assert producer("load_tokens") == producer("pd_waits") == 0


def test_pd_streamed_request_with_min_tokens_through_the_proxy(pd, cold):
    before = pd.proxy_counts()
    # min_tokens: the proxy must not pass it to the prefill request (max_tokens=1), which vLLM
    # refuses (min_tokens > max_tokens): that was a prefill failure and a full recompute here
    tokens, cached = pd.complete("pd_stream", stream=True, min_tokens=12)
    after = pd.proxy_counts()
    assert tokens == cold["pd_stream"]                   # streamed == a single instance, not streamed
    assert cached == _loadable("pd_stream")              # ... decoded from the producer's KV in the pool
    assert after["prefill_failures"] == before["prefill_failures"]
    assert after["with_params"] == before["with_params"] + 1


def test_pd_chat_completion_through_the_proxy(pd):
    """``/v1/chat/completions`` with ``max_completion_tokens`` (the proxy makes it 1 for the prefill):
    the answer equals the producer's own (it computes the whole prompt) and the consumer loaded it."""
    rng = random.Random(7)
    document = " ".join(f"shard{rng.randrange(100)} block{rng.randrange(100)}" for _ in range(400))
    body = {"model": pd.model, "messages": [{"role": "user", "content": document}], "max_completion_tokens": 12,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    before = pd.proxy_counts()
    res = post_json(pd.proxy + "/v1/chat/completions", body, REQUEST_TIMEOUT_S)
    alone = post_json(pd.prefill + "/v1/chat/completions", body, REQUEST_TIMEOUT_S)
    after = pd.proxy_counts()
    tokens, prompt = res["choices"][0]["token_ids"], res["usage"]["prompt_tokens"]
    assert prompt > 2 * VLLM_BLOCK and len(tokens) == 12
    assert tokens == alone["choices"][0]["token_ids"]
    assert (res["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") == \
        (prompt - 1) // VLLM_BLOCK * VLLM_BLOCK
    assert after["with_params"] == before["with_params"] + 1
    assert after["prefill_failures"] == before["prefill_failures"]


def test_pd_batch_prompt_through_the_proxy(pd, cold):
    """A completion with two prompts through the proxy: vLLM answers a batch with its first prompt's
    kv_transfer_params only, so the proxy prefills one prompt per request and hands the decode
    instance both entries; each prompt finds its own (no key-mismatch warning), both load every
    whole block from the pool, token-identical to a single instance."""
    names = ["corrupt", "mp_new"]               # not sent to these engines before
    loads = _metrics_when(pd.decode, lambda t: True)("load_tokens")
    counts = pd.proxy_counts()
    body = {"model": pd.model, "prompt": [PROMPTS[n] for n in names], "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    # with a client's X-Request-Id, which the proxy makes unique per prefill (vLLM keys requests by it)
    req = urllib.request.Request(pd.proxy + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": "pd-batch"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        res = json.loads(r.read())
    loaded = sum(_loadable(n) for n in names)
    consumer = _metrics_when(pd.decode, lambda t: t("load_tokens") >= loads + loaded)

    assert [c["token_ids"] for c in sorted(res["choices"], key=lambda c: c["index"])] == [cold[n] for n in names]
    after = pd.proxy_counts()
    assert after["with_params"] == counts["with_params"] + 1 and after["prefill_failures"] == counts["prefill_failures"]
    assert consumer("load_tokens") == loads + loaded     # both prompts' whole blocks came from the pool
    assert "cannot key alike" not in pd.consumer_log.read_text()


def test_pd_example_runs_against_the_engines(pd):
    """``examples/pd/run.py`` as a user runs it against a deployment (no engine of its own)."""
    cmd = [sys.executable, str(ROOT / "examples" / "pd" / "run.py"), "--prefill", pd.prefill,
           "--decode", pd.decode, "--servers", ",".join(pd.pool.addresses)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    out = res.stdout
    print(out)                                           # shown with -rP and on failure
    assert res.returncode == 0, out + res.stderr[-4000:]
    requests = re.findall(r"request '.*?'( \(streamed\))?: prompt (\d+) tokens, decode instance loaded (\d+) "
                          r"from the pool and computed (\d+); .*; same tokens as one instance alone: (\w+)", out)
    assert len(requests) == 2, out
    assert [r[0] for r in requests] == ["", " (streamed)"], out
    for _, prompt, loaded, computed, same in requests:
        prompt, loaded = int(prompt), int(loaded)
        assert same == "yes", out
        assert loaded == (prompt - 1) // VLLM_BLOCK * VLLM_BLOCK and int(computed) == prompt - loaded, out
    pool_line = re.search(rf"pool server {re.escape(pd.pool.addresses[0])}: (\d+) objects .*, (\d+) hits", out)
    assert pool_line and int(pool_line[1]) > 0 and int(pool_line[2]) > 0, out
    proxy_line = re.search(r"^proxy: (.*)$", out, re.M)
    assert proxy_line and json.loads(proxy_line[1]) == {"requests": 2, "prefill_failures": 0, "with_params": 2}, out


def _chunk_keys(pd: PD, name: str) -> list[bytes]:
    """The keys the engines give PROMPTS[name]'s whole chunks, computed here as the connector does."""
    engine = tiny_engine_keys(pd.model, {"servers": pd.pool.addresses, "chunk_tokens": VLLM_BLOCK},
                              block_size=VLLM_BLOCK)
    return prompt_keys(engine, PROMPTS[name]).chunk_keys


def _objects(pd: PD, keys: list[bytes]) -> list[bytes]:
    """Every pool object of the chunks ``keys`` (each layer, each KV head: layout 3)."""
    engine = tiny_engine_keys(pd.model, {"servers": pd.pool.addresses, "chunk_tokens": VLLM_BLOCK},
                              block_size=VLLM_BLOCK)
    return chunk_object_keys(engine.hasher, keys, engine.parts())


def test_pd_consumer_waits_for_the_producers_late_puts(pd, cold):
    """The race the consumer's bounded wait closes: it gets the producer's ``kv_transfer_params``
    while the pool does not hold the chunks yet; it waits (looking up again), then loads them all."""
    name = "pd_stream"                         # its chunks are in the pool since the streamed test
    keys = _chunk_keys(pd, name)
    with Client(pd.pool.addresses) as c:       # take them out: the producer's puts have "not landed"
        deleted = c.delete(_objects(pd, keys))
    assert deleted == len(keys) * PARTS, "the keys computed here are no longer the connector's"
    params = {"kvfabric": {"chunks": len(keys), "chunk_tokens": VLLM_BLOCK, "key": keys[-1].hex()}}
    body = {"model": pd.model, "prompt": PROMPTS[name], "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}
    base = _metrics_when(pd.decode, lambda t: True)
    waits, relookups, timeouts = base("pd_waits"), base("pd_relookups"), base("pd_wait_timeouts")
    with ThreadPoolExecutor(1) as ex:
        consumer_answer = ex.submit(pd_example.complete, pd.decode, dict(body, kv_transfer_params=params))
        waiting = _metrics_when(pd.decode, lambda t: t("pd_waits") > waits or consumer_answer.done())
        assert not consumer_answer.done() and waiting("pd_waits") == waits + 1   # it waits ...
        # ... for the producer, which now prefills the prompt and puts its chunks (the same params)
        producer_answer = post_json(pd.prefill + "/v1/completions", dict(body, max_tokens=1), REQUEST_TIMEOUT_S)
        tokens, prompt, cached = consumer_answer.result(timeout=REQUEST_TIMEOUT_S)
    assert producer_answer["kv_transfer_params"] == params
    consumer = _metrics_when(pd.decode, lambda t: t("pd_relookups") > relookups)
    assert tokens == cold[name]
    assert cached == _loadable(name)                     # every chunk the producer reported
    assert consumer("pd_relookups") > relookups and consumer("pd_wait_timeouts") == timeouts


def test_pd_consumer_does_not_wait_for_a_request_that_reads_no_prefix(pd, cold):
    """A consumer request with ``prompt_logprobs`` (vLLM reads no cached prefix for it and discards
    a connector's answer) carrying the producer's params whose chunks are not in the pool: no PD
    wait, nothing loaded, the same tokens."""
    name = "pd_stream"
    keys = _chunk_keys(pd, name)
    with Client(pd.pool.addresses) as c:       # not in the pool (the late-puts test checks these keys)
        c.delete(_objects(pd, keys))
        assert c.lookup(_objects(pd, keys)) == 0
    params = {"kvfabric": {"chunks": len(keys), "chunk_tokens": VLLM_BLOCK, "key": keys[-1].hex()}}
    body = {"model": pd.model, "prompt": PROMPTS[name], "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "prompt_logprobs": 1, "kv_transfer_params": params}
    base = _metrics_when(pd.decode, lambda t: True)
    waits, hits = base("pd_waits"), base("lookup_hit_tokens")
    tokens, prompt, cached = pd_example.complete(pd.decode, body)
    after = _metrics_when(pd.decode, lambda t: True)
    assert tokens == cold[name] and prompt == len(PROMPTS[name]) and cached == 0
    assert after("pd_waits") == waits and after("lookup_hit_tokens") == hits


def test_pd_consumer_recomputes_when_the_pool_dies(pd, cold):
    """The pool dies after the producer's prefills: the consumer's lookup fails, the pool's only
    server is marked down, so it does not wait for the chunks the producer reported (pd_wait_ms):
    it recomputes at once: identical output, never a hang."""
    before = _metrics_when(pd.decode, lambda t: True)
    timeouts, pool_down = before("pd_wait_timeouts"), before("pd_pool_down")
    pd.pool[0].kill()
    down = pd.complete("down")
    consumer = _metrics_when(pd.decode, lambda t: t("pd_pool_down") > pool_down)
    producer = _metrics_when(pd.prefill, lambda t: t("held_released") >= t("held_requests"))

    assert down == (cold["down"], 0)                     # recomputed: nothing could be loaded
    # ... without waiting for the chunks the producer reported: warned once, counted
    assert "servers owning the next one are down" in pd.consumer_log.read_text()
    assert consumer("pd_pool_down") == pool_down + 1 and consumer("pd_wait_timeouts") == timeouts
    # the producer's saves to the dead pool failed, and that too ended its holds (blocks freed)
    assert producer("held_released") == producer("held_requests")


def test_pd_proxy_when_the_instances_stop(pd, cold):
    """The proxy's fall-backs: no prefill instance -> the decode instance computes the prompt; no
    decode instance either -> an error answer at once (never a hang, never a dropped connection)."""
    before = pd.proxy_counts()
    stop_process_group(pd.prefill_proc)
    alone = pd.complete("down")                           # (the pool is dead too: nothing to load)
    after = pd.proxy_counts()
    assert alone == (cold["down"], 0)
    assert after["prefill_failures"] == before["prefill_failures"] + 1
    assert after["with_params"] == before["with_params"]

    stop_process_group(pd.decode_proc)
    for method, path, body, status in (("POST", "/v1/completions", {"model": pd.model, "prompt": [1, 2, 3]}, 502),
                                       ("GET", "/v1/models", None, 502), ("GET", "/health", None, 503)):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(pd.proxy + path, data, {"Content-Type": "application/json"}, method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S)
        assert err.value.code == status, (path, err.value.read())
