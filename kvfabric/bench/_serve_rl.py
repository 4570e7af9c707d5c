"""The serving benchmark's RL rollout workload (``--workload rl``; issue 27 part 4).

What an RL post-training loop asks of its generators, on the same deployments
as the trace workload (``_serve_engines``):

* **groups**: ``prompts`` tasks, each sampled ``group`` times (GRPO-style); the
  ``group`` sessions of a task share its first prompt (a system prompt shared by
  every task, then the task's own tokens), sampled at ``temperature``, so their
  answers differ. Unseeded: vLLM 0.32's CPU build kills the engine core on a
  request with its own ``seed`` whose prefill is split over steps (its
  ``_bookkeeping_sync`` calls ``set_offset`` on a CPU generator: "CPU Generator
  does not use offset"), so answers differ between runs and configurations
  (their lengths do not: ``ignore_eos``);
* **multi-turn agent sessions**: turn ``t + 1``'s prompt is turn ``t``'s prompt,
  the answer the engine returned (its token ids) and an observation of
  ``obs_tokens`` from the "environment";
* **steps**: one step is one turn of every session, all sent at once; the next
  step starts once every answer is in and ``env_delay_s`` has passed (the
  environment); the engines' own KV cache (``--kv-mib``) is sized so that it
  cannot hold every session's context, so what a session left on an engine is
  evicted by the others' turns;
* **rebalanced**: turn ``t`` of session ``s`` goes to generator ``(s + t) mod
  n``: each turn lands on another generator than the previous one (n >= 2);
* **weight updates**: after every ``update_every`` steps (never after the
  last), with no request in flight, every generator gets other weights in
  memory over HTTP (below); update ``k`` loads the ``k``-th other random
  model of the same architecture, the same on every generator.

**The update over HTTP.** vLLM 0.32's OpenAI server exposes, with
``VLLM_SERVER_DEV_MODE=1``, ``POST /collective_rpc`` (a worker method named by
a string, string arguments only) and ``POST /reset_prefix_cache?
reset_external=true`` (vLLM's reset, the connector's too). ``reload_weights``
(``{"kwargs": {"weights_path": DIR}}``) is vLLM's own worker method: it loads
DIR's checkpoint into the running model in place. The connector's
``refresh_weights_version`` is a function the driver runs on the workers; the
endpoint cannot send a function, so the engines start with
``--worker-extension-cls kvfabric_vllm.weights.KVFabricWorkerExtension``,
which gives it a name (and ``kvfabric_weights_fingerprint``, a measurement
that binds nothing, answered by every configuration). Per generator, per
update: ``reload_weights``, then (pool configurations that version)
``refresh_weights_version``, then the reset with ``reset_external=true``.
Before the run every pool configuration that versions gets one
``refresh_weights_version`` (the workers are given the model). The control
configuration ``kvfabric-unversioned`` reloads and resets vLLM's cache alone,
as a driver that does not know about the connector would: the connector keeps
the files' key namespace and serves the old weights' KV.

**Stale hits**, measured from outside the engines: every request is tagged
with the weights version it ran under (the updates happen between steps).
Its legitimate reuse is the longest prefix its prompt shares with any token
sequence (a prompt and its answer) of a request of the *same* version sent
before its first token came back; anything vLLM reports cached beyond that
(``cached_tokens`` of its usage: local prefix-cache hits and connector loads)
can only have come from KV computed under other weights: ``stale_tokens``. It
counts what a stale load would add *beyond* what the same version could have
provided (a stale chunk that a same-version request also computed is not
seen), and the workload makes that the common case of staleness: the first
turn after an update carries a whole history computed only under the old
weights. The control configuration shows the detector firing. The
connector's own ``weights_refused_chunks`` (loads or saves planned under
other weights than a worker holds, refused) and ``weights_updates`` (per
generator) are reported beside it.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ._serve_load import REQUEST_TIMEOUT_S, Result, stream_completion
from ._serve_workload import VOCAB_LO

EXTENSION = "kvfabric_vllm.weights.KVFabricWorkerExtension"
# configurations whose driver tells the connector about each update (refresh + reset with the connector's)
VERSIONED = ("kvfabric", "kvfabric-retire")
RPC_TIMEOUT_S = 600.0
RESET_TRIES = 20


@dataclass(frozen=True)
class RLSpec:
    """The workload's sizes (tokens) and schedule."""

    prompts: int = 4
    group: int = 4
    turns: int = 4
    update_every: int = 2
    system_tokens: int = 256
    prompt_tokens: int = 384
    obs_tokens: int = 128
    output_tokens: int = 64
    env_delay_s: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompts, self.group, self.turns, self.update_every, self.output_tokens) < 1 or \
                min(self.system_tokens, self.prompt_tokens, self.obs_tokens) < 0 or self.env_delay_s < 0:
            raise ValueError(f"RL workload: sizes must be positive (got {self})")

    @property
    def sessions(self) -> int:
        return self.prompts * self.group

    @property
    def updates(self) -> int:
        """Weight updates in a run: after steps K, 2K, ... before the last step."""
        return (self.turns - 1) // self.update_every

    @property
    def max_context(self) -> int:
        return self.system_tokens + self.prompt_tokens + self.turns * (self.obs_tokens + self.output_tokens)

    def describe(self) -> dict[str, Any]:
        return {**self.__dict__, "sessions": self.sessions, "steps": self.turns, "updates": self.updates,
                "requests": self.sessions * self.turns,
                "output_tokens": self.sessions * self.turns * self.output_tokens,
                "max_context_tokens": self.max_context}


