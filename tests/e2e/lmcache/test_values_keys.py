"""The stored value format (header + chunk bytes) and the CacheEngineKey -> kvfabric key mapping."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from kvfabric import KeyHasher, Namespace
from kvfabric_lmcache import value
from kvfabric_lmcache.keymap import KeyMapper, chunk_hash_bytes
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

pytestmark = pytest.mark.lmcache


@pytest.fixture(scope="module")
def allocator():
    a = MixedMemoryAllocator(16 << 20)
    yield a
    a.close()


def _obj(allocator, tokens: int, dtype=torch.bfloat16, seed: int = 0):
    obj = allocator.allocate(torch.Size([2, 3, tokens, 32]), dtype, MemoryFormat.KV_2LTD)
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(dtype))
    return obj


@pytest.mark.parametrize("tokens", [256, 17])
def test_value_round_trip_keeps_shape_dtype_format_and_bytes(allocator, tokens: int) -> None:
    obj = _obj(allocator, tokens)
    try:
        buf = value.encode(obj)
        meta, payload = value.decode(bytes(buf))
        assert meta.fmt is MemoryFormat.KV_2LTD
        assert meta.shapes == [torch.Size([2, 3, tokens, 32])]
        assert meta.dtypes == [torch.bfloat16]
        assert meta.nbytes == obj.get_size() == len(payload)
        assert bytes(payload) == bytes(memoryview(obj.byte_array).cast("B"))
        assert len(buf) - len(payload) == value.HEADER_ALIGN  # the padded header the connector's scatter GET expects
        assert value.header_length(buf[:8]) == value.HEADER_ALIGN
        assert value.decode_header(buf[: value.HEADER_ALIGN], len(buf)).nbytes == obj.get_size()
    finally:
        obj.ref_count_down()


def _header(meta: dict, version: int = 1, magic: bytes = b"KFLC", pad: bytes = b"") -> bytes:
    m = msgpack.packb(meta)
    head = struct.pack("<4sBBH", magic, version, 0, len(m)) + m
    if version == 2:  # padded to 256 bytes; ``pad`` overwrites the padding's start
        head += pad + bytes(256 - len(head) - len(pad))
    return head


GOOD = {"fmt": MemoryFormat.KV_2LTD.value, "shapes": [[2, 1, 2, 2]], "dtypes": ["float16"], "nbytes": 16}


@pytest.mark.parametrize(
    "buf, match",
    [
        (b"KFL", "shorter than"),
        (_header(GOOD, magic=b"XXXX") + bytes(16), "bad magic"),
        (_header(GOOD, version=3) + bytes(16), "unsupported value version"),
        (_header(GOOD, version=2)[:100], "header of 256 bytes out of range"),
        (_header(GOOD, version=2, pad=b"\x01") + bytes(16), "padding is not zero"),
        (_header(GOOD, version=2) + bytes(15), "16 bytes but 15 follow"),
        (struct.pack("<4sBBH", b"KFLC", 1, 0, 4000) + bytes(16), "meta_len"),
        (struct.pack("<4sBBH", b"KFLC", 1, 0, 0), "meta_len"),
        (struct.pack("<4sBBH", b"KFLC", 1, 0, 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
        (_header({**GOOD, "extra": 1}) + bytes(16), "wrong fields"),
        (_header({**GOOD, "fmt": 999}) + bytes(16), "unknown memory format"),
        (_header({**GOOD, "dtypes": ["complex128"]}) + bytes(16), "bad shapes/dtypes"),
        (_header({**GOOD, "shapes": [[-1]]}) + bytes(16), "bad shapes/dtypes"),
        (_header({**GOOD, "shapes": [[1] * 9]}) + bytes(16), "bad shapes/dtypes"),
        (_header(GOOD) + bytes(15), "16 bytes but 15 follow"),
        (_header(GOOD) + bytes(17), "16 bytes but 17 follow"),
    ],
)
def test_value_decode_rejects_corrupt_or_foreign_objects(buf: bytes, match: str) -> None:
    with pytest.raises(value.ValueFormatError, match=match):
        value.decode(buf)


@pytest.mark.parametrize("version", [1, 2])
def test_value_decode_reads_both_versions(version: int) -> None:
    buf = _header(GOOD, version=version) + bytes(range(16))
    meta, payload = value.decode(buf)
    assert bytes(payload) == bytes(range(16)) and meta.nbytes == 16
    assert value.header_length(buf) == (len(buf) - 16)


def _key(**kw) -> CacheEngineKey:
    base = dict(model_name="org/model", world_size=2, worker_id=1, chunk_hash=0x1234ABCD, dtype=torch.float16)
    base.update(kw)
    return CacheEngineKey(**base)


def test_chunk_hash_encoding() -> None:
    assert chunk_hash_bytes(0) == (0, b"\x00")
    assert chunk_hash_bytes(255) == (0, b"\xff\x00")
    assert chunk_hash_bytes(-1) == (0, b"\xff")
    assert chunk_hash_bytes(b"\x01\x02") == (1, b"\x01\x02")
    with pytest.raises(TypeError):
        chunk_hash_bytes("abc")


def test_keys_are_deterministic_and_separate_every_field() -> None:
    m = KeyMapper(KeyHasher(), chunk_tokens=256)
    k = m(_key())
    assert len(k) == 16 and k == KeyMapper(KeyHasher(), chunk_tokens=256)(_key())
    variants = [
        _key(model_name="org/other"),
        _key(world_size=4),
        _key(worker_id=0),
        _key(chunk_hash=0x1234ABCE),
        _key(chunk_hash=-0x1234ABCD),
        _key(dtype=torch.bfloat16),
        _key(request_configs={"lmcache.tag.user": "alice"}),
        LayerCacheEngineKey(model_name="org/model", world_size=2, worker_id=1, chunk_hash=0x1234ABCD, dtype=torch.float16, layer_id=0),
    ]
    others = [m(v) for v in variants] + [KeyMapper(KeyHasher(), chunk_tokens=128)(_key()), KeyMapper(KeyHasher(secret=b"s"), 256)(_key())]
    assert len({k, *others}) == len(others) + 1


def test_tag_order_does_not_matter_and_strong_hashes_give_32_bytes() -> None:
    m = KeyMapper(KeyHasher(), chunk_tokens=256)
    a = _key(request_configs={"lmcache.tag.a": "1", "lmcache.tag.b": "2"})
    b = _key(request_configs={"lmcache.tag.b": "2", "lmcache.tag.a": "1"})
    assert m(a) == m(b)
    assert len(KeyMapper(KeyHasher("sha256"), 256)(a)) == 32


def test_key_follows_the_documented_spec_and_golden_vector() -> None:
    """Pins the mapping: stored pools stay readable across plugin versions (change KV_LAYOUT if this must move)."""
    hasher = KeyHasher()
    m = KeyMapper(hasher, chunk_tokens=256)
    k = m(_key())
    ns = Namespace(
        model="org/model", dtype="float16", kv_layout="lmcache-chunk-v1", block_tokens=256, tp_rank=1, tp_size=2,
        extras={"engine": "lmcache", "tags": []},
    )
    spec = hasher.hash(hasher.namespace_digest(ns), b"lmcache-chunk", b"\x00", (0x1234ABCD).to_bytes(4, "little", signed=True), struct.pack("<q", -1))
    assert k == spec
    assert k.hex() == "147a590c8fc11b5664a833e95a4caf93"
