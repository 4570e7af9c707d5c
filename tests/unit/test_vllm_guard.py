"""The vLLM connector's load guard (connectors/kvfabric_vllm/guard.py, issue 26 part 3): the pure
estimators and the decision, with explicit clocks (no sleeps, no vLLM)."""

from __future__ import annotations

import math

import pytest

from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.guard import BusyClock, LoadGuard, leading_tokens_to_load
from kvfabric import ConfigError


# ------------------------------------------------------------------ the decision


def test_one_rate_is_all_or_nothing():
    assert leading_tokens_to_load([(1408, 1e-5)], prefill_s_per_token=1e-4) == 1408
    assert leading_tokens_to_load([(1408, 1e-3)], prefill_s_per_token=1e-4) == 0
    # equal: loading is the default
    assert leading_tokens_to_load([(1408, 1e-4)], prefill_s_per_token=1e-4) == 1408
    assert leading_tokens_to_load([], prefill_s_per_token=1e-4) == 0


def test_per_tier_runs_load_the_prefix_that_saves_most():
    fast, slow = 1e-5, 1e-3
    # DRAM then SSD: the DRAM run only
    assert leading_tokens_to_load([(512, fast), (896, slow)], 1e-4) == 512
    # a slow run early, then a long fast one: loading through the slow run still pays off
    # 256 * (1e-4 - 1e-3) = -0.2304 s, then 4096 * (1e-4 - 1e-5) = +0.36864 s
    assert leading_tokens_to_load([(256, slow), (4096, fast)], 1e-4) == 256 + 4096
    # ... but not when the fast run is too short to make up for it
    assert leading_tokens_to_load([(256, slow), (1024, fast)], 1e-4) == 0
    # a fast run, a slow one, a fast one: the best prefix
    assert leading_tokens_to_load([(128, fast), (128, slow), (128, fast)], 1e-4) == 128


@pytest.mark.parametrize("runs, prefill", [([(-1, 1e-5)], 1e-4), ([(10, -1.0)], 1e-4), ([(10, math.inf)], 1e-4),
                                           ([(10, 1e-5)], math.nan), ([(10, 1e-5)], -1.0)])
def test_bad_inputs_raise(runs, prefill):
    with pytest.raises(ValueError):
        leading_tokens_to_load(runs, prefill)


# ------------------------------------------------------------------ the load clock


def test_busy_clock_counts_overlapping_intervals_once():
    c = BusyClock()
    c.start(10.0)
    c.start(11.0)        # a second load queued behind the first
    c.stop(12.0)
    c.stop(14.0)
    assert c.total == pytest.approx(4.0) and c.open == 0
    c.start(20.0)        # the idle gap 14..20 is not counted
    c.stop(21.0)
    assert c.total == pytest.approx(5.0)
    with pytest.raises(ValueError):
        c.stop(22.0)


def _guard(**kw) -> LoadGuard:
    return LoadGuard(**{"min_tokens": 1000, "probe_s": 30.0, **kw})


def _prefill(g: LoadGuard, t: float, s_per_token: float, tokens: int = 1000, rid: str = "p") -> float:
    """One counted prefill step of ``tokens`` at ``t``, the next step after it; returns the time after."""
    g.step(t, tokens, [rid])
    t += tokens * s_per_token
    g.step(t, 0, [rid])
    return t


def _load(g: LoadGuard, t: float, s_per_token: float, tokens: int = 1000, rid: str = "l") -> float:
    g.load_started(rid, tokens, t)
    t += tokens * s_per_token
    g.load_finished(rid, t)
    return t


def test_loads_as_before_until_both_rates_are_measured():
    g = _guard()
    assert g.plan(1408, now=0.0) is None
    t = _prefill(g, 0.0, 1e-4, tokens=999)       # one token short of a window
    assert not g.prefill.measured and g.plan(1408, t) is None
    t = _prefill(g, t, 1e-4, tokens=1)
    assert g.prefill.measured and g.prefill.value == pytest.approx(1e-4)
    assert g.plan(1408, t) is None               # no load measured yet
    t = _load(g, t, 1e-3)
    assert g.load.measured and g.load.value == pytest.approx(1e-3)
    assert g.plan(1408, t) == 0                  # loading predicted 10x slower: recompute


def test_fast_pool_loads_everything():
    g = _guard()
    t = _prefill(g, 0.0, 1e-4)
    t = _load(g, t, 1e-5)
    assert g.plan(1408, t) == 1408


def test_off_never_weighs():
    g = _guard(enabled=False)
    t = _prefill(g, 0.0, 1e-4)
    t = _load(g, t, 1e-3)
    assert g.measured and g.plan(1408, t) is None


def test_queued_loads_share_the_clock():
    """Two loads in flight together: the rate is the loader's, not the sum of both waits."""
    g = _guard()
    g.load_started("a", 1000, 0.0)
    g.load_started("b", 1000, 0.0)
    g.load_finished("a", 1.0)
    g.load_finished("b", 2.0)
    assert g.load.value == pytest.approx(2.0 / 2000)
    g.load_finished("unknown", 3.0)              # never started: ignored
    assert g.load.value == pytest.approx(2.0 / 2000)


