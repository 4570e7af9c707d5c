"""``kvfabric bench serve`` at its smallest on real vLLM: vLLM alone (a), vLLM + a kvfabric pool (d), and
vLLM + Mooncake Store, the peer L2 (c').

Run as the README runs it (``python benchmarks/serve.py``, a subprocess from
the repository root, the engines in this interpreter): two sessions of the
Mooncake conversation trace, four requests, two vLLM instances behind
round-robin routing, one pool server, a 2-layer random Llama the benchmark
builds. Asserted: exit 0, every request answered, the JSON's structure, and
that the hit counts agree with each other: the pool's GET hits (its STATS)
are the chunks the connector loaded times the layers, and vLLM's own
counters (prompt tokens by source, its external prefix-cache hits) say the
same tokens were loaded. Never a speed: whether a turn finds its previous
turn's saves in the pool depends on timing, so the test asserts agreement,
not how many hits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvfabric.bench._serve_engines import engine_cpu_sets

ROOT = Path(__file__).resolve().parents[3]
LAYERS = 2
KV_HEADS = 2
BENCH_TIMEOUT_S = 1200


def _run_bench(tmp_path, configs: str) -> dict:
    """``benchmarks/serve.py`` at its smallest with ``configs``; its JSON report (exit 0 asserted)."""
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--engine-python", sys.executable,
           "--configs", configs, "--sessions", "2", "--max-requests", "4", "--loads", "1",
           "--block-tokens", "32", "--max-model-len", "1024", "--instances", "2", "--pool-servers", "1",
           "--layers", str(LAYERS), "--heads", "2", "--kv-heads", str(KV_HEADS), "--head-dim", "64", "--hidden", "128",
           "--kv-mib", "16", "--dram-mib", "64", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                  f"--- stderr\n{proc.stderr[-6000:]}")
    assert f"wrote {out}" in proc.stdout, proc.stdout[-6000:]
    return json.loads(out.read_text())


def test_serve_bench_smoke(tmp_path):
    rep = _run_bench(tmp_path, "vllm,kvfabric,mooncake")
    assert rep["workload"]["requests"] == 4 and rep["workload"]["scale"] == 32 / 512, rep["workload"]
    calib = rep["calibration"]
    # r is a measurement: no bound (and only its whole-prompt form when load swamps the prefill slope)
    assert calib["transfer_s_per_token"] > 0 and calib["r_at_max"] > 0, calib
    by = {c["config"]: c for c in rep["configs"]}
    assert set(by) == {"vllm", "kvfabric", "mooncake"}, list(by)
    split = [list(c) for c in engine_cpu_sets("split", 2)]
    for name, cfg in by.items():
        assert not cfg.get("not_runnable"), (name, cfg.get("not_runnable"))
        # by default each instance runs on its own share of the CPUs, every thread of it (engine core, OpenMP)
        assert cfg["settings"]["engine_cpus"] == split, cfg["settings"]
        assert cfg["settings"]["engine_cpus_seen"] == split, cfg["settings"]
        (run,) = cfg["runs"]
        assert run["requests"] == 4 and run["errors"] == 0, (name, run["errors_sample"])
        assert all(r["output_tokens"] >= 1 and r["ttft_s"] > 0 for r in run["results"]), run["results"]
        assert run["cpu"]["engines_s"] > 0, run["cpu"]          # the engines' process trees were found
        v = run["vllm"]
        # vLLM's prompt tokens by source add up to its prompt tokens, and the usage it answered agrees
        assert v["tokens_local_compute"] + v["tokens_local_cache_hit"] + v["tokens_external_kv_transfer"] \
            == v["prompt_tokens"] == sum(r["prompt_tokens"] for r in run["results"]), v
        assert run["cached_tokens_usage"] == v["tokens_local_cache_hit"] + v["tokens_external_kv_transfer"], run
    a, d = by["vllm"]["runs"][0], by["kvfabric"]["runs"][0]
    assert a["pool"] is None and a["vllm"]["tokens_external_kv_transfer"] == 0, a["vllm"]
    v, pool = d["vllm"], d["pool"]
    assert v["kvfabric_save_chunks"] > 0 and pool["puts"] > 0, (v, pool)       # the pool got the prompts' KV
    # every chunk the connector loaded is one GET hit per layer and KV head in the pool's STATS (layout 3),
    # and nothing else read it
    assert pool["hits"] == v["kvfabric_load_chunks"] * LAYERS * KV_HEADS, (pool, v)
    assert v["kvfabric_load_errors"] == 0, v
    # what the connector loaded is what vLLM counts as loaded by a connector and as external hits
    assert v["tokens_external_kv_transfer"] == v["kvfabric_load_tokens"] == v["external_hits"], v
    # the peer L2 (c'): vLLM's MooncakeStoreConnector over a Mooncake Store that the benchmark started on
    # loopback, the pool's 64 MiB mounted in it; it holds what the engines wrote (counted when the level
    # ended: the warm-up requests' KV at least, saved seconds before; the level's own saves are asynchronous)
    c = by["mooncake"]
    mc, v = c["runs"][0]["mooncake"], c["runs"][0]["vllm"]
    assert c["settings"]["mooncake"]["master"].startswith("127.0.0.1:"), c["settings"]
    assert mc["capacity_bytes"] == 64 << 20 and mc["keys"] > 0 and mc["allocated_bytes"] > 0, mc
    assert v["tokens_external_kv_transfer"] == v["external_hits"], v


def test_serve_bench_route_smoke(tmp_path):
    """The route configuration (g): the same four requests sent to ``kvfabric route`` in front of two
    instances. Asserted: every request answered through the router, the router counted each one and chose
    among the two instances (its /stats and /route in the JSON), the instances' KV events reached its index, and the
    same agreement of vLLM's and the pool's counters as above."""
    rep = _run_bench(tmp_path, "route")
    (cfg,) = rep["configs"]
    assert cfg["config"] == "route" and not cfg.get("not_runnable"), cfg.get("not_runnable")
    assert cfg["settings"]["policy"] == "kv", cfg["settings"]
    (run,) = cfg["runs"]
    assert run["requests"] == 4 and run["errors"] == 0, run["errors_sample"]
    route = run["route"]
    assert route["counts"]["requests"] == 4 and route["route"]["policy"] == "kv", route
    insts = route["route"]["instances"]
    assert len(insts) == 2 and sum(i["chosen"] for i in insts) == 4, insts
    # every instance's KV events were found (vLLM's /kv_event_sources: a Unix socket each, no TCP port), and
    # the blocks the engines stored (the calibration's prompts on the first one, the run's) reached the
    # router's index
    assert all(i["events"] and i["events"]["endpoint"].startswith("ipc://") for i in insts), insts
    assert sum(i["events"]["batches"] for i in insts) > 0 and sum(i["index"]["stored"] for i in insts) > 0, insts
    v, pool = run["vllm"], run["pool"]
    assert pool["hits"] == v["kvfabric_load_chunks"] * LAYERS, (pool, v)
    assert v["tokens_external_kv_transfer"] == v["kvfabric_load_tokens"] == v["external_hits"], v


def test_an_engine_whose_port_was_taken_is_started_again_with_fresh_ports(tiny_model, tmp_path, monkeypatch, capsys):
    """The benchmark picks its engines' ports free and the engine binds them seconds later; another process
    may take one in between. CI saw it: a pool server of another part took a vLLM server's port, and the
    benchmark read the pool server's binary reply to ``GET /health`` ("BadStatusLine: KVFB..."). Made to
    happen here: the first port handed out is a real ``kvfabric serve``'s. ``start`` sees another process
    listening there (never reads its reply as the engine's), starts the configuration again with fresh
    ports: the engine then answers /health, on another port, and stderr says why."""
    import urllib.request

    from kvfabric.bench import _serve_engines as se
    from kvfabric.testing.ports import free_port as really_free_port
    from kvfabric.testing.servers import start_server

    with start_server(capacity="8MiB") as squatter:
        handed: list[int] = []

        def free_port() -> int:
            handed.append(squatter.port if not handed else really_free_port())
            return handed[-1]

        monkeypatch.setattr(se, "free_port", free_port)
        opt = se.Options(python=sys.executable, model=tiny_model, instances=1, kv_bytes=16 << 20,
                         dram_bytes=64 << 20, ssd_bytes=0, ssd_dir=str(tmp_path), pool_servers=1,
                         max_model_len=1024, max_batched_tokens=1024, workdir=tmp_path, start_timeout_s=600)
        dep = se.start("vllm", opt)
        try:
            assert len(handed) == 2 and dep.urls == [f"http://127.0.0.1:{handed[1]}"], (handed, dep.urls)
            with urllib.request.urlopen(dep.urls[0] + "/health", timeout=30) as r:
                assert r.status == 200
        finally:
            dep.stop()
        assert squatter.alive, squatter.stderr_text()[-2000:]
    err = capsys.readouterr().err
    assert "a port was taken before its engine bound it" in err and "another process listens on" in err, err[-3000:]


RL_SESSIONS, RL_TURNS = 4, 4


def test_serve_bench_rl_smoke(tmp_path):
    """``--workload rl`` at its smallest (issue 27 part 4): two prompts of two samples, four turns, one weight
    update (after turn 3) on each of two generators, vLLM alone (a) and the DRAM pool (d). Asserted: every
    request answered, the update was real on every generator (its weights' fingerprint changed, to the same one
    everywhere), the connector bound the new version once per generator (``weights_updates``), no stale hit, and
    the JSON's structure. Never a speed, nor how much the pool was hit (timing)."""
    out = tmp_path / "rl.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--workload", "rl", "--engine-python", sys.executable,
           "--configs", "vllm,kvfabric", "--rl-prompts", "2", "--rl-group", "2", "--rl-turns", str(RL_TURNS),
           "--rl-update-every", "3", "--rl-system-tokens", "128", "--rl-prompt-tokens", "128", "--rl-obs-tokens", "128",
           "--rl-output-tokens", "16", "--rl-env-delay-ms", "1500", "--max-model-len", "1024", "--instances", "2",
           "--pool-servers", "1", "--layers", str(LAYERS), "--heads", "2", "--kv-heads", str(KV_HEADS),
           "--head-dim", "64", "--hidden", "128", "--kv-mib", "16", "--dram-mib", "64", "--no-progress",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                  f"--- stderr\n{proc.stderr[-6000:]}")
    rep = json.loads(out.read_text())
    assert rep["workload"] == "rl" and rep["rl"]["sessions"] == RL_SESSIONS and rep["rl"]["updates"] == 1, rep["rl"]
    by = {c["config"]: c for c in rep["configs"]}
    assert set(by) == {"vllm", "kvfabric"}, list(by)
    split = [list(c) for c in engine_cpu_sets("split", 2)]
    for name, cfg in by.items():
        assert not cfg.get("not_runnable"), (name, cfg.get("not_runnable"))
        # by default each instance runs on its own share of the CPUs, every thread of it (engine core, OpenMP)
        assert cfg["settings"]["engine_cpus"] == split, cfg["settings"]
        assert cfg["settings"]["engine_cpus_seen"] == split, cfg["settings"]
        (run,) = cfg["runs"]
        assert run["requests"] == RL_SESSIONS * RL_TURNS and run["errors"] == 0, (name, run["errors_sample"])
        res = run["results"]
        assert all(r["output_tokens"] == 16 and r["ttft_s"] > 0 for r in res), res
        # rebalanced: every turn of a session on another generator than its previous turn
        turns = {(r["session"], r["step"]): r["instance"] for r in res}
        assert all(turns[s, t] != turns[s, t - 1] for s in range(RL_SESSIONS) for t in range(1, RL_TURNS)), turns
        assert [r["version"] for r in res] == [0] * 12 + [1] * 4, [r["version"] for r in res]
        rl = run["rl"]
        (upd,) = rl["updates"]
        assert upd["after_step"] == 3 and len(upd["generators"]) == 2, upd
        # the update was real on every generator: other weights in memory, the same new ones on both
        afters = {tuple(g["after"]) for g in upd["generators"]}
        assert all(g["before"] != g["after"] for g in upd["generators"]) and len(afters) == 1, upd
        assert rl["stale_tokens"] == 0 and rl["stale_requests"] == 0, rl
        assert all(r["stale_tokens"] == 0 and r["cached_tokens"] <= r["legit_tokens"] for r in res), res
        assert rl["rollout_output_tokens_per_s"] > 0 and set(rl["weights"][0]) >= {
            "weights_updates", "weights_refused_chunks", "weights_retires"}, rl
    a, d = by["vllm"]["runs"][0]["rl"], by["kvfabric"]["runs"][0]["rl"]
    assert a["weights_updates_per_generator"] == [0, 0], a                   # no connector
    assert d["weights_updates_per_generator"] == [1, 1], d                   # one new version bound on each
    # the reset was answered although the engines sat idle past lookup_timeout_ms before the next turn
    assert [w["weights_unversioned"] for w in d["weights"]] == [0, 0], d
    (upd,) = d["updates"]
    assert all(g["bound"] == g["after"] for g in upd["generators"]), upd    # the connector measured the new weights
    assert by["kvfabric"]["runs"][0]["pool"]["puts"] > 0, by["kvfabric"]["runs"][0]["pool"]
