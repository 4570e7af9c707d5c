"""Live weight versions of the vLLM connector (connectors/kvfabric_vllm/weights.py): the scheduler's
bookkeeping of what its workers measured, and the sampled-parameter fingerprint.

``LiveWeights`` needs neither torch nor vLLM; the fingerprint needs torch (vLLM's interpreter:
docs/notes/vllm.md, "Tests").
"""

from __future__ import annotations

import pytest

from kvfabric_vllm.weights import LiveWeights, WeightsReport


def test_files_tag_until_the_workers_measure():
    w = LiveWeights(2, files_tag="files-fp")
    assert w.current == () and w.tag() == "files-fp" and not w.pending
    # one rank of two is not a version
    assert not w.report(WeightsReport({0: (0, "a")}))
    assert w.current == () and w.tag() == "files-fp"
    assert w.report(WeightsReport({1: (0, "b")}))
    assert w.current == ("a", "b")
    tag = w.tag()
    assert tag.startswith("live-") and tag != "files-fp"
    # the same fingerprints give the same tag on another engine; another rank's change another tag
    other = LiveWeights(2, files_tag="elsewhere")
    other.report(WeightsReport({0: (0, "a"), 1: (0, "b")}))
    assert other.tag() == tag
    assert w.report(WeightsReport({1: (0, "c")})) and w.tag() not in (tag, "files-fp")


def test_a_reset_waits_for_every_rank_of_its_epoch():
    w = LiveWeights(2)
    w.report(WeightsReport({0: (0, "a"), 1: (0, "b")}))
    assert w.reset(now=100.0) == 1 and w.pending
    # reports of before the reset do not answer it
    assert not w.report(WeightsReport({0: (0, "x"), 1: (0, "y")}))
    assert w.pending and w.current == ("a", "b")
    assert not w.report(WeightsReport({0: (1, "a2")}))
    assert w.pending
    assert w.report(WeightsReport({1: (1, "b2")}))
    assert not w.pending and w.current == ("a2", "b2")
    # unchanged weights after a reset: answered, nothing changes
    w.reset(now=200.0)
    assert not w.report(WeightsReport({0: (2, "a2"), 1: (2, "b2")}))
    assert not w.pending and w.current == ("a2", "b2")


def test_a_rank_without_a_model_makes_the_version_unknown():
    w = LiveWeights(1, files_tag="f")
    w.reset(now=0.0)
    assert w.report(WeightsReport({0: (1, "")}))
    assert w.current is None and w.tag() is None and not w.pending
    # a later measurement binds again
    assert w.report(WeightsReport({0: (1, "m")}))
    assert w.current == ("m",) and w.tag().startswith("live-")


def test_an_unanswered_reset_expires_to_unknown():
    w = LiveWeights(1, files_tag="f")
    w.reset(now=10.0)
    assert not w.expire(1.0, now=11.0) and w.pending
    assert w.expire(1.0, now=11.5)
    assert not w.pending and w.current is None and w.tag() is None
    assert not w.expire(1.0, now=20.0)


def test_reports_merge_per_rank_keeping_the_newest_epoch():
    a = WeightsReport({0: (1, "a1"), 1: (0, "b0")})
    b = WeightsReport({0: (0, "a0"), 1: (2, "b2"), 2: (0, "c0")})
    assert a.merge(b).ranks == {0: (1, "a1"), 1: (2, "b2"), 2: (0, "c0")}
    assert b.merge(a).ranks == a.merge(b).ranks
    w = LiveWeights(1)
    assert not w.report(WeightsReport({5: (0, "out of range")}))   # ranks beyond the TP size are ignored
    with pytest.raises(ValueError):
        LiveWeights(0)


def test_fingerprint_sees_a_change_anywhere_sampled_and_only_that():
    torch = pytest.importorskip("torch", reason="the fingerprint reads torch tensors")
    from kvfabric_vllm.weights import params_fingerprint

    g = torch.Generator().manual_seed(0)
    params = {"a.weight": torch.randn(64, 48, generator=g), "b.bias": torch.randn(7, generator=g),
              "c.weight": torch.randn(3000, generator=g).to(torch.bfloat16), "empty": torch.empty(0)}
    fp = params_fingerprint(params.items())
    assert len(fp) == 32
    assert params_fingerprint(reversed(list(params.items()))) == fp          # order of iteration
    assert params_fingerprint({k: v.clone() for k, v in params.items()}.items()) == fp
    assert params_fingerprint(params.items(), version="step-1") != fp
    for name in ("a.weight", "b.bias", "c.weight"):
        changed = dict(params)
        t = params[name].clone()
        t.view(-1)[0] += 1          # the first element is always sampled
        changed[name] = t
        assert params_fingerprint(changed.items()) != fp, name
    # the same bytes under another name or shape are other weights
    renamed = {("z" if k == "b.bias" else k): v for k, v in params.items()}
    assert params_fingerprint(renamed.items()) != fp
    reshaped = dict(params, **{"a.weight": params["a.weight"].reshape(48, 64)})
    assert params_fingerprint(reshaped.items()) != fp
    with pytest.raises(ValueError):
        params_fingerprint(params.items(), version="v" * 1000)
