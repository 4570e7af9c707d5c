"""The block-key spec: chained prefix hashes over token ids, bound to a namespace.

A prompt of tokens ``t`` cut into blocks of ``B = namespace.block_tokens``::

    ns      = H(canonical(namespace))
    key[0]  = H(ns       || le_u32(t[0:B]))
    key[i]  = H(key[i-1] || le_u32(t[iB:(i+1)B]))

so ``key[i]`` names block *i* together with its whole prefix. Only whole
blocks get keys.

Chunk keys (the second key mode, position-independent): a *chunk* is a unit
of content an engine can place anywhere in a prompt (a retrieved passage).
Its blocks are cut from the chunk's own start, and the chain starts from a
chunk namespace digest instead of the preceding prompt::

    cns      = H("kvfabric-chunk" || canonical(namespace))
    ckey[0]  = H(cns       || le_u32(c[0:B]))
    ckey[i]  = H(ckey[i-1] || le_u32(c[iB:(i+1)B]))

so ``ckey[i]`` names the chunk's first ``(i+1)B`` tokens wherever the chunk
sits. A chunk is closed content, so its trailing partial block gets a key too
(its shorter byte string is hashed as is; ``tail=False`` drops it). The
``"kvfabric-chunk"`` domain keeps chunk keys apart from prefix keys even for a
chunk at position 0: KV computed for a chunk alone is only reusable at another
position with a selective recompute (CacheBlend-style blending), never as a
prefix hit. Token ids are packed as little-endian unsigned 32-bit
integers whatever the host or the input type (list, numpy array, CPU tensor).

``H`` is one of:

* ``xxh3_128`` (default, fast): 16-byte keys, xxh3-128 seeded with the first
  8 bytes of ``blake2b(secret)``; with no secret the seed is 0. Fine for a
  trusted deployment; it is not collision resistant.
* ``blake3`` (needs the ``blake3`` package): 32-byte keys, keyed BLAKE3.
* ``sha256``: 32-byte keys, HMAC-SHA256. Use one of these two where tenants
  are untrusted: a crafted xxh3 collision would serve one tenant's KV to
  another.

The namespace binds everything that changes the bytes of the KV (model and
revision, dtype, layout, block size, parallel coordinates, LoRA, tenant,
extras); its canonical form is msgpack of the sorted field map plus the spec
version, so two processes agree on keys without sharing anything but config.
Nothing here depends on ``PYTHONHASHSEED`` or on an engine's own prefix hash.
Golden vectors in ``tests/unit/test_keys.py`` pin this spec.
"""

from __future__ import annotations

import array
import enum
import hashlib
import hmac
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NewType

import msgpack
import xxhash

from .errors import ConfigError

BlockKey = NewType("BlockKey", bytes)

KEY_SPEC_VERSION = 1
_SECRET_PERSON = b"kvfabric-key-v1"  # blake2b personalisation for secret derivation (<= 16 bytes)


