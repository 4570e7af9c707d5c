"""The router's cost model (kvfabric.route.cost) and its choice (kvfabric.route.fleet.Fleet.choose), with
no sockets: exact predictions, measured rates, and which instance a prompt goes to."""

from __future__ import annotations

import math
import time

import pytest

from kvfabric import KeyHasher, Namespace
from kvfabric.route.cost import Rate, predict
from kvfabric.route.fleet import Costs, Fleet, Instance, parse_metrics


def test_predict_splits_the_prompt_and_adds_the_queue():
    p = predict(1000, 300, 700, queued_tokens=200, running=2, prefill_s_per_token=1e-3, load_s_per_token=1e-4,
                decode_s_per_running=0.05)
    assert (p.from_cache, p.from_pool, p.recompute) == (300, 400, 300)
    assert math.isclose(p.queue_s, 0.2 + 0.1) and math.isclose(p.ttft_s, 0.3 + 0.3 + 0.04), p
    # the pool holding less than the engine adds nothing; a producer loads nothing
    assert predict(1000, 500, 200, queued_tokens=0, running=0, prefill_s_per_token=1e-3, load_s_per_token=1e-4,
                   decode_s_per_running=0).from_pool == 0
    q = predict(1000, 0, 1000, queued_tokens=0, running=0, prefill_s_per_token=1e-3, load_s_per_token=1e-4,
                decode_s_per_running=0, loads_from_pool=False)
    assert (q.from_pool, q.recompute) == (0, 1000) and math.isclose(q.ttft_s, 1.0)
    # counts past the prompt are clipped
    assert predict(10, 50, 80, queued_tokens=0, running=0, prefill_s_per_token=1, load_s_per_token=1,
                   decode_s_per_running=0).recompute == 0
    with pytest.raises(ValueError):
        predict(10, 0, 0, queued_tokens=-1, running=0, prefill_s_per_token=1, load_s_per_token=1,
                decode_s_per_running=0)
    with pytest.raises(ValueError):
        predict(10, 0, 0, queued_tokens=0, running=0, prefill_s_per_token=float("nan"), load_s_per_token=1,
                decode_s_per_running=0)


def test_rate_is_the_prior_until_measured_then_a_moving_average():
    r = Rate(1e-3, alpha=0.5, min_tokens=100)
    r.observe(10.0, 1000)                  # first read: the base
    assert r.value == 1e-3 and not r.measured
    r.observe(10.05, 1050)                 # under min_tokens: nothing yet
    assert r.value == 1e-3
    r.observe(10.2, 1200)                  # 0.2 s over 200 tokens
    assert r.measured and math.isclose(r.value, 1e-3)
    r.observe(10.8, 1400)                  # 0.6 s / 200 = 3e-3, blended half
    assert math.isclose(r.value, 2e-3)
    r.observe(0.1, 10)                     # counters went down (restart): a new base, value kept
    assert math.isclose(r.value, 2e-3)
    with pytest.raises(ValueError):
        Rate(0)


def test_parse_metrics_sums_engines_and_keeps_local_compute():
    text = "\n".join([
        "# HELP vllm:num_requests_running x",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1000.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 500.0',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5',
        "vllm:kvfabric_load_tokens_total 256.0"])
    assert parse_metrics(text) == {"vllm:num_requests_running": 2.0, "vllm:num_requests_waiting": 3.0,
                                   "local_compute_tokens": 1000.0, "vllm:request_prefill_time_seconds_sum": 1.5,
                                   "vllm:kvfabric_load_tokens_total": 256.0}


def _fleet(policy: str = "kv", n: int = 2) -> Fleet:
    insts = [Instance(f"http://i{k}") for k in range(n)]
    return Fleet(insts, policy=policy, hasher=KeyHasher(), namespace=Namespace(model="m", block_tokens=16),
                 costs=Costs(prefill_s_per_token=1e-3, load_s_per_token=1e-4, decode_s_per_running=0.01),
                 poll=False)


def _warm(inst: Instance, tokens: list[int]) -> None:
    """The instance's events say it holds ``tokens`` (whole 16-token blocks)."""
    n = len(tokens) // 16
    inst.index.apply([{"type": "BlockStored", "block_hashes": list(range(n)), "parent_block_hash": None,
                       "token_ids": tokens[:16 * n], "block_size": 16}])


def test_choice_goes_where_the_prefix_is_cached():
    f = _fleet()
    a, b = f.instances
    prompt = list(range(100, 420))
    _warm(b, prompt[:256])
    for _ in range(4):
        inst, pred = f.choose(f.instances, prompt)
        assert inst is b and pred.from_cache == 256 and pred.recompute == 64, pred
    _warm(a, prompt[:16])                  # a little on A changes nothing
    assert f.choose(f.instances, prompt)[0] is b
    # B busy: 1000 tokens of prefill queued ahead (1 s) outweigh its 256 cached tokens (0.256 s)
    work = f.begin(b, 1000, None)
    inst, pred = f.choose(f.instances, prompt)
    assert inst is a, pred
    f.first_token(b, work)
    f.end(b)
    assert f.choose(f.instances, prompt)[0] is b
    # a prompt nobody holds: ties go to the instance with fewer requests in flight
    f.begin(b, 10, None)
    assert f.choose(f.instances, list(range(5000, 5100)))[0] is a
    f.close()


