"""One short replay against real pool servers: levels consistent, simulator agrees request by request."""

from __future__ import annotations

import json

from kvfabric.bench.ragtrace import RagConfig, generate
from kvfabric.bench.replay import ReplayOptions, main, run_replay
from kvfabric.bench.traces import load_trace
from kvfabric.testing.servers import start_pool


def test_replay_matches_simulator_and_levels_are_ordered():
    trace = load_trace("mooncake-synthetic", limit=300)
    opt = ReplayOptions(shards=2, capacity=0.1, policies=["lru", "prefix-lfu"], progress=False)
    rep = run_replay(trace, opt)
    assert [r["policy"] for r in rep["runs"]] == ["lru", "prefix-lfu"]
    assert rep["belady"]["hit_blocks"] <= rep["infinite"]["hit_blocks"]
    for run in rep["runs"]:
        lv = run["levels"]
        # The real servers did exactly what the offline model says, request by request.
        assert run["sim"]["requests_differing"] == 0
        assert lv["exists"]["hit_blocks"] > 0
        assert lv["exists"]["hit_blocks"] <= rep["belady"]["hit_blocks"]
        # Nothing was corrupted or late on loopback with a generous deadline.
        assert lv["loaded"]["hit_blocks"] == lv["exists"]["hit_blocks"]
        assert run["bytes"]["corrupt_blocks"] == 0
        assert lv["useful"]["hit_blocks"] <= lv["loaded"]["hit_blocks"]
        assert run["bytes"]["get_bytes"] == lv["exists"]["hit_blocks"] * rep["block_bytes"]
        assert run["bytes"]["puts_dropped"] == 0
        for s in run["servers"].values():
            assert s["policy"] == run["policy"]
            assert s["objects"] <= run["blocks_per_shard"]
    assert rep["runs"][0]["gap_closed"] == 0.0


def test_replay_cli_against_running_servers(tmp_path, capsys):
    trace = generate(RagConfig(requests=150, seed=5))
    path = tmp_path / "rag.jsonl"
    from kvfabric.bench.traces import write_trace

    write_trace(path, trace.requests, trace.block_tokens)
    with start_pool(2, capacity="4MiB", policy="tail-lru") as pool:
        out = tmp_path / "r.json"
        rc = main([str(path), "--servers", ",".join(pool.addresses), "--json", str(out), "--no-progress"])
        assert rc == 0
    rep = json.loads(out.read_text())
    (run,) = rep["runs"]
    assert run["policy"] == "tail-lru" and run["shards"] == 2
    assert run["levels"]["exists"]["total_blocks"] == trace.total_blocks
    assert run["levels"]["loaded"]["hit_blocks"] == run["levels"]["exists"]["hit_blocks"] > 0
    assert "exists" in capsys.readouterr().out


def test_replay_cli_rejects_bad_arguments(capsys):
    assert main(["mooncake-synthetic", "--capacity", "-1", "--no-progress"]) == 2
    assert main(["/nonexistent/trace.jsonl"]) == 2
    assert "no trace file" in capsys.readouterr().err