def _ids(n: int, vocab: int, *tag: int) -> list[int]:
    rng = random.Random("rl:" + ":".join(map(str, tag)))
    return [rng.randrange(VOCAB_LO, vocab - VOCAB_LO) for _ in range(n)]


@dataclass
class RLResult(Result):
    """A request of the RL workload: its step, turn and weights version, and the stale-hit measure."""

    step: int = 0
    version: int = 0
    legit_tokens: int = 0       # longest prefix shared with a same-version sequence sent before its first token
    stale_tokens: int = 0       # cached_tokens beyond legit_tokens
    first_token_s: float = 0.0  # from the start of the run


@dataclass
class _Seq:
    who: tuple[int, int]         # (step, session)
    version: int
    sent_s: float
    tokens: list[int]            # prompt + answer


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _post(url: str, path: str, body: dict | None = None, timeout_s: float = RPC_TIMEOUT_S) -> Any:
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def rpc(url: str, method: str, **kwargs: str) -> list:
    """``POST /collective_rpc``: ``method`` on every worker of the server at ``url``; their results."""
    out = _post(url, "/collective_rpc", {"method": method, "kwargs": kwargs, "timeout": RPC_TIMEOUT_S})
    return (out or {}).get("results", [])


def reset_prefix_cache(url: str, external: bool) -> None:
    """vLLM's prefix-cache reset (and the connector's when ``external``); retried while vLLM answers
    ``success: false`` (blocks still held), RuntimeError if it never succeeds."""
    q = "?" + urllib.parse.urlencode({"reset_external": str(external).lower()})
    for _ in range(RESET_TRIES):
        if (_post(url, "/reset_prefix_cache" + q) or {}).get("success"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: reset_prefix_cache kept failing")


def update_weights(urls: list[str], weights_dir: str, config: str) -> dict[str, Any]:
    """Every generator gets ``weights_dir``'s weights in memory (module docstring), all in parallel; what each
    did: fingerprints before and after (``kvfabric_weights_fingerprint``), the connector's fingerprints, seconds."""
    def one(url: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        before = rpc(url, "kvfabric_weights_fingerprint")
        rpc(url, "reload_weights", weights_path=weights_dir)
        bound = rpc(url, "refresh_weights_version") if config in VERSIONED else None
        reset_prefix_cache(url, external=config != "kvfabric-unversioned")
        after = rpc(url, "kvfabric_weights_fingerprint")
        return {"url": url, "before": before, "after": after, "bound": bound, "s": time.perf_counter() - t0}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(urls)) as ex:
        per = list(ex.map(one, urls))
    return {"weights": weights_dir, "generators": per, "s": time.perf_counter() - t0}


def prepare(urls: list[str], config: str) -> list:
    """Before the run: the workers of a versioning configuration are given the model (their first
    ``refresh_weights_version``); every generator's fingerprint."""
    if config in VERSIONED:
        for u in urls:
            rpc(u, "refresh_weights_version")
    return [rpc(u, "kvfabric_weights_fingerprint") for u in urls]


@dataclass
class RLRun:
    results: list[RLResult]
    wall_s: float
    generate_s: float                 # the steps' own time (no environment delay, no update)
    updates: list[dict] = field(default_factory=list)


def run_rl(spec: RLSpec, urls: list[str], config: str, vocab: int, weights_dirs: list[str],
           on_done=lambda r: None) -> RLRun:
    """The workload against ``urls`` (module docstring); ``weights_dirs[k]`` is update ``k``'s model."""
    if len(weights_dirs) < spec.updates:
        raise ValueError(f"{spec.updates} updates need as many weight directories (got {len(weights_dirs)})")
    n = len(urls)
    system = _ids(spec.system_tokens, vocab, spec.seed, -1)
    history = [system + _ids(spec.prompt_tokens, vocab, spec.seed, s // spec.group) for s in range(spec.sessions)]
    seqs: list[_Seq] = []
    results: list[RLResult] = []
    updates: list[dict] = []
    lock = threading.Lock()
    t_start = time.perf_counter()
    generate_s = 0.0
    version = 0
    for step in range(spec.turns):
        if step:
            if step % spec.update_every == 0:
                version += 1
                updates.append({"after_step": step, **update_weights(urls, weights_dirs[version - 1], config)})
            time.sleep(spec.env_delay_s)     # the environment answers the previous turn
            for s in range(spec.sessions):
                history[s] = history[s] + _ids(spec.obs_tokens, vocab, spec.seed, s, step)
        prompts = [list(h) for h in history]
        step_results: list[RLResult | None] = [None] * spec.sessions
        answers: list[list[int]] = [[] for _ in range(spec.sessions)]

        def send(s: int, step=step, prompts=prompts, step_results=step_results, answers=answers,
                 version=version) -> None:
            inst = (s + step) % n
            res = RLResult(len(results) + s, s, inst, time.perf_counter() - t_start, step=step, version=version)
            body = {"model": "tiny", "prompt": prompts[s], "max_tokens": spec.output_tokens, "ignore_eos": True,
                    "temperature": spec.temperature, "return_token_ids": True}   # no per-request seed: module docstring
            try:
                ttft, e2e, usage, ids = stream_completion(urls[inst], body, REQUEST_TIMEOUT_S)
                res.ttft_s, res.e2e_s = ttft, e2e
                res.first_token_s = res.sent_s + ttft
                res.prompt_tokens = usage.get("prompt_tokens", 0)
                res.output_tokens = usage.get("completion_tokens", 0)
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                answers[s] = ids
            except Exception as e:   # recorded and counted in the report, never retried
                res.error = f"{type(e).__name__}: {e}"[:500]
            with lock:
                step_results[s] = res
            on_done(res)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=send, args=(s,), daemon=True) for s in range(spec.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        generate_s += time.perf_counter() - t0
        done = [r for r in step_results if r is not None]
        for s in range(spec.sessions):
            sent = step_results[s].sent_s if step_results[s] else 0.0
            seqs.append(_Seq((step, s), version, sent, prompts[s] + answers[s]))
        _measure_stale(done, prompts, seqs)
        results.extend(done)
        for s in range(spec.sessions):
            history[s] = prompts[s] + answers[s]
    return RLRun(results, time.perf_counter() - t_start, generate_s, updates)


def _measure_stale(done: list[RLResult], prompts: list[list[int]], seqs: list[_Seq]) -> None:
    """Set ``legit_tokens`` / ``stale_tokens`` of one step's results (module docstring); ``seqs`` holds every
    sequence sent so far, this step's included (a request's own is skipped)."""
    for r in done:
        if r.error:
            continue
        prompt = prompts[r.session]
        legit = 0
        for q in seqs:
            if q.version != r.version or q.who == (r.step, r.session) or q.sent_s >= r.first_token_s:
                continue
            legit = max(legit, _common(prompt, q.tokens))
            if legit >= len(prompt):
                break
        r.legit_tokens = legit
        r.stale_tokens = max(0, r.cached_tokens - legit)


WEIGHTS_COUNTERS = ("weights_updates", "weights_refused_chunks", "weights_retires", "weights_retire_errors",
                    "weights_unversioned")


def weights_counters(urls: list[str]) -> list[dict[str, float]]:
    """Per generator, the connector's ``vllm:kvfabric_weights_*`` counters (all 0 without the connector)."""
    from ._serve_report import scrape

    out = []
    for url in urls:
        got = dict.fromkeys(WEIGHTS_COUNTERS, 0.0)
        for (name, _), v in scrape(url).items():
            short = name.removeprefix("vllm:kvfabric_").removesuffix("_total")
            if name.startswith("vllm:kvfabric_") and name.endswith("_total") and short in got:
                got[short] += v
        out.append(got)
    return out


def rl_figures(run: RLRun, before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    """The RL figures of one run: rollout throughput over the steps' own time, stale hits, per-generator
    weight counters (deltas), the updates."""
    ok = [r for r in run.results if not r.error]
    out_tokens = sum(r.output_tokens for r in ok)
    per = [{k: a[k] - b.get(k, 0.0) for k in a} for b, a in zip(before, after)]
    after_update = [r for r in ok if r.version and r.step == min((x.step for x in ok if x.version == r.version),
                                                                   default=-1)]
    return {"rollout_output_tokens_per_s": out_tokens / run.generate_s if run.generate_s > 0 else 0.0,
            "generate_s": run.generate_s, "wall_s": run.wall_s,
            "stale_tokens": sum(r.stale_tokens for r in ok),
            "stale_requests": sum(1 for r in ok if r.stale_tokens),
            "cached_tokens_first_turn_after_update": sum(r.cached_tokens for r in after_update),
            "legit_tokens_first_turn_after_update": sum(r.legit_tokens for r in after_update),
            "weights": per,
            "weights_updates_per_generator": [p["weights_updates"] for p in per],
            "weights_refused_chunks": sum(p["weights_refused_chunks"] for p in per),
            "updates": run.updates, "update_s": sum(u["s"] for u in run.updates)}


def print_rl(report: dict[str, Any], out=None) -> None:
    """One line per configuration: the RL figures beside the serve table."""
    import sys

    out = out or sys.stdout
    hdr = (f"{'configuration':<44} {'rollout tok/s':>13} {'TTFT p50':>9} {'p99':>8} {'vLLM hit':>8} "
           f"{'loaded':>7} {'pool hit':>8} {'upd/gen':>9} {'refused':>7} {'stale tok':>9} {'stale req':>9}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for cfg in report["configs"]:
        for run in cfg.get("runs", []):
            rl = run["rl"]
            hit, loaded = run["vllm_prefix_hit_rate"], run["prefill_loaded_fraction"]
            print(f"{cfg['label']:<44} {rl['rollout_output_tokens_per_s']:>13.1f} "
                  f"{run['ttft_ms_p50'] or 0:>9.0f} {run['ttft_ms_p99'] or 0:>8.0f} "
                  f"{'-' if hit is None else format(hit, '.1%'):>8} "
                  f"{'-' if loaded is None else format(loaded, '.1%'):>7} "
                  f"{'-' if run['pool_get_hit_rate'] is None else format(run['pool_get_hit_rate'], '.1%'):>8} "
                  f"{'/'.join(f'{x:g}' for x in rl['weights_updates_per_generator']):>9} "
                  f"{rl['weights_refused_chunks']:>7g} {rl['stale_tokens']:>9} {rl['stale_requests']:>9}", file=out)
    print("rollout tok/s: output tokens over the steps' own time (no environment delay, no update); upd/gen: the "
          "connector's weights_updates per generator; refused: its weights_refused_chunks; stale tok / req: prompt "
          "tokens vLLM reported cached beyond the longest prefix shared with a same-version request sent before "
          "(must be 0; the control row shows the detector)", file=out)


__all__ = ["EXTENSION", "RLRun", "RLResult", "RLSpec", "VERSIONED", "prepare", "print_rl", "rl_figures", "rpc",
           "run_rl", "update_weights", "weights_counters"]
