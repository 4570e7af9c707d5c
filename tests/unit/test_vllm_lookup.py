"""The vLLM connector's two-stage lookup (scheduler.py ``_lookup_all_parts``, keys.py ``probe_parts``):
which keys the probe names, and, against a real server process, that a chunk still counts only
when every object of it is held.

The key selection needs no vLLM; the scheduler's test does (scheduler.py imports vLLM's metadata
class): run it with vLLM's interpreter (docs/notes/vllm.md, "Tests").
"""

from __future__ import annotations

import pytest

from kvfabric import Client, ConfigError
from kvfabric.testing.servers import start_server
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.keys import EngineKeys, prompt_keys
from kvfabric_vllm.layout import HeadSplit, chunk_object_keys, object_placement, part_group

CHUNK = 16


def _engine(servers: list[str], layers: int = 4, heads: int = 2, mla: bool = False, **extra) -> EngineKeys:
    return EngineKeys.for_model({"servers": servers, "chunk_tokens": CHUNK, **extra}, model="org/model",
                                dtype="torch.bfloat16", num_layers=layers, total_num_kv_heads=heads, head_size=8,
                                block_size=CHUNK, kv_cache_layout="LBNHC", use_mla=mla)


@pytest.mark.parametrize("heads, per_object, mla", [(8, 1, False), (8, 2, False), (2, 1, False), (1, 1, True)])
def test_probe_is_the_first_layer_of_every_object_column(heads, per_object, mla):
    e = _engine(["127.0.0.1:1"], layers=32, heads=heads, mla=mla, kv_heads_per_object=per_object)
    probe, parts = e.probe_parts(), e.parts()
    assert probe == [p for p in parts if p[0] == 0]
    assert len(probe) == (1 if mla else heads // per_object) and len(parts) == 32 * len(probe)
    pk = prompt_keys(e, list(range(5 * CHUNK)))
    full = pk.objects(e)[0]
    keys, place, groups = pk.objects(e, parts=probe)
    # the probe's keys are the full lookup's first-layer keys of every chunk, chunk-major
    assert keys == [k for c in range(5) for k in full[c * len(parts): c * len(parts) + len(probe)]]
    assert place == [pk.placement[c] for c in range(5) for _ in probe]
    assert groups == [pk.chunk_keys[c] for c in range(5) for _ in probe]


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_the_probe_names_every_group_any_tp_size_saves(heads):
    """A rank of any TP size saves its heads in every layer as one group: the probe holds one of its
    objects, so a chunk whose groups were stored by any mix of TP sizes is probed in each of them."""
    for tp in (t for t in (1, 2, 4, 8, 16) if heads % t == 0 or t % heads == 0):
        split = HeadSplit.for_model(heads, tp)
        probe_heads = {h for _, h in HeadSplit.for_model(heads, 1).parts(1)}
        for rank in range(tp):
            if split.saves(rank):
                assert probe_heads & set(split.heads(rank)), (heads, tp, rank)


def _put_chunks(c: Client, e: EngineKeys, pk, chunks: list[int], parts=None) -> None:
    """Store ``parts`` (default every part) of the given chunks as one TP=1 rank saves them: one group each."""
    parts = e.parts() if parts is None else parts
    ck = [pk.chunk_keys[i] for i in chunks]
    keys = chunk_object_keys(e.hasher, ck, parts)
    place, groups = object_placement(ck, [pk.placement[i] for i in chunks], len(parts),
                                     groups=[part_group(e.hasher, k, e.heads, 0) for k in ck])
    res = c.put(keys, [bytes([i % 251]) * 64 for i in range(len(keys))], placement=place, groups=groups)
    assert res.stored == len(keys), res


def _lookups(c: Client) -> int:
    """LOOKUP requests the (one, native) server served."""
    return sum(next(iter(c.stats()["servers"].values()))["lat_lookup_us_buckets"])


@pytest.mark.parametrize("probe", [True, False])
def test_a_chunk_counts_only_when_every_object_is_held(probe):
    pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    pytest.importorskip("vllm", reason="the scheduler imports vLLM")
    from kvfabric_vllm.metrics import Counters
    from kvfabric_vllm.scheduler import SchedulerSide

    with start_server(capacity="16MiB") as srv, Client([srv.address]) as c:
        extra = {"servers": [srv.address], "chunk_tokens": CHUNK, "lookup_probe": probe}
        e = _engine([srv.address])
        sched = SchedulerSide(parse_extra_config(extra, "kv_both", CHUNK), Client([srv.address]), e, CHUNK,
                              Counters(), lambda: None)
        try:
            pk = prompt_keys(e, list(range(6 * CHUNK)))
            lookup = lambda: sched._lookup_all_parts(pk.chunk_keys, 1000, pk.placement).count  # noqa: E731
            before = _lookups(c)
            assert lookup() == 0
            # nothing held: the probe finds nothing and no LOOKUP is sent (without the probe, one)
            assert _lookups(c) - before == (0 if probe else 1)
            _put_chunks(c, e, pk, [0, 1, 3, 4])
            assert lookup() == 2
            # chunk 2's first layer only (what the probe names), ungrouped: the probe passes it, the
            # LOOKUP of every object does not
            first = e.probe_parts()
            ck2 = chunk_object_keys(e.hasher, pk.chunk_keys[2:3], first)
            assert c.put(ck2, [b"x" * 64] * len(ck2), placement=[pk.placement[2]] * len(ck2)).stored == len(ck2)
            assert lookup() == 2
            rest = [p for p in e.parts() if p not in first]
            _put_chunks(c, e, pk, [2], parts=rest)
            assert lookup() == 5
            # one object of chunk 1 deleted: the server drops its group whole
            assert c.delete(chunk_object_keys(e.hasher, pk.chunk_keys[1:2], [(3, 1)]),
                            placement=[pk.placement[1]]) == len(e.parts())
            assert lookup() == 1
        finally:
            sched.shutdown()


def test_lookup_probe_setting():
    base = {"servers": ["127.0.0.1:1"], "chunk_tokens": CHUNK}
    assert parse_extra_config(base, "kv_both", CHUNK).lookup_probe is True
    assert parse_extra_config({**base, "lookup_probe": False}, "kv_both", CHUNK).lookup_probe is False
    with pytest.raises(ConfigError, match="lookup_probe"):
        parse_extra_config({**base, "lookup_probe": "no"}, "kv_both", CHUNK)
