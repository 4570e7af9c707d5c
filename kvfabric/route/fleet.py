"""The instances behind the router, what it knows of each, and the choice of one for a prompt.

Per instance (:class:`Instance`): its KV-event index (:mod:`.events`), the router's own in-flight
counts (requests sent and not finished; prompt tokens to prefill that have not produced a first
token), and what its ``/metrics`` said last (vLLM's ``num_requests_running`` / ``_waiting``, and two
measured rates, :class:`.cost.Rate`: prefill seconds per computed prompt token from
``vllm:request_prefill_time_seconds_sum`` over ``vllm:prompt_tokens_by_source_total{source=
"local_compute"}``, and load seconds per token from the kvfabric connector's
``vllm:kvfabric_load_seconds_sum`` over ``vllm:kvfabric_load_tokens_total``, and the connector's SSD
loads' seconds per token, ``vllm:kvfabric_ssd_load_us_total`` over ``..._ssd_load_tokens_total``).

:class:`Fleet` polls every instance's ``/metrics`` (and, for an instance whose KV-event endpoint
was not given, vLLM's ``/kv_event_sources`` until it answers) on one background thread, each GET
with a deadline (``poll_timeout_s``), so a slow or dead instance never delays a routing decision:
its figures go stale (then only the router's own counts are used) and it is marked down, which
costs it a penalty, not exclusion (a request it then fails is retried elsewhere by the server).

:meth:`Fleet.choose` ranks the candidates by the policy:

* ``kv``: the lowest predicted TTFT (:func:`.cost.predict`) from the instance's cached prefix (its
  index), the pool's (one LOOKUP per request, shared by all candidates) and its queue;
* ``least-loaded``: the same prediction with no cache and no pool (queue and prompt only);
* ``rr``: round robin.

Ties (within ``TIE_S``) go to the instance with fewer requests in flight, then round robin.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..keys import KeyHasher, Namespace
from .cost import Prediction, Rate, predict
from .events import DEFAULT_MAX_ENTRIES, EngineIndex, Subscriber
from .pool import PoolView

log = logging.getLogger("kvfabric.route")

POLICIES = ("kv", "least-loaded", "rr")
TIE_S = 1e-3
MAX_METRICS_BYTES = 4 << 20
RATE_WINDOW_TOKENS = 8192   # prompt tokens (computed, or loaded) per measured rate window
DOWN_PENALTY_S = 60.0     # added to a down instance's prediction: used only when nothing else answers


@dataclass
class Costs:
    """Priors of the rates until an instance's own are measured, and the per-running-request charge."""

    prefill_s_per_token: float = 1e-4
    load_s_per_token: float = 1e-5
    decode_s_per_running: float = 0.01


