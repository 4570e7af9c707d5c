"""LMCache ``CacheEngineKey`` -> kvfabric block key, deterministically, in its own namespace.

LMCache names a chunk by (model, world size, worker id, chunk hash, dtype,
tags); layerwise mode adds a layer id. The chunk hash already chains the
whole token prefix (LMCache computes it), so kvfabric does not re-hash tokens
here; it binds the rest of the key into a kvfabric :class:`~kvfabric.Namespace`
and hashes the chunk hash under it::

    ns   = Namespace(model=model_name, dtype=<dtype name>, kv_layout="lmcache-chunk-v1",
                     block_tokens=chunk_size, tp_rank=worker_id, tp_size=world_size,
                     extras={"engine": "lmcache", "tags": [[k, v], ...]})
    key  = H(H_ns(ns) || "lmcache-chunk" || u8(kind) || chunk_hash bytes || i64le(layer_id or -1))

with ``H`` the deployment's key algorithm and secret (``ClientConfig.key_algorithm``,
``key_secret``), so keys are 16 bytes (xxh3_128) or 32 (blake3, sha256). An
integer chunk hash is encoded as its minimal little-endian two's complement
(``kind`` 0); a bytes chunk hash as is (``kind`` 1). The ``kv_layout`` tag
keeps these keys apart from keys of kvfabric's own connectors even for the
same model, because the stored objects differ (this plugin's values carry a
header, see :mod:`kvfabric_lmcache.value`).

Placement (issue 23): what LMCache stores per chunk is one object per
(chunk, TP worker) holding every layer, or, with ``use_layerwise``, one per
(chunk, layer) (``LayerCacheEngineKey``), put layer by layer and looked up
all layers of one chunk at once. A chunk's objects are routed by one
placement key, the chunk's whole-chunk key (layer -1): :meth:`KeyMapper.placement`,
so the layers of one chunk live on one owner set and a lookup of them is one
request. A whole-chunk object is placed by its own key, as before.

Nothing here depends on ``PYTHONHASHSEED``; but LMCache's own chunk hash does
when its ``pre_caching_hash_algorithm`` is ``builtin`` without vLLM installed,
so engines sharing a pool across processes must pin that (see the notes).
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from kvfabric import BlockKey, KeyHasher, Namespace
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey

KV_LAYOUT = "lmcache-chunk-v1"
_CHUNK_TAG = b"lmcache-chunk"
_KIND_INT = 0
_KIND_BYTES = 1
_MAX_CACHED_NAMESPACES = 1024


def chunk_hash_bytes(chunk_hash: Any) -> tuple[int, bytes]:
    """(kind, canonical bytes) of an LMCache chunk hash. TypeError for other types."""
    if isinstance(chunk_hash, bool):
        raise TypeError("chunk_hash must be int or bytes, got bool")
    if isinstance(chunk_hash, int):
        n = chunk_hash
        return _KIND_INT, n.to_bytes(max(1, (n.bit_length() + 8) // 8), "little", signed=True)
    if isinstance(chunk_hash, (bytes, bytearray, memoryview)):
        return _KIND_BYTES, bytes(chunk_hash)
    raise TypeError(f"chunk_hash must be int or bytes, got {type(chunk_hash).__name__}")


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"`` (the name after ``torch.``)."""
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


class KeyMapper:
    """Maps CacheEngineKeys to kvfabric keys; thread-safe, caches namespace digests.

    ``chunk_tokens`` is LMCache's ``chunk_size`` (it changes what a chunk holds,
    so it is part of the namespace).
    """

    def __init__(self, hasher: KeyHasher, chunk_tokens: int) -> None:
        if type(chunk_tokens) is not int or chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        self.hasher = hasher
        self.chunk_tokens = chunk_tokens
        self._digests: dict[tuple, bytes] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _tags(key: CacheEngineKey) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((str(k), str(v)) for k, v in (key.tags or ())))

    def namespace(self, key: CacheEngineKey) -> Namespace:
        """The kvfabric namespace of one LMCache key (everything but the chunk hash and layer)."""
        tags = [list(t) for t in self._tags(key)]
        return Namespace(
            model=key.model_name,
            dtype=dtype_name(key.dtype),
            kv_layout=KV_LAYOUT,
            block_tokens=self.chunk_tokens,
            tp_rank=key.worker_id,
            tp_size=key.world_size,
            extras={"engine": "lmcache", "tags": tags},
        )

    def _digest(self, key: CacheEngineKey) -> bytes:
        ident = (key.model_name, key.world_size, key.worker_id, dtype_name(key.dtype), self._tags(key))
        d = self._digests.get(ident)
        if d is None:
            d = self.hasher.namespace_digest(self.namespace(key))
            with self._lock:
                if len(self._digests) >= _MAX_CACHED_NAMESPACES:
                    self._digests.clear()
                self._digests[ident] = d
        return d

    def __call__(self, key: CacheEngineKey) -> BlockKey:
        """The kvfabric key of ``key``; TypeError for a key that is not a CacheEngineKey."""
        if not isinstance(key, CacheEngineKey):
            raise TypeError(f"expected an LMCache CacheEngineKey, got {type(key).__name__}")
        return self._key(key, key.layer_id if isinstance(key, LayerCacheEngineKey) else -1)

    def _key(self, key: CacheEngineKey, layer: int) -> BlockKey:
        kind, body = chunk_hash_bytes(key.chunk_hash)
        return self.hasher.hash(self._digest(key), _CHUNK_TAG, bytes((kind,)), body, struct.pack("<q", layer))

    def many(self, keys: list[CacheEngineKey]) -> list[BlockKey]:
        return [self(k) for k in keys]

    def placement(self, keys: list[CacheEngineKey]) -> list[BlockKey] | None:
        """Per key, the placement key of its chunk (the whole-chunk key, the same for every layer of one
        chunk), for ``Client``'s ``placement=``; None when no key is a per-layer key (a whole-chunk
        object is placed by its own key, so nothing changes)."""
        if not any(isinstance(k, LayerCacheEngineKey) for k in keys):
            return None
        return [self._key(k, -1) for k in keys]


__all__ = ["KV_LAYOUT", "KeyMapper", "chunk_hash_bytes", "dtype_name"]
