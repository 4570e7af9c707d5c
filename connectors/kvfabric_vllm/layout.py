"""Pool objects of one chunk: one per (chunk, layer, KV head), keyed from the chunk's prefix key.

Chunk object layout (``config.KV_LAYOUT_VERSION`` 3, issue 23 part 4: the same
objects whatever the TP size). Chunk ``c`` of a prompt is stored as ``L * T``
objects, one per layer ``l`` and KV head ``h`` of the model (``T`` its KV heads,
all ranks together), holding that head's share of the pages of the chunk's ``P
= chunk_tokens // block_size`` blocks::

    object(c, l, h) = kv_l[block 0 page][h] ++ ... ++ kv_l[block P-1 page][h]

where ``kv_l[block][h]`` is head ``h``'s ``[N, C]`` bytes of the block in vLLM's
per-layer view ``[B, H, N, C]`` (``pages``; on the CPU backend ``C`` holds K then
V of a token's head, and ``[h]`` is one contiguous run of the page, so a load
receives it in place). A TP rank holds ``T / tp`` heads (vLLM splits the KV heads
evenly: rank ``r`` holds heads ``r * T / tp ..``), so it saves and loads exactly its
heads' objects, and the bytes of ``object(c, l, h)`` do not depend on the TP size
that saved them: an engine of any TP size that divides ``T`` loads KV saved by an
engine of any other.

Granularity: one object per KV head is the finest split vLLM makes (a rank never
holds part of a head), so every TP size vLLM accepts for the model works, without
a setting that all engines sharing a pool would have to agree on. Cost: ``T`` times
the objects of layout 2 at ``1/T`` the size each (Llama-3-8B, 128-token chunks,
bf16: 32 x 8 = 256 objects of 64 KiB per chunk instead of 32 of 512 KiB); a
lookup names ``L * T`` keys per chunk and a rank's load ``L * T / tp``. A
deployment that runs only some TP sizes sets ``kv_heads_per_object = g`` (``g``
consecutive heads per object, ``h`` below the group's first head; ``g`` must
divide ``T / tp`` for each of its TP sizes, and is bound into the namespace's
``kv_layout``): ``L * T / g`` objects per chunk.

Where the heads cannot be split (``HeadSplit.split`` False), the object is the
whole page, one per (chunk, layer), keyed as in layout 2 (``layer_keys``):

* MLA: one latent "head" that every rank holds whole (the same bytes on every
  rank), so the objects are TP-independent already; rank 0 saves them, every
  rank loads them.
* ``T < tp`` (vLLM replicates KV heads: rank ``r`` holds head ``r * T // tp``):
  still one object per head; the ranks holding a copy of the same head load
  the same objects and only the first of them saves it.

Keys: ``key(c, l, h) = H(chunk_key[c] || "kvfabric-vllm-head" || le_u32(l) ||
le_u32(h))`` and, unsplit, ``key(c, l) = H(chunk_key[c] || "kvfabric-vllm-layer"
|| le_u32(l))``, with ``H`` the deployment's key algorithm and secret
(``KeyHasher.hash``), and ``chunk_key`` the chained prefix key of ``kvfabric.keys``
(its namespace binds model, dtype, KV layout with the model's total KV heads,
chunk size, tenant, salt, and **not** the TP rank or size). So object keys
inherit every property of the chain keys (prefix binding, secret, collision
resistance of the chosen algorithm) and every process of every engine derives
the same ones. Layers are in the model order vLLM lists them in; a chunk's
objects are listed layer-major, heads inside (``chunk_object_keys``).

Placement (issue 23; ``config`` key ``segment_tokens``, default
``DEFAULT_SEGMENT_TOKENS``, which is ``M = segment_tokens // chunk_tokens``
chunks): every object of a chunk, of every rank, is routed by one placement key,
so a chunk lives on one owner set (and the same replicas). A prompt's chunks
are placed in *segments* of ``M`` consecutive chunks counted from chunk 0, each
placed by the key of its first chunk::

    placement(c) = chunk_key[M * (c // M)]

so a prompt's leading run, which ends at the first chunk on a dead server,
is cut only at a segment boundary: with one of N servers dead a prompt keeps
on average about ``M * (N - 1)`` leading chunks instead of ``N - 1``. Every
process derives the same placement (it depends only on the prefix, like the
keys). ``M = 1`` places each chunk by its own key; ``segment_tokens = 0``
keeps the layout before issue 23 (each object routed by its own key, no
groups). The trade-offs (hit rate with a dead server, bytes per server, the
GET time of a long prompt) are measured by ``kvfabric bench placement``.

Groups (the server admits, evicts, tiers and drops a group whole): what one
rank saves of a chunk, its heads ``lo..hi-1`` in every layer, is one group named
``group = H(chunk_key[c] || "kvfabric-vllm-part" || le_u32(lo) || le_u32(hi))``
(unsplit: the chunk key). Each rank puts its own part in its own PUT frames, and
the server's groups are per frame, so two ranks naming one group key would make
two groups of one name (the SSD tier counts a group's records by name at a restart
and would then keep a torn part); a group key per head range names one set of
objects whoever saves it (two TP=2 ranks: two groups; a TP=1 engine: one group of
every head). A lookup counts a chunk only when every object the engine's ranks
need (every head, every layer) is present, whichever groups hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfabric import ConfigError, KeyHasher

__all__ = ["LAYER_DOMAIN", "HEAD_DOMAIN", "PART_DOMAIN", "DEFAULT_SEGMENT_TOKENS", "HeadSplit", "layer_keys",
           "chunk_major_layer_keys", "chunk_object_keys", "part_group", "chunk_placement", "object_placement"]

LAYER_DOMAIN = b"kvfabric-vllm-layer"
HEAD_DOMAIN = b"kvfabric-vllm-head"
PART_DOMAIN = b"kvfabric-vllm-part"
#: Prompt tokens per placement segment by default (see the module docstring and docs/notes/vllm.md).
DEFAULT_SEGMENT_TOKENS = 8192


@dataclass(frozen=True)
class HeadSplit:
    """Which KV heads' objects each TP rank of an engine holds (module docstring).

    ``total_heads``: the model's KV heads, all ranks together (1 for MLA);
    ``split`` False: one object per (chunk, layer), the whole page, that every
    rank holds (MLA). ``HeadSplit()`` is that for one rank: the layout-2 objects.
    ``per_object``: KV heads per object (``kv_heads_per_object``; 1: one per head).
    """

    total_heads: int = 1
    tp_size: int = 1
    split: bool = False
    per_object: int = 1

    def __post_init__(self) -> None:
        t, tp, g = self.total_heads, self.tp_size, self.per_object
        if any(type(v) is not int or v < 1 for v in (t, tp, g)):
            raise ConfigError(f"KV heads, TP size and KV heads per object must be positive ints, got {t!r}, "
                              f"{tp!r}, {g!r}")
        if not self.split:
            return
        if t % tp and tp % t:
            raise ConfigError(f"{t} KV heads cannot be split over tensor_parallel_size {tp} (neither divides "
                              "the other)")
        if max(1, t // tp) % g:
            raise ConfigError(f"kv_connector_extra_config.kv_heads_per_object={g} does not divide the "
                              f"{max(1, t // tp)} KV heads a rank holds at tensor_parallel_size {tp} ({t} heads); "
                              "use a value that divides the heads per rank of every TP size sharing the pool")

    @classmethod
    def for_model(cls, total_heads: int, tp_size: int, *, mla: bool = False, per_object: int = 1) -> HeadSplit:
        """The split vLLM makes: per head (``per_object`` heads per object), or (MLA) the whole latent
        page on every rank."""
        return cls(1, tp_size, False) if mla else cls(total_heads, tp_size, True, per_object)

    def heads(self, rank: int) -> list[int]:
        """Global KV head indices rank ``rank`` holds, in its page order ([0] unsplit: the page)."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside 0..{self.tp_size - 1}")
        if not self.split:
            return [0]
        t, tp = self.total_heads, self.tp_size
        if t >= tp:
            per = t // tp
            return list(range(rank * per, (rank + 1) * per))
        return [rank * t // tp]        # replicated: tp // t ranks hold a copy of each head

    def saves(self, rank: int) -> bool:
        """Whether rank ``rank`` saves its objects: the first rank holding a copy of its heads."""
        if not self.split:
            return rank == 0
        return self.total_heads >= self.tp_size or rank % (self.tp_size // self.total_heads) == 0

    def parts(self, n_layers: int, rank: int | None = None) -> list[tuple[int, int | None]]:
        """A chunk's objects as ``(layer, head)`` (head: the first of the object's ``per_object``
        heads; None: the whole page), layer-major: of rank ``rank``, or (None) every object of the
        chunk, what an engine's ranks need together."""
        if not self.split:
            return [(l, None) for l in range(n_layers)]
        heads = range(self.total_heads) if rank is None else self.heads(rank)
        return [(l, h) for l in range(n_layers) for h in heads if h % self.per_object == 0]


def chunk_object_keys(hasher: KeyHasher, chunk_keys: Sequence[bytes], parts: Sequence[tuple[int, int | None]]
                      ) -> list[bytes]:
    """The object keys of ``parts`` (``HeadSplit.parts``) of every chunk, chunk-major (the heads per
    object are bound in the namespace's ``kv_layout``, not here)."""
    tags = [(LAYER_DOMAIN, l.to_bytes(4, "little")) if h is None
            else (HEAD_DOMAIN, l.to_bytes(4, "little") + h.to_bytes(4, "little")) for l, h in parts]
    return [hasher.hash(k, d, t) for k in chunk_keys for d, t in tags]


def part_group(hasher: KeyHasher, chunk_key: bytes, split: HeadSplit, rank: int) -> bytes:
    """The group key of what rank ``rank`` saves of a chunk (module docstring): its head range's, or,
    unsplit, the chunk key."""
    if not split.split:
        return chunk_key
    heads = split.heads(rank)
    return hasher.hash(chunk_key, PART_DOMAIN, heads[0].to_bytes(4, "little"), (heads[-1] + 1).to_bytes(4, "little"))


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


def object_placement(chunk_keys: Sequence[bytes], placement: Sequence[bytes] | None, n_layers: int,
                     groups: Sequence[bytes] | None = None) -> tuple[list[bytes] | None, list[bytes] | None]:
    """``(placement, groups)`` of the objects ``chunk_major_layer_keys(chunk_keys)`` (or ``chunk_object_keys``
    with ``n_layers`` parts per chunk) lists, for ``Client.put/get_into/lookup``: each chunk's placement
    key and its group (``groups[c]``, default the chunk's own key), repeated for its ``n_layers``
    objects; ``(None, None)`` without placement."""
    if placement is None:
        return None, None
    if len(placement) != len(chunk_keys):
        raise ValueError(f"{len(chunk_keys)} chunks but {len(placement)} placement keys")
    groups = chunk_keys if groups is None else groups
    if len(groups) != len(chunk_keys):
        raise ValueError(f"{len(chunk_keys)} chunks but {len(groups)} group keys")
    return ([p for p in placement for _ in range(n_layers)], [g for g in groups for _ in range(n_layers)])
