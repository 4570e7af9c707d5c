"""The serving benchmark's load generator: streamed completions, round-robin over the instances.

Each request is one ``POST /v1/completions`` with the prompt as token ids,
``max_tokens`` of the workload, ``ignore_eos`` (so the output has the
trace's length), greedy, streamed with the usage in the last event. Times
from the moment the request is sent: TTFT at the first event that carries
generated text, end-to-end at the end of the stream. Request ``i`` of a run
goes to instance ``i mod n`` (round-robin, in the order requests are sent).

Two ways to offer load:

* **closed** (``concurrency`` C): C workers, each takes the next whole
  session and sends its turns one after the other, the next turn once the
  previous answer is complete;
* **open** (``speedup`` S): each request is sent at its arrival time in the
  workload over S, whatever is still running.

A request that fails (HTTP error, connection reset, a stream with no
usage) is recorded with its error and counted, never retried.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from ._serve_workload import ServeRequest, Workload

REQUEST_TIMEOUT_S = 1800.0
MAX_OPEN_THREADS = 512


@dataclass
class Result:
    """One request's outcome (times in seconds from its send)."""

    index: int
    session: int
    instance: int
    sent_s: float                    # from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    def to_json(self) -> dict:
        return dict(self.__dict__)


def complete(url: str, prompt: list[int], max_tokens: int, model: str = "tiny",
             timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[float, float, dict]:
    """One streamed completion: (TTFT s, end-to-end s, usage); raises on any failure."""
    ttft, e2e, usage, _ = stream_completion(url, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0.0, "ignore_eos": True}, timeout_s)
    return ttft, e2e, usage


def stream_completion(url: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S,
                      ) -> tuple[float, float, dict, list[int]]:
    """``body`` (a completion request) streamed with the usage in the last event: (TTFT s, end-to-end s,
    usage, the output's token ids when ``body`` asks ``return_token_ids``, else []); raises on any failure.
    TTFT is taken at the first event that carries generated text or token ids."""
    u = urlsplit(url)
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    ids: list[int] = []
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        ttft = None
        usage: dict = {}
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for c in event.get("choices") or []:
                if ttft is None and (c.get("text") or c.get("token_ids")):
                    ttft = time.perf_counter() - t0
                ids.extend(c.get("token_ids") or ())
            usage = event.get("usage") or usage
        e2e = time.perf_counter() - t0
    finally:
        conn.close()
    if not usage:
        raise RuntimeError("the stream ended without usage")
    return (e2e if ttft is None else ttft), e2e, usage, ids


class _RoundRobin:
    def __init__(self, n: int) -> None:
        self.n, self.i, self.lock = n, 0, threading.Lock()

    def next(self) -> int:
        with self.lock:
            i, self.i = self.i, self.i + 1
        return i % self.n


def run(workload: Workload, urls: list[str], *, concurrency: int | None, epoch: int, vocab: int,
        speedup: float = 1.0, on_done: Callable[[Result], None] = lambda r: None) -> tuple[list[Result], float]:
    """Replay ``workload`` against ``urls``: closed loop with ``concurrency`` workers, or open loop at the
    workload's arrival times over ``speedup`` when ``concurrency`` is None; prompt token ids stay below ``vocab``.
    Returns (results in request order, wall s)."""
    rr = _RoundRobin(len(urls))
    results: list[Result | None] = [None] * len(workload.requests)
    t_start = time.perf_counter()

    def send(r: ServeRequest) -> None:
        inst = rr.next()
        res = Result(r.index, r.session, inst, time.perf_counter() - t_start)
        try:
            ttft, e2e, usage = complete(urls[inst], r.tokens(workload.block_tokens, vocab, epoch), r.max_tokens)
            res.ttft_s, res.e2e_s = ttft, e2e
            res.prompt_tokens = usage.get("prompt_tokens", 0)
            res.output_tokens = usage.get("completion_tokens", 0)
            res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except Exception as e:   # recorded and counted in the report, never retried
            res.error = f"{type(e).__name__}: {e}"[:500]
        results[r.index] = res
        on_done(res)

    if concurrency is not None:
        sessions: dict[int, list[ServeRequest]] = {}
        for r in workload.requests:
            sessions.setdefault(r.session, []).append(r)
        todo: queue.Queue = queue.Queue()
        for s in sorted(sessions):
            todo.put(sessions[s])

        def worker() -> None:
            while True:
                try:
                    turns = todo.get_nowait()
                except queue.Empty:
                    return
                for r in turns:
                    send(r)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    else:
        def at(r: ServeRequest) -> None:
            delay = r.arrival_s / speedup - (time.perf_counter() - t_start)
            if delay > 0:
                time.sleep(delay)        # pacing to the trace's arrival time, not synchronisation
            send(r)

        if len(workload.requests) > MAX_OPEN_THREADS:
            raise ValueError(f"an open-loop run sends at most {MAX_OPEN_THREADS} requests "
                             f"(got {len(workload.requests)}); use a closed loop or fewer sessions")
        threads = [threading.Thread(target=at, args=(r,), daemon=True) for r in workload.requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    return [r for r in results if r is not None], wall


__all__ = ["Result", "complete", "run", "stream_completion"]
