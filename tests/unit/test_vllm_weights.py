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
    # the clock starts at the first lookup that waits (an idle engine runs no step to measure in)
    assert not w.expire(1.0, now=50.0) and w.pending
    assert not w.expire(1.0, now=51.0) and w.pending
    assert w.expire(1.0, now=51.5)
    assert not w.pending and w.current is None and w.tag() is None
    assert not w.expire(1.0, now=60.0)
    # a later reset starts a new clock; a report in time answers it
    w.reset(now=70.0)
    assert not w.expire(1.0, now=80.0)
    assert w.report(WeightsReport({0: (2, "m")})) and not w.pending
    assert not w.expire(1.0, now=90.0) and w.current == ("m",)


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


def test_a_worker_serves_only_specs_planned_under_the_weights_it_holds():
    """Against a real server: a worker given the model refuses the loads (their blocks recompute) and
    saves (nothing put) planned under other weights, serves those planned under its own, and on a
    reset measures the model again (weights changed in place: another fingerprint, reported once)."""
    torch = pytest.importorskip("torch", reason="the worker copies torch tensors")
    pytest.importorskip("vllm", reason="the worker imports vLLM's metadata classes")
    pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    import os

    from kvfabric import Client, KeyHasher
    from kvfabric.testing.poll import wait_for
    from kvfabric.testing.servers import start_pool
    from kvfabric_vllm.config import parse_extra_config
    from kvfabric_vllm.layout import chunk_major_layer_keys
    from kvfabric_vllm.meta import LoadSpec, SaveSpec
    from kvfabric_vllm.metrics import Counters
    from kvfabric_vllm.worker import WorkerSide

    block, names = 32, ["l0", "l1"]
    with start_pool(1, capacity="16MiB") as pool, Client(pool.addresses) as c:
        cfg = parse_extra_config({"servers": pool.addresses, "chunk_tokens": block, "timeout_s": 60.0,
                                  "save_timeout_s": 60.0, "load_timeout_s": 60.0}, "kv_both", block)
        w = WorkerSide(cfg, Client(config=cfg.client), 0, block, names, Counters())
        try:
            w.register({n: torch.randn((8, 2, block, 16)) for n in names})
            assert w.take_worker_meta() is None                 # nothing measured yet: the files' weights
            model = torch.nn.Linear(16, 16)
            fp = w.bind_weights(model, "step-1")
            assert w.take_worker_meta().weights.ranks == {0: (0, fp)} and w.take_worker_meta() is None
            keys = [os.urandom(16)]
            objs = chunk_major_layer_keys(KeyHasher(), keys, len(names))

            w.submit_saves([SaveSpec("old", keys, [None], [[1]])])              # planned under the files'
            assert w.counters.snapshot()["weights_refused_chunks"] == 1
            assert w.counters.snapshot()["save_jobs"] == 0 and c.lookup(objs) == 0
            w.submit_saves([SaveSpec("new", keys, [None], [[1]], weights=(fp,))])
            assert wait_for(lambda: c.lookup(objs) == len(objs), timeout_s=60), w.counters.snapshot()

            w.load([LoadSpec("stale", keys, [[3]], weights=("other",))])
            assert w.take_failed_block_ids() == {3}                            # recomputed, not loaded
            w.load([LoadSpec("same", keys, [[4]], weights=(fp,))])
            assert w.take_failed_block_ids() == set() and w.counters.snapshot()["load_chunks"] == 1

            with torch.no_grad():
                model.weight.add_(1.0)                         # updated in place ...
            w.weights_epoch(1)                                 # ... and vLLM reset the connector's cache
            (epoch, fp2), = w.take_worker_meta().weights.ranks.values()
            assert epoch == 1 and fp2 not in ("", fp)
            w.weights_epoch(1)                                 # the same epoch again: nothing new
            assert w.take_worker_meta() is None
            w.load([LoadSpec("was-current", keys, [[5]], weights=(fp,))])
            assert w.take_failed_block_ids() == {5}
            assert w.counters.snapshot()["weights_refused_chunks"] == 3
        finally:
            w.shutdown()


