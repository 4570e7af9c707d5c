"""The vLLM connector's placement (connectors/kvfabric_vllm/layout.py, config ``segment_tokens``; issue 23).

No vLLM needed: layout and config import without it.
"""

from __future__ import annotations

import pytest

from kvfabric import ConfigError, KeyHasher
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.layout import DEFAULT_SEGMENT_TOKENS, chunk_major_layer_keys, chunk_placement, object_placement


def _keys(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


def test_segments_are_placed_by_their_first_chunk_key():
    k = _keys(7)
    assert chunk_placement(k, 3) == [k[0], k[0], k[0], k[3], k[3], k[3], k[6]]
    assert chunk_placement(k, 1) == k
    assert chunk_placement(k, 0) is None
    # a prompt's placement depends on its prefix only: a longer prompt places its first chunks alike
    assert chunk_placement(k[:5], 3) == chunk_placement(k, 3)[:5]
    with pytest.raises(ValueError):
        chunk_placement(k, -1)


def test_object_placement_is_chunk_major_like_the_keys():
    h = KeyHasher()
    k = _keys(3)
    objs = chunk_major_layer_keys(h, k, 4)
    place, groups = object_placement(k, chunk_placement(k, 2), 4)
    assert len(place) == len(groups) == len(objs) == 12
    assert place == [k[0]] * 8 + [k[2]] * 4
    assert groups == [k[0]] * 4 + [k[1]] * 4 + [k[2]] * 4
    assert object_placement(k, None, 4) == (None, None)
    with pytest.raises(ValueError):
        object_placement(k, k[:2], 4)


def test_segment_tokens_config():
    base = {"servers": ["127.0.0.1:1"]}
    cfg = parse_extra_config(base, "kv_both", 128)
    assert cfg.segment_chunks == DEFAULT_SEGMENT_TOKENS // 128
    assert parse_extra_config({**base, "segment_tokens": 0}, "kv_both", 128).segment_chunks == 0
    assert parse_extra_config({**base, "segment_tokens": 128}, "kv_both", 128).segment_chunks == 1
    # GPU block size 16: the default is still DEFAULT_SEGMENT_TOKENS tokens per segment
    assert parse_extra_config(base, "kv_both", 16).segment_chunks == DEFAULT_SEGMENT_TOKENS // 16
    # a chunk larger than the default segment: one chunk per segment
    assert parse_extra_config({**base, "chunk_tokens": 3 * DEFAULT_SEGMENT_TOKENS}, "kv_both", 128).segment_chunks == 1
    with pytest.raises(ConfigError, match="multiple of chunk_tokens"):
        parse_extra_config({**base, "segment_tokens": 200}, "kv_both", 128)


def test_replicas_default_to_two_with_three_servers(monkeypatch):
    monkeypatch.delenv("KVFABRIC_REPLICAS", raising=False)
    two, three = ["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert parse_extra_config({"servers": two}, "kv_both", 128).client.replicas == 1
    assert parse_extra_config({"servers": three}, "kv_both", 128).client.replicas == 2
    assert parse_extra_config({"servers": three, "replicas": 1}, "kv_both", 128).client.replicas == 1
    monkeypatch.setenv("KVFABRIC_REPLICAS", "1")
    assert parse_extra_config({"servers": three}, "kv_both", 128).client.replicas == 1
