"""The serving benchmark's RL workload (kvfabric.bench._serve_rl): its schedule and the stale-hit measure."""

from __future__ import annotations

import pytest

from kvfabric.bench._serve_rl import RLResult, RLRun, RLSpec, _measure_stale, _Seq, rl_figures


def test_spec_counts_updates_between_steps_only():
    assert RLSpec(turns=6, update_every=2).updates == 2          # after steps 2 and 4, never after the last
    assert RLSpec(turns=4, update_every=3).updates == 1
    assert RLSpec(turns=2, update_every=2).updates == 0
    s = RLSpec(prompts=2, group=3, turns=4, system_tokens=10, prompt_tokens=20, obs_tokens=5, output_tokens=7)
    assert s.sessions == 6 and s.max_context == 10 + 20 + 4 * 12
    d = s.describe()
    assert d["requests"] == 24 and d["output_tokens"] == 24 * 7 and d["steps"] == 4
    with pytest.raises(ValueError):
        RLSpec(group=0)
    with pytest.raises(ValueError):
        RLSpec(env_delay_s=-1)


def _res(session: int, step: int, version: int, cached: int, sent: float = 1.0, first: float = 2.0) -> RLResult:
    return RLResult(index=0, session=session, instance=0, sent_s=sent, ttft_s=first - sent, step=step,
                    version=version, cached_tokens=cached, first_token_s=first)


def test_stale_tokens_are_cached_tokens_no_same_version_sequence_explains():
    hist = list(range(100, 400))                   # 300 tokens computed under version 0 only
    prompt = hist + [7] * 50                        # the next turn, after an update to version 1
    sibling = hist[:128] + [9] * 100                # a same-version request sharing 128 tokens
    seqs = [_Seq((0, 0), 0, 0.0, hist),             # the session's own history: other weights
            _Seq((1, 1), 1, 0.5, sibling),          # version 1, sent before r's first token
            _Seq((1, 0), 1, 1.0, prompt + [1, 2])]  # r itself: never its own explanation
    ok = _res(0, 1, 1, cached=128)
    stale = _res(0, 1, 1, cached=256)
    for r in (ok, stale):
        _measure_stale([r], {0: prompt}, seqs)
    assert (ok.legit_tokens, ok.stale_tokens) == (128, 0)
    assert (stale.legit_tokens, stale.stale_tokens) == (128, 128)


def test_a_sequence_sent_after_the_first_token_explains_nothing():
    prompt = list(range(10, 300))
    late = _Seq((1, 1), 0, 3.0, list(prompt))       # same version, but sent after r's first token (2.0)
    early = _Seq((0, 2), 0, 0.1, prompt[:64])
    r = _res(0, 1, 0, cached=128)
    _measure_stale([r], {0: prompt}, [late, early])
    assert (r.legit_tokens, r.stale_tokens) == (64, 64)
    failed = _res(0, 1, 0, cached=128)
    failed.error = "x"
    _measure_stale([failed], {0: prompt}, [late, early])
    assert failed.stale_tokens == 0 and failed.legit_tokens == 0     # not measured


def test_figures_sum_per_generator_counter_deltas():
    r = _res(0, 0, 0, cached=0)
    r.output_tokens = 10
    run = RLRun([r], wall_s=4.0, generate_s=2.0, updates=[{"s": 0.5}])
    keys = ("weights_updates", "weights_refused_chunks", "weights_retires", "weights_retire_errors",
            "weights_unversioned")
    before = [dict.fromkeys(keys, 1.0), dict.fromkeys(keys, 0.0)]
    after = [dict(before[0], weights_updates=3.0), dict(before[1], weights_updates=2.0, weights_refused_chunks=4.0)]
    f = rl_figures(run, before, after)
    assert f["rollout_output_tokens_per_s"] == 5.0 and f["update_s"] == 0.5
    assert f["weights_updates_per_generator"] == [2.0, 2.0] and f["weights_refused_chunks"] == 4.0
    assert f["stale_tokens"] == 0 and f["stale_requests"] == 0