def test_a_reset_on_a_worker_never_given_the_model_refuses_everything():
    pytest.importorskip("vllm", reason="the worker imports vLLM's metadata classes")
    from kvfabric_vllm.config import parse_extra_config
    from kvfabric_vllm.meta import SaveSpec
    from kvfabric_vllm.metrics import Counters
    from kvfabric_vllm.worker import WorkerSide

    cfg = parse_extra_config({"servers": ["127.0.0.1:1"], "chunk_tokens": 32}, "kv_both", 32)
    w = WorkerSide(cfg, None, 0, 32, ["l0"], Counters())
    try:
        w.weights_epoch(1)
        assert w.take_worker_meta().weights.ranks == {0: (1, "")}
        assert w.weights_fp is None
        assert not w._weights_match(SaveSpec("r", [b"k" * 16], [None], [[1]]))     # not even the files'
    finally:
        w.shutdown()


def test_the_scheduler_keys_each_request_under_the_weights_it_was_looked_up_under():
    """Against a real server, with vLLM's request and step objects reduced to the fields the scheduler
    reads: requests looked up before a measurement stay keyed under the files' weights and save
    nothing once the weights changed; new requests, and old ones looked up again after a preemption,
    are keyed under the measured weights, which their saves carry; after a reset lookups wait for the
    workers' measurement of that reset."""
    pytest.importorskip("vllm", reason="the scheduler imports vLLM's metadata classes")
    pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    from types import SimpleNamespace

    from kvfabric import Client
    from kvfabric.testing.servers import start_server
    from kvfabric_vllm.config import parse_extra_config
    from kvfabric_vllm.keys import EngineKeys
    from kvfabric_vllm.meta import KVFabricWorkerMeta
    from kvfabric_vllm.metrics import Counters
    from kvfabric_vllm.scheduler import SchedulerSide

    chunk = 16
    with start_server(capacity="16MiB") as srv:
        extra = {"servers": [srv.address], "chunk_tokens": chunk, "lookup_wait_ms": 60_000,
                 "lookup_timeout_ms": 60_000}
        e = EngineKeys.for_model(extra, model="org/model", dtype="torch.float32", num_layers=2,
                                 total_num_kv_heads=2, head_size=8, block_size=chunk)
        manager = SimpleNamespace(get_block_ids=lambda rid: [list(range(4))])
        sched = SchedulerSide(parse_extra_config(extra, "kv_both", chunk), Client([srv.address]), e, chunk,
                              Counters(), lambda: manager, LiveWeights(1, files_tag=""))
        prompt = list(range(100, 100 + 3 * chunk + 1))

        def request(rid: str) -> SimpleNamespace:
            return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=None, cache_salt=None,
                                   num_preemptions=0, skip_reading_prefix_cache=False)

        def step(*reqs: SimpleNamespace):
            so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
                                                     for r in reqs],
                                 num_scheduled_tokens={r.request_id: len(prompt) for r in reqs},
                                 scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
            return sched.build_connector_meta(so)

        try:
            r1 = request("r1")
            assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
            files_keys = sched._reqs["r1"].keys
            assert sched._reqs["r1"].weights == ()
            sched.take_worker_meta(KVFabricWorkerMeta(WeightsReport({0: (0, "fp-a")})))
            assert sched.counters.snapshot()["weights_updates"] == 1
            assert sched.keys.namespace.extras["weights"].startswith("live-")
            assert step(r1).saves == []                     # keyed under weights no longer held: no save

            r2 = request("r2")
            assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)
            new_keys = sched._reqs["r2"].keys
            assert new_keys != files_keys and len(new_keys) == 3
            (save,) = step(r2).saves
            assert save.keys == new_keys and save.weights == ("fp-a",)

            r1.num_preemptions = 1                          # preempted, looked up again: re-keyed
            assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
            assert sched._reqs["r1"].keys == new_keys and sched._reqs["r1"].weights == ("fp-a",)

            sched.reset_weights()
            r3 = request("r3")
            assert sched.get_num_new_matched_tokens(r3, 0) == (None, False)   # waits for the workers
            assert step().weights_epoch == 1
            sched.take_worker_meta(KVFabricWorkerMeta(WeightsReport({0: (0, "stale")})))   # before the reset
            assert sched.get_num_new_matched_tokens(r3, 0) == (None, False)
            sched.take_worker_meta(KVFabricWorkerMeta(WeightsReport({0: (1, "fp-b")})))
            assert sched.get_num_new_matched_tokens(r3, 0) == (0, False)
            assert sched._reqs["r3"].weights == ("fp-b",) and sched._reqs["r3"].keys not in (new_keys, files_keys)
            assert sched.counters.snapshot()["weights_updates"] == 2

            sched.reset_weights()                           # a reset on workers never given the model
            sched.take_worker_meta(KVFabricWorkerMeta(WeightsReport({0: (2, "")})))
            r4 = request("r4")
            assert sched.get_num_new_matched_tokens(r4, 0) == (0, False) and "r4" not in sched._reqs
            assert sched.counters.snapshot()["weights_unversioned"] == 1
            assert step(r3).saves == []                     # nothing keyed under a version saves now
        finally:
            sched.shutdown()


