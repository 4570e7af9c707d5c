"""Pool objects of one chunk: one per (chunk, layer), keyed from the chunk's prefix key.

Chunk object layout (``config.KV_LAYOUT_VERSION`` 2): for one TP rank, chunk
``c`` of a prompt is stored as ``L`` objects, one per layer ``l``, holding the
pages of the chunk's ``P = chunk_tokens // block_size`` blocks in that layer::

    object(c, l) = kv_l[block 0 page] ++ kv_l[block 1 page] ++ ... ++ kv_l[block P-1 page]

where a page is ``kv_l[block_id]``, one block's ``[H, N, C]`` bytes in vLLM's
per-layer view (contiguous; on the CPU backend ``C`` holds K then V). With the
default chunk (one vLLM block, ``P == 1``) an object is exactly one page, so a
load receives it straight into the paged KV cache and nothing is staged.

Keys: ``key(c, l) = H(chunk_key[c] || "kvfabric-vllm-layer" || le_u32(l))``,
with ``H`` the deployment's key algorithm and secret (``KeyHasher.hash``), and
``chunk_key`` the chained prefix key of ``kvfabric.keys`` (its namespace binds
model, dtype, KV layout, chunk size, TP rank/size, tenant, salt). So layer
keys inherit every property of the chain keys (prefix binding, secret,
collision resistance of the chosen algorithm) and every process derives the
same ones. Layers are in the model order vLLM lists them in.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric import KeyHasher

__all__ = ["LAYER_DOMAIN", "layer_keys", "chunk_major_layer_keys"]

LAYER_DOMAIN = b"kvfabric-vllm-layer"


def layer_keys(hasher: KeyHasher, chunk_key: bytes, n_layers: int) -> list[bytes]:
    """The ``n_layers`` object keys of one chunk, layer order."""
    return [hasher.hash(chunk_key, LAYER_DOMAIN, l.to_bytes(4, "little")) for l in range(n_layers)]


def chunk_major_layer_keys(hasher: KeyHasher, chunk_keys: Sequence[bytes], n_layers: int) -> list[bytes]:
    """Every object key of ``chunk_keys``, chunk-major: ``[c0 l0, c0 l1, ..., c1 l0, ...]``.

    In this order the longest run the pool holds, divided by ``n_layers``, is
    the number of leading chunks held whole (every layer).
    """
    out: list[bytes] = []
    for k in chunk_keys:
        out.extend(layer_keys(hasher, k, n_layers))
    return out