def test_other_policies_and_unknown_tokens():
    f = _fleet("least-loaded")
    a, b = f.instances
    prompt = list(range(64))
    _warm(b, prompt)
    f.begin(b, 10, None)
    inst, pred = f.choose(f.instances, prompt)
    assert inst is a and pred.from_cache == 0, pred          # the cache is not looked at
    f.close()
    rr = _fleet("rr", 3)
    assert [rr.choose(rr.instances, prompt)[0].url for _ in range(6)] == ["http://i0", "http://i1", "http://i2"] * 2
    rr.close()
    kv = _fleet()
    kv.begin(kv.instances[0], 10, None)
    inst, pred = kv.choose(kv.instances, None)                # no token ids: queue only
    assert inst is kv.instances[1] and kv.snapshot()["no_tokens"] == 1
    # a down instance is used only when nothing else answers
    kv.instances[1].down_until = float("inf")
    assert kv.choose(kv.instances, prompt)[0] is kv.instances[0]
    assert kv.choose(kv.instances, prompt, exclude=[kv.instances[0]])[0] is kv.instances[1]
    kv.close()


def test_vllms_counts_add_only_other_clients_requests():
    import time

    f = _fleet()
    a, b = f.instances
    prompt = list(range(100, 420))
    _warm(b, prompt[:256])
    # B's last /metrics was read while the router's own request was running there (1 running, 1 own):
    # that request has finished since, so B is idle and keeps the prompt
    b.running, b.waiting, b.own_at_poll, b.metrics_at = 1.0, 0.0, 1, time.monotonic()
    inst, pred = f.choose(f.instances, prompt)
    assert inst is b and pred.queue_s == 0, pred
    # other clients: 3 waiting beyond the router's own, each a mean prompt of 1000 tokens (3 s at 1 ms/token)
    b.waiting, b.mean_prompt = 3.0, 1000.0
    inst, pred = f.choose(f.instances, prompt)
    assert inst is a, pred
    p = f.predict(b, prompt, 0, True, True, time.monotonic())
    assert math.isclose(p.queue_s, 3 * 1000 * 1e-3), p        # 1 running + 3 waiting - 1 own = 3 waiting
    f.close()


def test_ssd_tokens_are_priced_at_the_ssd_load_rate():
    """Issue 26: the pool's tokens by tier. 400 to load, 300 of them in chunks only on SSD."""
    kw = dict(queued_tokens=0, running=0, prefill_s_per_token=1e-3, load_s_per_token=1e-4, decode_s_per_running=0)
    p = predict(1000, 300, 700, pool_ssd_tokens=300, load_ssd_s_per_token=2e-3, **kw)
    assert (p.from_pool, p.from_ssd, p.recompute) == (400, 300, 300), p
    assert math.isclose(p.ttft_s, 300 * 1e-3 + 100 * 1e-4 + 300 * 2e-3), p
    # an SSD rate not measured yet: SSD tokens cost the load rate (as before the split)
    q = predict(1000, 300, 700, pool_ssd_tokens=300, **kw)
    assert math.isclose(q.ttft_s, 300 * 1e-3 + 400 * 1e-4), q
    # SSD tokens beyond what is loaded count only up to it; a producer loads none
    assert predict(1000, 650, 700, pool_ssd_tokens=300, load_ssd_s_per_token=2e-3, **kw).from_ssd == 50
    assert predict(1000, 0, 700, pool_ssd_tokens=300, loads_from_pool=False, **kw).from_ssd == 0
    with pytest.raises(ValueError):
        predict(10, 0, 5, pool_ssd_tokens=-1, **kw)
    with pytest.raises(ValueError):
        predict(10, 0, 5, pool_ssd_tokens=5, load_ssd_s_per_token=float("inf"), **kw)


def test_an_instance_whose_ssd_loads_are_slow_is_priced_by_them():
    """Two instances, the same prompt in the pool, on SSD: the one whose measured SSD loads are slower
    than its prefill is predicted to recompute-cost them (its metrics say so), the other loads."""
    f = _fleet()
    a, b = f.instances
    text = "vllm:kvfabric_ssd_load_us_total {us}\nvllm:kvfabric_ssd_load_tokens_total {tok}\n"
    m0 = parse_metrics(text.format(us=0, tok=0))
    assert m0 == {"vllm:kvfabric_ssd_load_us_total": 0.0, "vllm:kvfabric_ssd_load_tokens_total": 0.0}
    for inst, us_per_token in ((a, 5000.0), (b, 10.0)):     # A: 5 ms/token from SSD; B: 10 us/token
        inst.load_ssd.observe(0.0, 0)
        m = parse_metrics(text.format(us=us_per_token * 10000, tok=10000))
        inst.load_ssd.observe(m["vllm:kvfabric_ssd_load_us_total"] / 1e6, m["vllm:kvfabric_ssd_load_tokens_total"])
    assert a.load_ssd.measured and math.isclose(a.load_ssd.value, 5e-3) and math.isclose(b.load_ssd.value, 1e-5)
    now = time.monotonic()
    pa = f.predict(a, list(range(512)), 512, True, True, now, pool_ssd_tokens=512)
    pb = f.predict(b, list(range(512)), 512, True, True, now, pool_ssd_tokens=512)
    assert math.isclose(pa.ttft_s, 512 * 5e-3) and math.isclose(pb.ttft_s, 512 * 1e-5), (pa, pb)
    # DRAM tokens still cost the load rate on both
    assert math.isclose(f.predict(a, list(range(512)), 512, True, True, now).ttft_s, 512 * 1e-4)
    f.close()
