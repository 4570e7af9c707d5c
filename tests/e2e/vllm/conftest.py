"""Fixtures for the end-to-end tests on real vLLM (run in .venvs/vllm: scripts/ci-vllm.sh).

Every engine runs in its own process (``engine_run.py``), so "a second,
independently started engine" really is one. The tiny model is built once
per session in a temporary directory (no download). The cold reference is
one engine without the connector over every prompt of the suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kvfabric.testing.ports import free_port, http_ready  # noqa: F401 (free_port: for the tests)
from kvfabric_vllm.tinymodel import build_tiny_llama, random_prompt

if importlib.util.find_spec("vllm") is None:   # not the vLLM virtualenv: nothing to run here
    collect_ignore_glob = ["test_*.py"]

HERE = Path(__file__).parent
# The connector's default chunk: vLLM's CPU block size (issue 13: at most one partial
# block recomputed; every pool object is one KV page, loaded in place).
CHUNK = 128
LAYERS = 4          # the tiny Llama's layers
KV_HEADS = 2        # ... and KV heads
PARTS = LAYERS * KV_HEADS   # pool objects per chunk: one per (layer, KV head), layout 3 (layout.py)
PROMPT_TOKENS = 1500
# whole chunks that can be loaded: the last prompt token is always computed
LOADABLE = (PROMPT_TOKENS - 1) // CHUNK * CHUNK
PROMPTS = {name: random_prompt(PROMPT_TOKENS, seed=seed) for seed, name in
           enumerate(["single", "spread", "killed", "down", "mp_new", "openai", "corrupt"], start=11)}
# Prompts whose chunks must land on both of two servers: server ports (and so
# rendezvous owners) change every run, so use 15 loadable chunks, where "all
# on one server" has probability 2**-14, not 5 chunks (2**-4).
LONG_TOKENS = 4000
LONG_LOADABLE = (LONG_TOKENS - 1) // CHUNK * CHUNK
PROMPTS["spread"] = random_prompt(LONG_TOKENS, seed=12)
PROMPTS["killed"] = random_prompt(LONG_TOKENS, seed=13)
# Regression tests of the connector's defects (test_connector_fixes.py): "salt" is one
# 1500-token prompt run unsalted and salted; the "busy_*" prompts run together in an
# engine with a small KV cache, so requests wait for blocks and get preempted.
PROMPTS["salt"] = random_prompt(PROMPT_TOKENS, seed=18)
BUSY_TOKENS = 700
BUSY_LOADABLE = (BUSY_TOKENS - 1) // CHUNK * CHUNK
for _seed, _name in enumerate(["busy_a", "busy_b", "busy_c", "busy_d"], start=19):
    PROMPTS[_name] = random_prompt(BUSY_TOKENS, seed=_seed)
# PD (test_pd.py): one prompt streamed through the PD proxy
PROMPTS["pd_stream"] = random_prompt(PROMPT_TOKENS, seed=23)
# RL (test_rl.py): one prompt run before and after a weight update; an agent's two turns (turn 2
# extends turn 1, as a next turn's prompt extends the previous one)
PROMPTS["rl"] = random_prompt(PROMPT_TOKENS, seed=24)
PROMPTS["turn1"] = random_prompt(PROMPT_TOKENS, seed=25)
PROMPTS["turn2"] = PROMPTS["turn1"] + random_prompt(300, seed=26)
# the load guard (test_load_guard.py): one prompt served by a slow pool (short: each held
# reply costs more per token), one by a fast one
GUARD_SLOW_TOKENS = 300
PROMPTS["guard_slow"] = random_prompt(GUARD_SLOW_TOKENS, seed=27)
PROMPTS["guard_fast"] = random_prompt(PROMPT_TOKENS, seed=28)
ENGINE_TIMEOUT_S = 420
TEST_TIMEOUT_S = 1200   # several engine starts per test on a loaded 2-core machine


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.vllm)
        item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


class EngineRunner:
    """Runs ``engine_run.py`` in a fresh process and returns its result dict."""

    def __init__(self, model: str, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.n = 0

    def __call__(self, names: list[str], servers: list[str] | None = None, *, mp: bool = False,
                 max_tokens: int = 12, between=None, role: str = "kv_both", salts: list[str | None] | None = None,
                 args: list[str] = ()) -> dict:
        """Run the prompts in one engine; ``between(i)`` runs (in the test) before prompt ``i >= 1``.

        ``salts[i]`` is prompt ``i``'s vLLM ``cache_salt``; ``args`` go to ``engine_run.py``.
        The result's ``stdout`` holds the engine's own output (vLLM logs there)."""
        self.n += 1
        prompts = self.workdir / f"prompts{self.n}.json"
        out = self.workdir / f"result{self.n}.json"
        salts = salts or [None] * len(names)
        prompts.write_text(json.dumps([PROMPTS[n] if s is None else {"tokens": PROMPTS[n], "cache_salt": s}
                                       for n, s in zip(names, salts)]))
        cmd = [sys.executable, str(HERE / "engine_run.py"), "--model", self.model, "--prompts", str(prompts),
               "--out", str(out), "--chunk-tokens", str(CHUNK), "--max-tokens", str(max_tokens), "--role", role,
               *args]
        if servers:
            cmd += ["--servers", ",".join(servers)]
        if mp:
            cmd.append("--mp")
        if between is not None:
            cmd.append("--pause")
        env = dict(os.environ, PYTHONHASHSEED=str(self.n))  # engines must not depend on it
        stdout: list[str] = []
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env)
            try:
                for line in proc.stdout:        # vLLM's own stdout lines are kept, not interpreted
                    stdout.append(line)
                    if line.startswith("KVF-PAUSE "):
                        between(int(line.split()[1]))
                        proc.stdin.write("\n")
                        proc.stdin.flush()
                rc = proc.wait(ENGINE_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            err.seek(0)
            log = err.read()
        if rc != 0:
            raise AssertionError(f"engine failed ({rc}):\n{log[-6000:]}")
        result = json.loads(out.read_text())
        result["log"] = log
        result["stdout"] = "".join(stdout)
        return dict(result, by_name=dict(zip(names, zip(result["outputs"], result["cached"]))))


@pytest.fixture(scope="session")
def run_engine(tiny_model, tmp_path_factory) -> EngineRunner:
    return EngineRunner(tiny_model, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def cold(run_engine, tiny_model) -> dict[str, list[int]]:
    """Greedy outputs of an engine without any connector, per prompt name.

    ``KVF_E2E_COLD_CACHE=FILE`` keeps them in FILE between pytest runs (keyed by the
    prompts and the tiny model's weights fingerprint): for targeted re-runs on a
    shared machine; CI leaves it unset."""
    import hashlib

    from kvfabric_vllm.config import weights_fingerprint

    names = list(PROMPTS)
    cache = os.environ.get("KVF_E2E_COLD_CACHE")
    key = hashlib.sha256(json.dumps([PROMPTS, weights_fingerprint(tiny_model)]).encode()).hexdigest()
    if cache and os.path.exists(cache):
        saved = json.loads(Path(cache).read_text())
        if saved.get("key") == key:
            return saved["cold"]
    res = run_engine(names)
    assert res["cached"] == [0] * len(names)
    out = {n: o for n, o in zip(names, res["outputs"])}
    if cache:
        Path(cache).write_text(json.dumps({"key": key, "cold": out}))
    return out


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout_s: float = ENGINE_TIMEOUT_S) -> None:
    """Wait until the OpenAI server ``proc`` at ``url`` answers /health on a port it listens on itself (its
    log, an open file, is shown if it exits first; another process listening there fails at once, never
    read as the engine's answer); generous for a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"{url} exited {proc.returncode}:\n{log.read()[-6000:]}")
        if http_ready(url, proc.pid, timeout_s=2):      # PortTaken: another process listens there
            return
        time.sleep(1.0)
    raise AssertionError(f"{url} did not become healthy")


def load_pd_example():
    """``examples/pd/run.py`` as a module (its ``start_vllm``, ``start_proxy``, ``complete``)."""
    spec = importlib.util.spec_from_file_location("kvfabric_pd_example_run", HERE.parents[2] / "examples" / "pd" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def post_json(url: str, body: dict, timeout_s: float) -> dict:
    """POST ``body`` as JSON to an OpenAI server and return its JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def scrape_metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """An OpenAI server's /metrics read with prometheus_client's parser: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_total(samples: dict[tuple[str, frozenset], float], name: str) -> float:
    """Sum of one sample name over its label sets; 0 when absent."""
    return sum(v for (n, _), v in samples.items() if n == name)
