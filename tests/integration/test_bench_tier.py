"""``kvfabric bench tier`` end to end on real servers, and the O_DIRECT read ceiling it is a ratio of.

No timing is asserted: only that every figure is measured on what it says
(objects really came from the SSD tier, bytes checked, the write-behind ran,
the restarted server served from the same directory) and lands in the JSON.
Until ``kvfabric serve`` has ``--ssd-path`` (issue 11) the end-to-end test is
skipped with the reason, and the benchmark's refusal is tested instead.
"""

from __future__ import annotations

import json

import pytest

from kvfabric import transport
from kvfabric.bench import tier
from kvfabric.bench._tiers import tier_unsupported

NATIVE = "native" in transport.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"the C extension: {transport.unavailable().get('native')}")


@needs_native
def test_direct_read_ceiling_reads_every_chunk(tmp_path):
    import os

    from kvfabric import _native

    fd = _native.direct_read_file(str(tmp_path), 8 << 20, 1 << 20)
    try:
        assert list(tmp_path.iterdir()) == []  # the file is unlinked at once
        for depth in (1, 4):
            secs, lat = _native.direct_read_ceiling(fd, 8 << 20, 1 << 20, depth, 20)
            assert secs > 0 and len(lat) == 20 and all(x > 0 for x in lat)
        for bad in ((8 << 20, 1 << 20, 0, 4), (2 << 20, 1 << 20, 4, 4), (3 << 19, 1 << 20, 1, 4)):
            with pytest.raises(ValueError):
                _native.direct_read_ceiling(fd, *bad)
        with pytest.raises(OSError):  # reads of another size do not find their chunk's stamp: EIO
            _native.direct_read_ceiling(fd, 8 << 20, 1 << 19, 1, 4)
    finally:
        os.close(fd)
    with pytest.raises(ValueError):
        _native.direct_read_file(str(tmp_path), 8 << 20, 1000)
    with pytest.raises(OSError):
        _native.direct_read_file(str(tmp_path / "missing"), 8 << 20, 1 << 20)


@needs_native
def test_bench_tier_refuses_a_server_without_a_tier(tmp_path, capsys):
    reason = tier_unsupported()
    if reason is None:
        pytest.skip("kvfabric serve has an SSD tier; the end-to-end test covers it")
    out = tmp_path / "tier.json"
    assert tier.main(["--quick", "--dir", str(tmp_path), "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert set(rep["errors"]) == {"get", "put", "restart"} and "--ssd-path" in rep["errors"]["get"]
    assert "get" not in rep and "put" not in rep and "restart" not in rep  # no server figure made up
    assert [c["depth"] for c in rep["ceiling_only"]] == [1, 4] and all(c["gb_per_s"] > 0 for c in rep["ceiling_only"])
    assert "NOT MEASURED" in capsys.readouterr().out


@needs_native
@pytest.mark.skipif(tier_unsupported() is not None, reason=str(tier_unsupported()))
def test_bench_tier_quick_measures_real_servers(tmp_path):
    out = tmp_path / "tier.json"
    rc = tier.main(["--quick", "--dir", str(tmp_path), "--json", str(out)])  # targets are timing: not asserted
    rep = json.loads(out.read_text())
    assert rep["errors"] == {} and rc == 0, rep["errors"]
    assert rep["get"]["ssd_after_fill"]["ssd_objects"] > 0
    for row in rep["get"]["rows"]:
        s, c = row["server"], row["ceiling"]
        assert s["wrong"] == 0 and s["missing"] == 0 and s["objects"] == s["gets"] * row["batch"]
        assert s["ssd_hits"] > 0 and s["gb_per_s"] > 0 and c["gb_per_s"] > 0 and c["depth"] == row["batch"]
        assert row["ratio"] == pytest.approx(s["gb_per_s"] / c["gb_per_s"])
        assert row["dram"]["ssd_hits"] == 0 and row["dram"]["gb_per_s"] > 0
        assert len(row["repeat_ratios"]) == rep["repeat"]
    pl = rep["get"]["pipelined"]  # one-key GETs pipelined on a native connection
    assert pl["server"]["wrong"] == 0 and pl["server"]["missing"] == 0 and pl["server"]["ssd_hits"] > 0
    assert pl["ceiling"]["depth"] == pl["depth"] == 32 // 4 and len(pl["repeat_ratios"]) == rep["repeat"]
    put = rep["put"]
    assert put["off"]["n"] == put["on"]["n"] == 60 * rep["repeat"]
    # whether the write-behind completed writes inside the PUT window is timing (CI once saw none while the
    # suite's other part installed vLLM): not asserted; but the target is never called met without them
    assert put["ssd_writes_during"] >= 0 and (put["ssd_writes_during"] > 0 or not put["target_met"]), put
    assert len(put["repeat_p99_ratios"]) == rep["repeat"] and len(put["server_p99_us_below"]["on"]) == rep["repeat"]
    drained, during = rep["restart"]
    assert drained["mode"] == "drained" and during["mode"] == "during-writes"
    for r in (drained, during):  # during: the kill may land before any write-behind finished
        assert r["wrong"] == 0 and r["served"] <= r["denominator"]
    assert drained["ssd_objects_before_kill"] > 0 and drained["ssd_objects_after_restart"] > 0
    assert drained["served"] > 0


@needs_native
@pytest.mark.skipif(tier_unsupported() is not None, reason=str(tier_unsupported()))
def test_tiered_replay_reports_both_tiers(tmp_path):
    from kvfabric.bench import replay

    out = tmp_path / "replay.json"
    rc = replay.main(["mooncake-conversation", "--limit", "300", "--policy", "lru", "--capacity", "0.02",
                      "--ssd-capacity", "0.5", "--ssd-admit", "off", "--ssd-admit", "all", "--shards", "2",
                      "--ssd-dir", str(tmp_path), "--no-progress", "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    off, on = rep["runs"]
    assert (off["label"], on["label"]) == ("lru/dram-only", "lru/ssd-all") and "ssd" not in off
    assert rep["ssd_capacity_blocks"] >= 0.5 * rep["unique_blocks"] and rep["ssd_segment_blocks"] > 0
    s = on["ssd"]
    assert s["ssd_writes"] > 0 and s["ssd_hits"] > 0 and s["ssd_corrupt"] == 0 and s["ssd_read_us"] > 0
    assert on["bytes"]["corrupt_blocks"] == 0
    t = on["sim"]["tiers"]
    assert t["dram_hit_blocks"] + t["ssd_hit_blocks"] == round(on["sim"]["block_hit_rate"] * rep["total_blocks"])
    assert t["ssd_read_us"] == s["ssd_read_us"] and "useful" in t
    assert list(tmp_path.glob("kvfabric-replay-ssd-*")) == []  # the servers' tier directories are removed
