"""The vLLM connector's TP-independent object layout (layout version 3, issue 23 part 4):
connectors/kvfabric_vllm/layout.py, keys.py. Golden vectors pin the keys: engines of every
kvfabric version that claims layout 3 must derive these exact bytes, or they stop sharing KV.

No vLLM needed: layout, keys and config import without it.
"""

from __future__ import annotations

import pytest

from kvfabric import ConfigError, KeyHasher
from kvfabric_vllm.config import KV_LAYOUT_VERSION, kv_layout_name
from kvfabric_vllm.keys import EngineKeys, PromptKeys, prompt_keys
from kvfabric_vllm.layout import (HEAD_DOMAIN, LAYER_DOMAIN, PART_DOMAIN, HeadSplit, chunk_major_layer_keys,
                                  chunk_object_keys, object_placement, part_group)

CHUNK_KEY = bytes(range(16))
SERVERS = {"servers": ["127.0.0.1:1"]}


def _le(n: int) -> bytes:
    return n.to_bytes(4, "little")


def test_layout_version_is_3():
    assert KV_LAYOUT_VERSION == 3


def test_object_keys_golden_vectors():
    h = KeyHasher()   # xxh3-128, no secret: the default
    head, whole = chunk_object_keys(h, [CHUNK_KEY], [(1, 3), (0, None)])
    assert head.hex() == "4f0aa57a7a154236a6f95ac5675d6304"
    assert whole.hex() == "d76f832a8195d7d6a3304d00627cff58"
    # the spec: H(chunk_key || domain || le_u32(layer) [|| le_u32(head)])
    assert head == h.hash(CHUNK_KEY, HEAD_DOMAIN, _le(1), _le(3))
    assert whole == h.hash(CHUNK_KEY, LAYER_DOMAIN, _le(0))
    # a whole-page object (MLA) is keyed as in layout 2
    assert chunk_object_keys(h, [CHUNK_KEY, CHUNK_KEY[::-1]], HeadSplit().parts(3)) == \
        chunk_major_layer_keys(h, [CHUNK_KEY, CHUNK_KEY[::-1]], 3)
    # the deployment's secret and algorithm apply
    assert chunk_object_keys(KeyHasher(secret=b"s"), [CHUNK_KEY], [(1, 3)])[0] != head
    assert len(chunk_object_keys(KeyHasher("sha256"), [CHUNK_KEY], [(1, 3)])[0]) == 32


def test_part_group_golden_vector():
    h = KeyHasher()
    g = part_group(h, CHUNK_KEY, HeadSplit(8, 2, True), 1)      # rank 1 of 2: heads 4..7
    assert g.hex() == "d08d9813734812335c3564db150a35c9"
    assert g == h.hash(CHUNK_KEY, PART_DOMAIN, _le(4), _le(8))
    # one group key per head range, whoever saves it: rank 1 of TP=2 and of a second TP=2 engine agree,
    # a TP=1 engine (heads 0..7) and rank 0 differ
    assert part_group(h, CHUNK_KEY, HeadSplit(8, 2, True), 0) != g
    assert part_group(h, CHUNK_KEY, HeadSplit(8, 1, True), 0) == h.hash(CHUNK_KEY, PART_DOMAIN, _le(0), _le(8))
    assert part_group(h, CHUNK_KEY, HeadSplit(), 0) == CHUNK_KEY   # whole pages: the chunk key, as in layout 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_ranks_of_any_tp_size_hold_every_head_once(tp):
    s = HeadSplit.for_model(8, tp)
    heads = [s.heads(r) for r in range(tp)]
    assert [h for hs in heads for h in hs] == list(range(8))            # disjoint, in rank order
    assert all(s.saves(r) for r in range(tp))
    parts = [p for r in range(tp) for p in s.parts(2, r)]
    assert sorted(parts) == sorted(s.parts(2))                           # together: what a lookup asks
    # so the object keys of a chunk are the same set whatever the TP size
    h = KeyHasher()
    assert set(chunk_object_keys(h, [CHUNK_KEY], parts)) == \
        set(chunk_object_keys(h, [CHUNK_KEY], HeadSplit.for_model(8, 1).parts(2)))


def test_rank_parts_are_layer_major():
    assert HeadSplit(4, 2, True).parts(2, 1) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert HeadSplit(4, 2, True).parts(2) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_replicated_heads_are_saved_by_their_first_rank_only():
    s = HeadSplit.for_model(2, 8)      # 2 KV heads, TP 8: vLLM gives 4 ranks a copy of each
    assert [s.heads(r) for r in range(8)] == [[0], [0], [0], [0], [1], [1], [1], [1]]
    assert [s.saves(r) for r in range(8)] == [True, False, False, False, True, False, False, False]


def test_mla_is_one_whole_page_per_layer_on_every_rank():
    s = HeadSplit.for_model(128, 4, mla=True)    # the model's heads do not matter: one latent
    assert not s.split and s.total_heads == 1
    assert all(s.heads(r) == [0] and s.parts(2, r) == [(0, None), (1, None)] for r in range(4))
    assert [s.saves(r) for r in range(4)] == [True, False, False, False]