def test_rag_main_job_small(tmp_path, capsys):
    from kvfabric.bench.rag import main as rag_main

    rc = rag_main(["--requests", "200", "--capacity", "0.2", "--capacities", "0.05,0.2", "--policies", "lru,tail-lru",
                   "--no-progress", "--out-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "exists" in out and "belady" in out
    # one weighting: tokens; the workload beside the headline; the real RAG figure; no empty chunk columns
    assert "block-level" not in out and "(prefix hits, token-weighted)" in out, out
    assert "headline: rag-seed0, lru at 20% capacity" in out and "are follow-up turns" in out, out
    assert "2 tenant(s) x 3 system template(s)" in out and "real RAG for comparison: MuSiQue" in out, out
    from kvfabric.bench.rag import CHUNK_HOWTO
    assert CHUNK_HOWTO in out and "prefix+chunk pool" not in out, out
    result = json.loads((tmp_path / "rag.json").read_text())
    assert result["workload"]["requests"] == 200 and 0 < result["workload"]["followups"] < 200, result["workload"]
    (rep,) = result["replays"]
    assert [r["policy"] for r in rep["runs"]] == ["lru", "tail-lru"]
    assert all(r["sim"]["requests_differing"] == 0 for r in rep["runs"])
    point = next(p for p in result["points"] if p["capacity_fraction"] == 0.2)
    for pol in ("lru", "tail-lru"):  # the real point at 20% equals the simulated curve's when sharding agrees
        assert point["real"][pol]["levels"]["exists"]["total_blocks"] == result["total_blocks"]
    assert (tmp_path / "rag.png").stat().st_size > 1000
    assert len(load_trace(tmp_path / "rag-trace.jsonl")) == 200


def test_sweep_cli_small(tmp_path, capsys):
    from kvfabric.bench.sweep import main as sweep_main

    rc = sweep_main(["mooncake-synthetic", "--limit", "150", "--capacities", "0.1,0.5", "--real", "none",
                     "--policies", "lru,s3fifo", "--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "s.png"),
                     "--no-progress"])
    assert rc == 0
    res = json.loads((tmp_path / "s.json").read_text())["results"][0]
    for p in res["points"]:
        assert p["sim"]["lru"]["block_hit_rate"] <= p["belady"] <= p["infinite"]
        assert p["reuse_oracle"] <= p["belady"]
    assert (tmp_path / "s.png").exists()
    assert sweep_main(["--policies", "nope"]) == 2


# --- issue 15: chunk key mode, streaming GETs, transport kept apart, dead servers, the real dataset -------------


def test_chunk_mode_replay_matches_simulator_and_streams_gets_one_block_at_a_time():
    trace = load_trace("musique-b256").head(60)
    opt = ReplayOptions(shards=2, capacity=0.05, policies=["lru", "s3fifo"], progress=False, key_mode="chunk",
                        get_window_bytes=1)  # a one-block window: every GET is streamed block by block
    rep = run_replay(trace, opt)
    assert rep["key_mode"] == "chunk"
    ref = rep["chunk_reference"]
    for run in rep["runs"]:
        assert run["sim"]["requests_differing"] == 0 and run["sim"]["chunk_agrees"]
        lv, cl = run["levels"], run["chunk_levels"]
        assert cl["exists"]["hit_tokens"] > 0
        assert cl["loaded"]["hit_blocks"] == cl["exists"]["hit_blocks"]
        assert lv["loaded"]["hit_blocks"] == lv["exists"]["hit_blocks"]
        assert run["bytes"]["corrupt_blocks"] == 0 and run["bytes"]["puts_dropped"] == 0
        # Prefix and chunk hits are disjoint tokens; together never more than an unbounded pool reuses.
        assert (lv["exists"]["hit_tokens"] + cl["exists"]["hit_tokens"]
                <= ref["infinite"]["prefix"]["hit_tokens"] + ref["infinite"]["chunk"]["hit_tokens"])
        assert run["bytes"]["get_bytes"] == (lv["exists"]["hit_blocks"] + cl["exists"]["hit_blocks"]) * rep["block_bytes"]


def test_missed_get_deadlines_do_not_change_the_policys_exists_level():
    trace = load_trace("mooncake-synthetic", limit=200)
    # A deadline no GET can meet: the data client marks shards down, the control client does not.
    opt = ReplayOptions(shards=2, capacity=0.1, policies=["lru"], progress=False, deadline_ms=0.001)
    (run,) = run_replay(trace, opt)["runs"]
    assert run["levels"]["exists"]["hit_blocks"] > 0
    assert run["sim"]["requests_differing"] == 0
    assert run["levels"]["loaded"]["hit_blocks"] < run["levels"]["exists"]["hit_blocks"]
    assert run["bytes"]["late_or_missing_blocks"] > 0
    assert run["bytes"]["puts_dropped"] == 0
    assert not any(run["transport"]["control"].values())


def test_replay_refuses_dead_and_malformed_servers(capsys):
    assert main(["mooncake-synthetic", "--limit", "20", "--servers", "127.0.0.1:1", "--no-progress"]) == 1
    assert "do not answer STATS" in capsys.readouterr().err
    for bad in ("garbage", "127.0.0.1:0", "host:port", ":80"):
        assert main(["mooncake-synthetic", "--limit", "20", "--servers", bad, "--no-progress"]) == 2
        assert "host:port" in capsys.readouterr().err
    assert main(["mooncake-synthetic", "--limit", "20", "--key-mode", "chunk", "--no-progress"]) == 2
    assert "needs a trace with chunks" in capsys.readouterr().err


def test_rag_dataset_prints_prefix_and_chunk_levels_side_by_side(tmp_path, capsys):
    from kvfabric.bench.rag import main as rag_main
    from kvfabric.bench.replay_report import CHUNK_DEFINITION, PREFIX_DEFINITION

    rc = rag_main(["--dataset", "musique", "--limit", "60", "--capacity", "0.5", "--capacities", "0.1,0.5",
                   "--policies", "lru", "--no-progress", "--out-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert PREFIX_DEFINITION in out and CHUNK_DEFINITION in out
    assert "prefix+chunk pool" in out
    doc = json.loads((tmp_path / "rag.json").read_text())
    assert doc["dataset"] == "musique" and set(doc["modes"]) == {"prefix", "chunk"}
    chunk_point = next(p for p in doc["modes"]["chunk"]["points"] if p["capacity_fraction"] == 0.5)
    real = chunk_point["real"]["lru"]
    assert real["sim"]["requests_differing"] == 0 and real["sim"]["chunk_agrees"]
    assert real["chunk_levels"]["exists"]["hit_tokens"] > 0
    assert (tmp_path / "rag.png").stat().st_size > 1000
    assert not (tmp_path / "rag-trace.jsonl").exists()  # the dataset is bundled, nothing generated
    assert rag_main(["--dataset", "musique", "--block-tokens", "64"]) == 2


def test_sharding_spread_is_reported_for_multi_shard_replays(capsys):
    from kvfabric.bench.replay_report import print_report

    trace = load_trace("mooncake-synthetic", limit=150)
    rep = run_replay(trace, ReplayOptions(shards=2, capacity=0.1, policies=["lru"], progress=False, spread=3))
    (run,) = rep["runs"]
    sp = run["sharding_spread"]
    assert sp["server_id_sets"] == 3
    lo, hi = sp["block_hit_rate"]
    assert 0 < lo <= hi <= rep["belady"]["block_hit_rate"]
    print_report(rep)
    assert "sharding spread" in capsys.readouterr().out
    one = run_replay(trace, ReplayOptions(shards=1, capacity=0.1, policies=["lru"], progress=False, spread=3))
    assert "sharding_spread" not in one["runs"][0]  # one shard: nothing to spread


def test_rag_generator_in_both_key_modes(tmp_path, capsys):
    from kvfabric.bench.rag import main as rag_main

    rc = rag_main(["--requests", "150", "--key-mode", "both", "--capacity", "0.2", "--capacities", "0.2",
                   "--policies", "lru", "--no-progress", "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "rag.json").read_text())
    assert set(doc["modes"]) == {"prefix", "chunk"} and doc["generator"]["requests"] == 150
    (run,) = doc["modes"]["chunk"]["replays"][0]["runs"]
    assert run["sim"]["requests_differing"] == 0 and run["sim"]["chunk_agrees"]
    assert "chunk  = passage tokens past the prefix hit" in capsys.readouterr().out
    # The generator alone defaults to the prefix mode (its 3000 requests take minutes in both here).
    assert rag_main(["--requests", "60", "--capacities", "0.2", "--policies", "lru", "--no-progress",
                     "--out-dir", str(tmp_path / "p")]) == 0
    assert set(json.loads((tmp_path / "p" / "rag.json").read_text())["modes"]) == {"prefix"}


def test_rag_defines_its_levels_and_models_the_real_kv_size(tmp_path, capsys):
    """The main job says what each level means, and its useful level counts the real KV size's transfer:
    over a slow modelled link no load beats recompute, so useful drops below loaded."""
    from kvfabric.bench.rag import main as rag_main
    from kvfabric.bench.replay import LLAMA31_8B_BYTES_PER_TOKEN, ReplayOptions

    opt = ReplayOptions(kv_bytes_per_token=LLAMA31_8B_BYTES_PER_TOKEN, link_gbps=25.0)
    extra = 256 * (LLAMA31_8B_BYTES_PER_TOKEN - opt.bytes_per_token) * 8 / 25e9
    assert abs(opt.load_seconds(0.001, 256) - (0.001 + extra)) < 1e-12
    assert ReplayOptions().load_seconds(0.001, 256) == 0.001  # bench replay models nothing by default

    rc = rag_main(["--requests", "200", "--capacity", "0.5", "--capacities", "0.5", "--policies", "lru",
                   "--link-gbps", "0.001", "--no-progress", "--out-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    lines = [ln.strip() for ln in out.splitlines()]
    for level in ("exists =", "loaded =", "useful ="):
        assert any(ln.startswith(level) for ln in lines), level
    assert any("131072 B/token" in ln and "Llama-3-8B" in ln for ln in lines)
    (rep,) = json.loads((tmp_path / "rag.json").read_text())["replays"]
    (run,) = rep["runs"]
    assert rep["kv_bytes_per_token"] == LLAMA31_8B_BYTES_PER_TOKEN
    assert run["levels"]["loaded"]["hit_blocks"] > 0
    assert run["levels"]["useful"]["hit_blocks"] == 0
