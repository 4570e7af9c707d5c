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

Placement (issue 23; ``config`` key ``segment_tokens``, default
``DEFAULT_SEGMENT_TOKENS``, which is ``M = segment_tokens // chunk_tokens``
chunks): the ``L`` objects of a chunk are one group,
routed by one placement key, so a chunk's layers live on one owner set (and
the same replicas) and the servers admit, evict and drop them as one unit:
a dead server costs only the chunks it owned, not (as when every layer object
was routed by its own key) nearly every chunk of every prompt. A prompt's
chunks are placed in *segments* of ``M = segment_chunks`` consecutive chunks
counted from chunk 0, each placed by the key of its first chunk::

    placement(c) = chunk_key[M * (c // M)]       group(c) = chunk_key[c]

so a prompt's leading run, which ends at the first chunk on a dead server,
is cut only at a segment boundary: with one of N servers dead a prompt keeps
on average about ``M * (N - 1)`` leading chunks instead of ``N - 1``. Every
process derives the same placement (it depends only on the prefix, like the
keys). ``M = 1`` places each chunk by its own key; ``segment_tokens = 0``
keeps the layout before issue 23 (each object routed by its own key, no
groups). The trade-offs (hit rate with a dead server, bytes per server, the
GET time of a long prompt) are measured by ``kvfabric bench placement``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric import KeyHasher

__all__ = ["LAYER_DOMAIN", "DEFAULT_SEGMENT_TOKENS", "layer_keys", "chunk_major_layer_keys", "chunk_placement",
           "object_placement"]

LAYER_DOMAIN = b"kvfabric-vllm-layer"
#: Prompt tokens per placement segment by default (see the module docstring and docs/notes/vllm.md).
DEFAULT_SEGMENT_TOKENS = 8192


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


def chunk_placement(chunk_keys: Sequence[bytes], segment_chunks: int) -> list[bytes] | None:
    """Per chunk of a prompt (``chunk_keys`` from chunk 0 on), the key its objects are placed by:
    its segment's first chunk key (module docstring); None when ``segment_chunks`` is 0 (each
    object routed by its own key)."""
    if segment_chunks == 0:
        return None
    if type(segment_chunks) is not int or segment_chunks < 0:
        raise ValueError(f"segment_chunks must be an int >= 0, got {segment_chunks!r}")
    return [chunk_keys[c - c % segment_chunks] for c in range(len(chunk_keys))]


def object_placement(chunk_keys: Sequence[bytes], placement: Sequence[bytes] | None,
                     n_layers: int) -> tuple[list[bytes] | None, list[bytes] | None]:
    """``(placement, groups)`` of the objects ``chunk_major_layer_keys(chunk_keys)`` lists, for
    ``Client.put/get_into/lookup``: each chunk's placement key and its own key (its group), repeated for
    its ``n_layers`` objects; ``(None, None)`` without placement."""
    if placement is None:
        return None, None
    if len(placement) != len(chunk_keys):
        raise ValueError(f"{len(chunk_keys)} chunks but {len(placement)} placement keys")
    return ([p for p in placement for _ in range(n_layers)], [k for k in chunk_keys for _ in range(n_layers)])