@dataclass
class Instance:
    url: str
    role: str = "both"                      # "both" (kv mode), "prefill" or "decode" (pd mode)
    events: str | None = None               # ZMQ endpoint of its KV events (None: ask /kv_event_sources)
    topic: str = ""
    index: EngineIndex | None = None
    subscriber: Subscriber | None = None
    prefill: Rate | None = None
    load: Rate | None = None
    load_ssd: Rate | None = None            # SSD loads' rate; until measured, SSD tokens cost ``load``
    running: float = 0.0
    waiting: float = 0.0
    metrics_at: float | None = None         # monotonic time of the last good /metrics
    down_until: float = 0.0                 # monotonic: marked down (a failed request or poll) until then
    in_flight: int = 0                      # requests the router sent, not finished
    own_at_poll: int = 0                    # in_flight when /metrics was last read (its running + waiting
                                            # beyond this are other clients' requests)
    pending_tokens: int = 0                 # of those, prompt tokens still to prefill (no first token yet)
    mean_prompt: float = 0.0
    chosen: int = 0
    failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self, now: float) -> dict:
        return {"url": self.url, "role": self.role, "chosen": self.chosen, "failures": self.failures,
                "in_flight": self.in_flight, "pending_tokens": self.pending_tokens,
                "running": self.running, "waiting": self.waiting,
                "metrics_age_s": None if self.metrics_at is None else now - self.metrics_at,
                "down": now < self.down_until,
                "prefill_s_per_token": self.prefill.value if self.prefill else None,
                "prefill_measured": bool(self.prefill and self.prefill.measured),
                "load_s_per_token": self.load.value if self.load else None,
                "load_measured": bool(self.load and self.load.measured),
                "load_ssd_s_per_token": self.load_ssd.value if self.load_ssd and self.load_ssd.measured else None,
                "index": self.index.snapshot() if self.index else None,
                "events": self.subscriber.snapshot() if self.subscriber else None}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name (with ``{source="..."}`` kept for the by-source counter): sum over
    the other labels}; only the samples the router uses."""
    want = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_prefill_time_seconds_sum",
            "vllm:kvfabric_load_seconds_sum", "vllm:kvfabric_load_tokens_total", "vllm:kvfabric_ssd_load_us_total",
            "vllm:kvfabric_ssd_load_tokens_total")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value = line.partition(" ")
            labels = ""
        else:
            labels, _, value = rest.rpartition("} ")
        if name == "vllm:prompt_tokens_by_source_total":
            if 'source="local_compute"' not in labels:
                continue
            name = "local_compute_tokens"
        elif name not in want:
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


def _get(url: str, timeout_s: float, cap: int = MAX_METRICS_BYTES) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        data = r.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"{url}: answer over {cap} bytes")
    return data


class Fleet:
    """The instances, their background poller, and :meth:`choose` (module docstring)."""

    def __init__(self, instances: Sequence[Instance], *, policy: str = "kv", pool: PoolView | None = None,
                 hasher: KeyHasher | None = None, namespace: Namespace | None = None, costs: Costs = Costs(),
                 poll_s: float = 2.0, poll_timeout_s: float = 1.0, stale_s: float = 5.0,
                 index_entries: int = DEFAULT_MAX_ENTRIES, pool_timeout_s: float | None = None,
                 poll: bool = True) -> None:
        """``poll`` False: no background thread (no /metrics, no event discovery; tests of the choice)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not instances:
            raise ValueError("at least one instance is needed")
        self.instances = list(instances)
        self.policy, self.pool, self.costs = policy, pool, costs
        self.poll_s, self.poll_timeout_s, self.stale_s = poll_s, poll_timeout_s, stale_s
        self.hasher = hasher or (pool.hasher if pool else KeyHasher())
        self.namespace = namespace or (pool.namespace if pool else Namespace(model="kvfabric-route"))
        self.pool_timeout_s = pool_timeout_s if pool_timeout_s is not None else (pool.timeout_s if pool else 0.0)
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lookups = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvf-route-pool") if pool else None
        self.counts = {"choices": 0, "pool_lookup_timeouts": 0, "no_tokens": 0}
        for inst in self.instances:
            inst.index = EngineIndex(self.hasher, self.namespace, index_entries)
            # windows of several requests: one request's prefill time on a busy host is noise, and a rate
            # off by 2x between equal instances outweighs what a cached prefix saves
            inst.prefill = Rate(costs.prefill_s_per_token, min_tokens=RATE_WINDOW_TOKENS)
            inst.load = Rate(costs.load_s_per_token, min_tokens=RATE_WINDOW_TOKENS)
            inst.load_ssd = Rate(costs.load_s_per_token, min_tokens=RATE_WINDOW_TOKENS)
            if inst.events:
                self._subscribe(inst, inst.events, inst.topic)
        self._poller = threading.Thread(target=self._poll_loop, name="kvf-route-poll", daemon=True)
        if poll:
            self._poller.start()

    # ------------------------------------------------------------------ background

    def _subscribe(self, inst: Instance, endpoint: str, topic: str) -> None:
        try:
            inst.subscriber = Subscriber(endpoint, inst.index, topic)
            log.info("%s: KV events from %s", inst.url, endpoint)
        except ImportError as exc:
            log.warning("%s: no KV events (%s): pip install 'kvfabric[route]'", inst.url, exc)
            inst.events = "unavailable"

    def _discover(self, inst: Instance) -> None:
        """vLLM's GET /kv_event_sources: ``{"0": {"endpoint": "tcp://*:PORT", "topic": ...}}``; a wildcard
        host is the instance's own."""
        try:
            src = json.loads(_get(inst.url + "/kv_event_sources", self.poll_timeout_s, 1 << 16))
        except (OSError, ValueError):
            return
        cfg = next(iter(src.values()), None) if isinstance(src, dict) else None
        if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events") or cfg.get("publisher") != "zmq":
            inst.events = "none"                  # the instance publishes no events: do not ask again
            return
        endpoint = str(cfg.get("endpoint", ""))
        host = urlsplit(inst.url).hostname or "127.0.0.1"
        for wild in ("*", "0.0.0.0", "[::]"):
            endpoint = endpoint.replace(f"//{wild}:", f"//{host}:")
        inst.events, inst.topic = endpoint, str(cfg.get("topic") or "")
        self._subscribe(inst, endpoint, inst.topic)

    def _poll_one(self, inst: Instance) -> None:
        if inst.events is None and self.policy == "kv":
            self._discover(inst)
        try:
            m = parse_metrics(_get(inst.url + "/metrics", self.poll_timeout_s).decode(errors="replace"))
        except (OSError, ValueError) as exc:
            log.debug("%s/metrics: %s", inst.url, exc)
            inst.down_until = time.monotonic() + 2 * self.poll_s
            return
        with inst.lock:
            inst.running = m.get("vllm:num_requests_running", 0.0)
            inst.waiting = m.get("vllm:num_requests_waiting", 0.0)
            if "vllm:request_prefill_time_seconds_sum" in m and "local_compute_tokens" in m:
                inst.prefill.observe(m["vllm:request_prefill_time_seconds_sum"], m["local_compute_tokens"])
            if "vllm:kvfabric_load_seconds_sum" in m and "vllm:kvfabric_load_tokens_total" in m:
                inst.load.observe(m["vllm:kvfabric_load_seconds_sum"], m["vllm:kvfabric_load_tokens_total"])
            if "vllm:kvfabric_ssd_load_us_total" in m and "vllm:kvfabric_ssd_load_tokens_total" in m:
                inst.load_ssd.observe(m["vllm:kvfabric_ssd_load_us_total"] / 1e6,
                                      m["vllm:kvfabric_ssd_load_tokens_total"])
            inst.own_at_poll = inst.in_flight
            inst.metrics_at = time.monotonic()
            inst.down_until = 0.0

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            for inst in self.instances:
                if self._stop.is_set():
                    return
                self._poll_one(inst)
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        for inst in self.instances:
            if inst.subscriber is not None:
                inst.subscriber.stop()
        if self._poller.is_alive():
            self._poller.join(self.poll_timeout_s + self.poll_s + 1.0)
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------------ the choice

    def pool_run(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(leading prompt tokens the pool holds, of them in chunks on a server's SSD tier only);
        (0, 0) past the deadline (counted)."""
        if self.pool is None or not tokens:
            return 0, 0
        fut = self._lookups.submit(self.pool.leading_run, tokens)
        try:
            return fut.result(timeout=self.pool_timeout_s + 0.05)
        except FutureTimeout:
            with self._lock:
                self.counts["pool_lookup_timeouts"] += 1
            return 0, 0

    def predict(self, inst: Instance, tokens: Sequence[int] | None, pool_tokens: int, use_cache: bool,
                loads_from_pool: bool, now: float, keys: dict[int, list[bytes]] | None = None,
                pool_ssd_tokens: int = 0) -> Prediction:
        """``inst``'s prediction for ``tokens``; ``keys`` caches the prompt's block keys by block size
        (instances of one model share them); ``pool_ssd_tokens`` of the pool's are priced at ``inst``'s
        SSD load rate once measured."""
        n = len(tokens) if tokens is not None else int(inst.mean_prompt)
        cached = 0
        bs = inst.index.block_size
        if use_cache and tokens is not None and bs is not None:
            keys = {} if keys is None else keys
            if bs not in keys:
                keys[bs] = inst.index.prompt_keys(tokens)
            cached = inst.index.leading(keys[bs]) * bs
        with inst.lock:
            fresh = inst.metrics_at is not None and now - inst.metrics_at < self.stale_s
            # vLLM's figures count the router's own requests too, as they were at the poll: the router's
            # counts are current, so only the excess over its own at poll time (other clients) is added
            others = max(0.0, inst.running + inst.waiting - inst.own_at_poll) if fresh else 0.0
            others_waiting = min(others, inst.waiting) if fresh else 0.0
            queued = inst.pending_tokens + others_waiting * inst.mean_prompt
            running = inst.in_flight + others - others_waiting
            p = predict(n, cached, pool_tokens if use_cache else 0, queued_tokens=queued, running=running,
                        prefill_s_per_token=inst.prefill.value, load_s_per_token=inst.load.value,
                        decode_s_per_running=self.costs.decode_s_per_running, loads_from_pool=loads_from_pool,
                        pool_ssd_tokens=pool_ssd_tokens if use_cache else 0,
                        load_ssd_s_per_token=inst.load_ssd.value if inst.load_ssd.measured else None)
        if now < inst.down_until:
            p.ttft_s += DOWN_PENALTY_S
        return p

    def choose(self, candidates: Sequence[Instance], tokens: Sequence[int] | None, *, loads_from_pool: bool = True,
               pool_tokens: int | None = None, exclude: Sequence[Instance] = ()) -> tuple[Instance, Prediction | None]:
        """The instance to send a prompt (``tokens``; None when unknown: queue only) to, and its prediction
        (None under ``rr``). ``pool_tokens`` given skips the LOOKUP (PD: the decode side loads everything)."""
        cands = [c for c in candidates if c not in exclude] or list(candidates)
        with self._lock:
            self.counts["choices"] += 1
            turn = next(self._rr)
            if tokens is None:
                self.counts["no_tokens"] += 1
        if self.policy == "rr":
            return cands[turn % len(cands)], None
        use_cache = self.policy == "kv" and tokens is not None
        pool_ssd = 0
        if use_cache and pool_tokens is None:
            pool_tokens, pool_ssd = self.pool_run(tokens) if loads_from_pool else (0, 0)
        now = time.monotonic()
        keys: dict[int, list[bytes]] = {}
        preds = [self.predict(c, tokens, pool_tokens or 0, use_cache, loads_from_pool, now, keys, pool_ssd)
                 for c in cands]
        best = min(p.ttft_s for p in preds)
        tied = [i for i, p in enumerate(preds) if p.ttft_s <= best + TIE_S]
        least = min(cands[i].in_flight for i in tied)
        tied = [i for i in tied if cands[i].in_flight == least]
        i = tied[turn % len(tied)]
        return cands[i], preds[i]

    def begin(self, inst: Instance, prompt_tokens: int, pred: Prediction | None) -> int:
        """Count a request sent to ``inst``; returns the tokens it adds to the queue (for :meth:`first_token`)."""
        work = pred.recompute if pred is not None else prompt_tokens
        with inst.lock:
            inst.chosen += 1
            inst.in_flight += 1
            inst.pending_tokens += work
            inst.mean_prompt = prompt_tokens if inst.chosen == 1 else 0.9 * inst.mean_prompt + 0.1 * prompt_tokens
        return work

    def first_token(self, inst: Instance, work: int) -> None:
        with inst.lock:
            inst.pending_tokens -= work

    def end(self, inst: Instance, failed: bool = False) -> None:
        with inst.lock:
            inst.in_flight -= 1
            if failed:
                inst.failures += 1
                inst.down_until = time.monotonic() + max(2.0, 4 * self.poll_s)

    def snapshot(self) -> dict:
        now = time.monotonic()
        with self._lock:
            counts = dict(self.counts)
        return {"policy": self.policy, **counts, "pool": dict(self.pool.counts) if self.pool else None,
                "instances": [i.snapshot(now) for i in self.instances]}


__all__ = ["Costs", "Fleet", "Instance", "POLICIES", "parse_metrics"]