def test_unsplittable_heads_are_refused():
    with pytest.raises(ConfigError, match="cannot be split"):
        HeadSplit.for_model(6, 4)
    with pytest.raises(ConfigError):
        HeadSplit.for_model(0, 1)
    with pytest.raises(ValueError):
        HeadSplit.for_model(8, 2).heads(2)


def test_kv_layout_name_binds_the_models_heads_and_the_split():
    assert kv_layout_name("LBHNC", num_kv_heads=8, head_size=128, head_size_v=128, block_size=128,
                          num_layers=32) == "vllm/LBHNC/heads=8/head=128/head_v=128/block=128/layers=32/per-head/v3"
    assert kv_layout_name("LBHNC", num_kv_heads=1, head_size=576, head_size_v=512, block_size=64, num_layers=2,
                          split_heads=False).endswith("/per-layer/v3")


def _engine(**kw) -> EngineKeys:
    args = dict(model="org/model", dtype="torch.bfloat16", num_layers=32, total_num_kv_heads=8, head_size=128,
                block_size=16, kv_cache_layout="LBNHC")
    return EngineKeys.for_model({**SERVERS, **kw.pop("extra", {})}, **{**args, **kw})


def test_prompt_keys_golden_vectors_and_no_tp_in_the_namespace():
    e = _engine()
    ns = e.namespace
    assert (ns.tp_rank, ns.tp_size) == (0, 1)     # the namespace's defaults: no engine's TP coordinates
    assert ns.kv_layout == "vllm/LBNHC/heads=8/head=128/head_v=128/block=16/layers=32/per-head/v3"
    pk = prompt_keys(e, list(range(40)))          # 2 whole chunks of 16 tokens; 8 tokens left over
    assert [k.hex() for k in pk.chunk_keys] == ["de863196b8e1a0effcf4f11350321d48",
                                                "40ecac296ee8c8a667c6df2e5db3b83b"]
    assert pk.placement == [pk.chunk_keys[0]] * 2  # one segment (8192 tokens by default)
    # a salt changes the keys; the same prompt under the same config does not
    assert prompt_keys(e, list(range(40)), "s").chunk_keys != pk.chunk_keys
    assert prompt_keys(_engine(), list(range(40))) == pk
    # segment_tokens 0: each object routed by its own key
    assert prompt_keys(_engine(extra={"segment_tokens": 0}), list(range(40))).placement is None


def test_lookup_objects_are_every_layer_and_head_chunk_major_one_group_per_chunk():
    e = _engine(num_layers=2, total_num_kv_heads=2)
    pk = prompt_keys(e, list(range(50)))       # 3 chunks
    keys, place, groups = pk.objects(e)
    assert len(keys) == 3 * 2 * 2 and keys[:4] == chunk_object_keys(e.hasher, pk.chunk_keys[:1], e.parts())
    assert place == [pk.chunk_keys[0]] * 12
    assert groups == [k for k in pk.chunk_keys for _ in range(4)]
    assert pk.objects(e, upto=1)[0] == keys[:4]
    assert PromptKeys(pk.chunk_keys, None).objects(e)[1:] == (None, None)


def test_object_placement_with_part_groups():
    k = [b"a" * 16, b"b" * 16]
    place, groups = object_placement(k, [k[0], k[0]], 2, groups=[b"g" * 16, b"h" * 16])
    assert place == [k[0]] * 4 and groups == [b"g" * 16] * 2 + [b"h" * 16] * 2
    with pytest.raises(ValueError, match="group keys"):
        object_placement(k, k, 2, groups=k[:1])


def test_heads_per_object_groups_consecutive_heads():
    s = HeadSplit.for_model(8, 2, per_object=2)      # ranks hold 4 heads: 2 objects per layer each
    assert s.parts(2, 1) == [(0, 4), (0, 6), (1, 4), (1, 6)]
    assert s.parts(1) == [(0, 0), (0, 2), (0, 4), (0, 6)]
    # the object of heads 4..5 has the key a one-head object of head 4 would have: the group size is
    # bound in the namespace's kv_layout instead, so engines of different sizes never share
    h = KeyHasher()
    assert chunk_object_keys(h, [CHUNK_KEY], s.parts(1))[2] == h.hash(CHUNK_KEY, HEAD_DOMAIN, _le(0), _le(4))
    assert kv_layout_name("LBHNC", num_kv_heads=8, head_size=128, head_size_v=128, block_size=16, num_layers=32,
                          heads_per_object=2).endswith("/heads-per-object=2/v3")
    e1, e2 = _engine(), _engine(extra={"kv_heads_per_object": 2})
    assert len(e2.parts()) == len(e1.parts()) // 2 == 128
    assert prompt_keys(e1, list(range(40))).chunk_keys != prompt_keys(e2, list(range(40))).chunk_keys
    # a rank holding fewer heads than an object (TP 8 of 8 heads) refuses to start
    with pytest.raises(ConfigError, match="kv_heads_per_object=2"):
        HeadSplit.for_model(8, 8, per_object=2)
    with pytest.raises(ConfigError, match="kv_heads_per_object=3"):
        _engine(extra={"kv_heads_per_object": 3})
    with pytest.raises(ConfigError, match="kv_heads_per_object=2"):   # replicated heads: one per object
        HeadSplit.for_model(2, 4, per_object=2)
    assert HeadSplit.for_model(8, 4, mla=True, per_object=2).parts(1) == [(0, None)]   # MLA: whole pages