class KeyAlgorithm(str, enum.Enum):
    XXH3_128 = "xxh3_128"
    BLAKE3 = "blake3"
    SHA256 = "sha256"

    @property
    def key_bytes(self) -> int:
        return 16 if self is KeyAlgorithm.XXH3_128 else 32


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a KV block, hashed into every key.

    ``extras`` holds anything else that must separate caches (multimodal
    inputs, a cache salt); its values must be msgpack scalars or nested
    lists/maps of them.
    """

    model: str
    revision: str = ""
    dtype: str = ""
    kv_layout: str = ""
    block_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    lora: str = ""
    tenant: str = ""
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("namespace.model must be a non-empty string")
        if type(self.block_tokens) is not int or not 1 <= self.block_tokens <= 1 << 20:
            raise ConfigError(f"namespace.block_tokens must be an int in 1..{1 << 20}, got {self.block_tokens!r}")
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError("namespace parallel coordinates out of range (need 0 <= rank < size)")
        if not all(isinstance(k, str) for k in self.extras):
            raise ConfigError("namespace.extras keys must be strings")

    def canonical(self) -> bytes:
        """The exact bytes hashed into the namespace digest (sorted msgpack map)."""
        fields = {
            "spec": KEY_SPEC_VERSION,
            "model": self.model,
            "revision": self.revision,
            "dtype": self.dtype,
            "kv_layout": self.kv_layout,
            "block_tokens": self.block_tokens,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "lora": self.lora,
            "tenant": self.tenant,
            "extras": _sorted(dict(self.extras)),
        }
        try:
            return msgpack.packb(_sorted(fields), use_bin_type=True)
        except TypeError as exc:
            raise ConfigError(f"namespace.extras holds a value msgpack cannot encode: {exc}") from exc


#: Bytes of a namespace tag (the wire's ``kvfabric.protocol.NS_TAG_BYTES``).
NS_TAG_BYTES = 16


def namespace_tag(namespace: Namespace | bytes) -> bytes:
    """The 16-byte tag a PUT carries (``Client.put(..., ns_tag=)``) and ``Client.retire`` retires
    (issue 27): a BLAKE2b digest of ``namespace``'s canonical bytes (a :class:`Namespace`) or of
    the given bytes (any other version label: weights fingerprint, policy step), under a label
    of its own so that it never equals a key or a namespace digest."""
    raw = namespace.canonical() if isinstance(namespace, Namespace) else namespace
    if not isinstance(raw, (bytes, bytearray)) or not raw:
        raise ConfigError("namespace_tag needs a Namespace or non-empty bytes")
    return hashlib.blake2b(bytes(raw), digest_size=NS_TAG_BYTES, person=b"kvfabric-nstag").digest()


def _sorted(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_sorted(v) for v in obj]
    return obj


def pack_tokens(tokens: Any) -> bytes:
    """Token ids as little-endian uint32 bytes.

    Accepts a list/tuple/range of ints, a numpy array or anything
    ``np.asarray`` takes (a CPU torch tensor). Raises ``ValueError`` for ids
    outside 0..2**32-1 and ``TypeError`` for non-integer input. Python
    sequences are packed with :mod:`array` (numpy is imported only for other
    inputs, which keeps it out of the server's import path).
    """
    if isinstance(tokens, (list, tuple, range)):
        try:
            packed = array.array("I", tokens)
        except OverflowError:
            raise ValueError("token ids must be in 0..2**32-1") from None
        except TypeError as exc:
            raise TypeError(f"token ids must be integers: {exc}") from None
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()
    import numpy as np

    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind == "i" or arr.dtype.itemsize > 4:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 0xFFFFFFFF:
            raise ValueError(f"token ids must be in 0..2**32-1, got range {lo}..{hi}")
    return arr.astype("<u4", copy=False).tobytes()


assert array.array("I").itemsize == 4, "kvfabric needs a 4-byte C unsigned int"


class KeyHasher:
    """Computes block keys for one algorithm and deployment secret.

    Thread-safe and cheap to share: it holds only the derived seed/key.
    Raises ConfigError for an unknown algorithm or a missing ``blake3`` module.
    """

    def __init__(self, algorithm: str | KeyAlgorithm = KeyAlgorithm.XXH3_128, secret: bytes | str = b"") -> None:
        try:
            self.algorithm = KeyAlgorithm(algorithm)
        except ValueError:
            raise ConfigError(
                f"unknown key algorithm {algorithm!r}; choose one of {[a.value for a in KeyAlgorithm]}"
            ) from None
        if isinstance(secret, str):
            secret = secret.encode()
        material = hashlib.blake2b(secret, digest_size=32, person=_SECRET_PERSON).digest()
        self.key_bytes = self.algorithm.key_bytes
        self._seed = int.from_bytes(material[:8], "little") if secret else 0
        self._mac_key = material
        if self.algorithm is KeyAlgorithm.BLAKE3:
            try:
                import blake3
            except ImportError:
                raise ConfigError("key algorithm 'blake3' needs the blake3 package (pip install kvfabric[secure])") from None
            self._blake3 = blake3.blake3

    def hash(self, *parts: bytes | memoryview) -> BlockKey:
        """H(parts[0] || parts[1] || ...) for this algorithm."""
        if self.algorithm is KeyAlgorithm.XXH3_128:
            h = xxhash.xxh3_128(seed=self._seed)
        elif self.algorithm is KeyAlgorithm.BLAKE3:
            h = self._blake3(key=self._mac_key)
        else:
            h = hmac.new(self._mac_key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return BlockKey(h.digest())

    def namespace_digest(self, namespace: Namespace) -> bytes:
        return self.hash(b"kvfabric-namespace", namespace.canonical())

    def chunk_namespace_digest(self, namespace: Namespace) -> bytes:
        return self.hash(b"kvfabric-chunk", namespace.canonical())

    def chunk_keys(self, namespace: Namespace, tokens: Any, *, tail: bool = True) -> list[BlockKey]:
        """Position-independent keys of a chunk's blocks, cut from the chunk's own start.

        The chain starts at :meth:`chunk_namespace_digest`, not at any prompt
        prefix, so the same chunk gets the same keys wherever it sits in a
        prompt. With ``tail`` (default) a trailing partial block gets a key.
        """
        data = pack_tokens(tokens)
        stride = 4 * namespace.block_tokens
        prev = self.chunk_namespace_digest(namespace)
        mv = memoryview(data)
        keys: list[BlockKey] = []
        end = len(data) if tail else len(data) // stride * stride
        for off in range(0, end, stride):
            prev = self.hash(prev, mv[off : min(off + stride, end)])
            keys.append(prev)
        return keys

    def prefix_keys(self, namespace: Namespace, tokens: Any, parent: bytes | None = None) -> list[BlockKey]:
        """Keys of every whole block of ``tokens`` (a trailing partial block gets none).

        ``parent`` continues an existing chain: pass the key of the block just
        before ``tokens[0]`` (``tokens`` must then start on a block boundary).
        """
        data = pack_tokens(tokens)
        stride = 4 * namespace.block_tokens
        n = len(data) // stride
        prev = self.namespace_digest(namespace) if parent is None else parent
        if parent is not None and len(parent) != self.key_bytes:
            raise ValueError(f"parent key must be {self.key_bytes} bytes, got {len(parent)}")
        mv = memoryview(data)
        keys: list[BlockKey] = []
        if self.algorithm is KeyAlgorithm.XXH3_128:
            # Hot path: the one-shot digest over prev||block is faster than a streaming object.
            digest = xxhash.xxh3_128_digest
            seed = self._seed
            for i in range(n):
                prev = digest(prev + mv[i * stride : (i + 1) * stride], seed)
                keys.append(BlockKey(prev))
            return keys
        for i in range(n):
            prev = self.hash(prev, mv[i * stride : (i + 1) * stride])
            keys.append(prev)
        return keys


def prefix_keys(
    namespace: Namespace,
    tokens: Any,
    *,
    algorithm: str | KeyAlgorithm = KeyAlgorithm.XXH3_128,
    secret: bytes | str = b"",
    parent: bytes | None = None,
) -> list[BlockKey]:
    """One-shot form of :meth:`KeyHasher.prefix_keys`."""
    return KeyHasher(algorithm, secret).prefix_keys(namespace, tokens, parent=parent)


def chunk_keys(
    namespace: Namespace,
    tokens: Any,
    *,
    algorithm: str | KeyAlgorithm = KeyAlgorithm.XXH3_128,
    secret: bytes | str = b"",
    tail: bool = True,
) -> list[BlockKey]:
    """One-shot form of :meth:`KeyHasher.chunk_keys`."""
    return KeyHasher(algorithm, secret).chunk_keys(namespace, tokens, tail=tail)


__all__ = ["BlockKey", "KeyAlgorithm", "Namespace", "KeyHasher", "chunk_keys", "pack_tokens", "prefix_keys",
           "KEY_SPEC_VERSION"]