def test_weights_retire_tags_saves_and_retires_the_previous_namespace_pool_wide():
    """``weights_retire: true``, against real servers: every save carries its namespace's tag; when the
    workers report new weights the previous namespace is retired on every server (its objects miss,
    another namespace's and untagged objects stay), counted; a server that cannot apply it is counted
    as a retire error, never a crash."""
    pytest.importorskip("vllm", reason="the scheduler imports vLLM's metadata classes")
    pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    from types import SimpleNamespace

    from kvfabric import Client
    from kvfabric.keys import namespace_tag
    from kvfabric.testing import wait_for
    from kvfabric.testing.servers import start_pool
    from kvfabric_vllm.config import parse_extra_config
    from kvfabric_vllm.keys import EngineKeys
    from kvfabric_vllm.meta import KVFabricWorkerMeta
    from kvfabric_vllm.metrics import Counters
    from kvfabric_vllm.scheduler import SchedulerSide

    chunk = 16
    with start_pool(2, capacity="16MiB") as pool:
        extra = {"servers": pool.addresses, "chunk_tokens": chunk, "lookup_wait_ms": 60_000,
                 "lookup_timeout_ms": 60_000, "weights_retire": True}
        e = EngineKeys.for_model(extra, model="org/model", dtype="torch.float32", num_layers=2,
                                 total_num_kv_heads=2, head_size=8, block_size=chunk)
        manager = SimpleNamespace(get_block_ids=lambda rid: [list(range(4))])
        client = Client(pool.addresses)
        sched = SchedulerSide(parse_extra_config(extra, "kv_both", chunk), client, e, chunk, Counters(),
                              lambda: manager, LiveWeights(1, files_tag=""))
        prompt = list(range(100, 100 + 3 * chunk + 1))
        request = SimpleNamespace(request_id="r1", prompt_token_ids=prompt, kv_transfer_params=None, cache_salt=None,
                                  num_preemptions=0, skip_reading_prefix_cache=False)
        so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r1", num_computed_tokens=0)],
                             num_scheduled_tokens={"r1": len(prompt)},
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
        try:
            files_ns = sched.keys.namespace
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
            (save,) = sched.build_connector_meta(so).saves
            assert save.ns_tag == namespace_tag(files_ns), save      # what the workers put with
            # objects as the workers store them: the files' namespace (tagged), another tag, untagged
            old = [b"old-%02d" % i + bytes(10) for i in range(8)]
            other = [b"oth-%02d" % i + bytes(10) for i in range(8)]
            plain = [b"pln-%02d" % i + bytes(10) for i in range(8)]
            for keys, tag in ((old, save.ns_tag), (other, namespace_tag(b"another engine's version")),
                              (plain, None)):
                assert client.put(keys, [k * 4 for k in keys], ns_tag=tag).dropped == 0

            sched.take_worker_meta(KVFabricWorkerMeta(WeightsReport({0: (0, "fp-a")})))
            assert wait_for(lambda: sched.counters.snapshot()["weights_retires"] == 1, timeout_s=60), \
                sched.counters.snapshot()
            assert client.exists(old) == [False] * 8
            assert client.exists(other) == [True] * 8 and client.exists(plain) == [True] * 8
            servers = client.stats()["servers"]
            assert sum(s["retires"] for s in servers.values()) == 2, servers   # one RETIRE per server

            r2 = SimpleNamespace(**{**vars(request), "request_id": "r2"})
            so.scheduled_new_reqs[0].req_id, so.num_scheduled_tokens = "r2", {"r2": len(prompt)}
            assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)
            (save2,) = sched.build_connector_meta(so).saves
            assert save2.ns_tag == namespace_tag(sched.keys.namespace) != save.ns_tag, save2

            pool[1].stop()                                   # a server that cannot apply the next retire
            sched.take_worker_meta(KVFabricWorkerMeta(WeightsReport({0: (0, "fp-b")})))
            assert wait_for(lambda: sched.counters.snapshot()["weights_retire_errors"] == 1, timeout_s=60), \
                sched.counters.snapshot()
            assert sched.counters.snapshot()["weights_retires"] == 1
        finally:
            sched.shutdown()
            client.close()
