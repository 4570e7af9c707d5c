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
from pathlib import Path

import pytest

from kvfabric_vllm.tinymodel import build_tiny_llama, random_prompt

if importlib.util.find_spec("vllm") is None:   # not the vLLM virtualenv: nothing to run here
    collect_ignore_glob = ["test_*.py"]

HERE = Path(__file__).parent
CHUNK = 256
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
                 max_tokens: int = 12, between=None, role: str = "kv_both") -> dict:
        """Run the prompts in one engine; ``between(i)`` runs (in the test) before prompt ``i >= 1``."""
        self.n += 1
        prompts = self.workdir / f"prompts{self.n}.json"
        out = self.workdir / f"result{self.n}.json"
        prompts.write_text(json.dumps([PROMPTS[n] for n in names]))
        cmd = [sys.executable, str(HERE / "engine_run.py"), "--model", self.model, "--prompts", str(prompts),
               "--out", str(out), "--chunk-tokens", str(CHUNK), "--max-tokens", str(max_tokens), "--role", role]
        if servers:
            cmd += ["--servers", ",".join(servers)]
        if mp:
            cmd.append("--mp")
        if between is not None:
            cmd.append("--pause")
        env = dict(os.environ, PYTHONHASHSEED=str(self.n))  # engines must not depend on it
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env)
            try:
                for line in proc.stdout:        # vLLM's own stdout lines are skipped
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
        return dict(result, by_name=dict(zip(names, zip(result["outputs"], result["cached"]))))


@pytest.fixture(scope="session")
def run_engine(tiny_model, tmp_path_factory) -> EngineRunner:
    return EngineRunner(tiny_model, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def cold(run_engine) -> dict[str, list[int]]:
    """Greedy outputs of an engine without any connector, per prompt name."""
    names = list(PROMPTS)
    res = run_engine(names)
    assert res["cached"] == [0] * len(names)
    return {n: out for n, out in zip(names, res["outputs"])}