def test_prefill_clock_leaves_out_inline_time_idle_steps_and_sync_loads():
    g = _guard()
    # a step of 1000 prompt tokens taking 0.3 s, 0.2 s of which the connector spent waiting inline
    g.step(0.0, 1000, ["a"])
    g.inline(0.2)
    g.step(0.3, 0, ["a"])
    assert g.prefill.value == pytest.approx(0.1 / 1000)
    # a step whose requests all finished before the next: the engine may have idled; not counted
    g.step(10.0, 1000, ["b"])
    g.finished("b")
    g.step(99.0, 0, [])
    assert g.prefill.value == pytest.approx(0.1 / 1000)
    # a step that loads synchronously: its time is the load's, not counted
    g.step(100.0, 1000, ["c"], countable=False)
    g.step(200.0, 0, ["c"])
    assert g.prefill.value == pytest.approx(0.1 / 1000)
    # decode-only steps (no prompt tokens) are not counted
    g.step(300.0, 0, ["c"])
    g.step(400.0, 0, ["c"])
    assert g.prefill.value == pytest.approx(0.1 / 1000)


def test_a_probe_lets_one_load_through_when_the_load_rate_is_old():
    g = _guard(probe_s=30.0)
    t = _prefill(g, 0.0, 1e-4)
    t = _load(g, t, 1e-3)
    assert g.plan(1408, t + 29.0) == 0
    assert g.plan(1408, t + 30.0) == 1408        # probe: measure the pool again
    g.load_started("probe", 1408, t + 30.0)
    assert g.plan(1408, t + 31.0) == 0           # one probe at a time
    g.load_finished("probe", t + 30.0 + 1408 * 1e-5)   # the pool got fast again
    # the EMA moves toward the new rate; enough fast loads bring it under the prefill rate
    t = t + 31.0
    for i in range(8):
        t = _load(g, t, 1e-5, rid=f"f{i}")
    assert g.load.value < g.prefill.value and g.plan(1408, t) == 1408


@pytest.mark.parametrize("kw", [{"min_tokens": 0}, {"min_tokens": 1.5}, {"probe_s": 0.0}, {"probe_s": math.inf}])
def test_bad_settings_raise(kw):
    with pytest.raises(ValueError):
        _guard(**kw)


# ------------------------------------------------------------------ the switch


def test_config_switch_defaults_and_limits():
    cfg = parse_extra_config({"servers": ["127.0.0.1:1"]}, "kv_both", 128)
    assert (cfg.load_guard, cfg.load_guard_min_tokens, cfg.load_guard_probe_s) == (True, 4096, 30.0)
    cfg = parse_extra_config({"servers": ["127.0.0.1:1"], "load_guard": False, "load_guard_min_tokens": 512,
                              "load_guard_probe_s": 5}, "kv_both", 128)
    assert (cfg.load_guard, cfg.load_guard_min_tokens, cfg.load_guard_probe_s) == (False, 512, 5.0)
    for bad in ({"load_guard": "no"}, {"load_guard_min_tokens": 0}, {"load_guard_probe_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_extra_config({"servers": ["127.0.0.1:1"], **bad}, "kv_both", 128)


def _load_kind(g: LoadGuard, t: float, s_per_token: float, kind: str, tokens: int = 1000, rid: str = "l") -> float:
    g.load_started(rid, tokens, t, kind)
    t += tokens * s_per_token
    g.load_finished(rid, t)
    return t


def test_ssd_hits_are_weighed_with_the_ssd_loads_rate_only():
    """A fast DRAM pool and a throttled SSD tier: DRAM hits load, SSD hits are recomputed, each
    kind measured on its own loads (issue 26 part 3: the lookup says the medium)."""
    g = _guard()
    t = _prefill(g, 0.0, 1e-4)
    t = _load_kind(g, t, 1e-5, "dram")
    assert g.plan(1408, t, ssd_tokens=0) == 1408
    assert g.plan(1408, t, ssd_tokens=128) is None      # no SSD load measured yet: load, measure it
    t = _load_kind(g, t, 1e-3, "ssd")                    # 10x slower than recomputing
    assert g.load_ssd.value == pytest.approx(1e-3) and g.load.value == pytest.approx(1e-5)
    assert g.plan(1408, t, ssd_tokens=128) == 0
    assert g.plan(1408, t, ssd_tokens=0) == 1408         # DRAM hits are not priced as the disk
    assert g.to_json() == {"load_s_per_token": pytest.approx(1e-5), "load_ssd_s_per_token": pytest.approx(1e-3),
                           "prefill_s_per_token": pytest.approx(1e-4)}


def test_each_kind_probes_on_its_own_clock():
    g = _guard()
    t = _prefill(g, 0.0, 1e-4)
    t = _load_kind(g, t, 1e-3, "ssd")
    t = _load_kind(g, t + 20.0, 1e-5, "dram")            # a recent DRAM load is no news of the disk
    assert g.plan(1408, t, ssd_tokens=64) == 0
    assert g.plan(1408, t + 10.0, ssd_tokens=64) == 1408  # the SSD sample is 30 s old: probe it
    g.load_started("probe", 1408, t + 10.0, "ssd")
    assert g.plan(1408, t + 11.0, ssd_tokens=64) == 0     # one probe at a time


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError):
        _guard().load_started("r", 10, 0.0, "nvme")
    assert LoadGuard.kind(None) == LoadGuard.kind(0) == "dram" and LoadGuard.kind(3) == "ssd"
