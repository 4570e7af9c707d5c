"""The keys an engine derives from a prompt: one public function for the connector and for routers.

``prompt_keys(engine, token_ids, cache_salt=None) -> PromptKeys`` maps a
prompt's token ids to the chunk keys, placement keys and pool object keys a
loading engine looks up (``layout``, layout version 3). ``EngineKeys`` is
everything those keys depend on, built once per engine: by the connector from
vLLM's configuration (``connector``), or by anything else that must compute the
same keys without vLLM (a router choosing the engine that holds a prompt's
prefix) with ``EngineKeys.for_model`` from the connector's
``kv_connector_extra_config`` and the model's facts. No TP rank or size enters:
every engine of one model (any TP size) derives the same keys.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfabric import Client, KeyHasher, LookupRun, Namespace

from .config import (ConnectorConfig, kv_layout_name, make_namespace, parse_extra_config, request_namespace,
                     weights_fingerprint)
from .layout import HeadSplit, chunk_object_keys, chunk_placement, object_placement

__all__ = ["EngineKeys", "PromptKeys", "prompt_keys"]


@dataclass(frozen=True, eq=False)
class EngineKeys:
    """What an engine's keys depend on: namespace (model, dtype, KV layout, chunk size, tenant), key
    algorithm and secret, chunk and segment size, layers and KV heads (``layout.HeadSplit``)."""

    namespace: Namespace
    hasher: KeyHasher
    chunk_tokens: int
    segment_chunks: int
    n_layers: int
    heads: HeadSplit = field(default_factory=HeadSplit)

    @classmethod
    def from_config(cls, cfg: ConnectorConfig, namespace: Namespace, n_layers: int, heads: HeadSplit) -> EngineKeys:
        return cls(namespace, KeyHasher(cfg.client.key_algorithm, cfg.client.key_secret), cfg.chunk_tokens,
                   cfg.segment_chunks, n_layers, heads)

    @classmethod
    def for_model(cls, extra_config: Mapping[str, Any], *, model: str, dtype: str, num_layers: int,
                  total_num_kv_heads: int, head_size: int, block_size: int, head_size_v: int | None = None,
                  kv_cache_layout: str = "LBHNC", use_mla: bool = False, revision: str | None = None,
                  weights: str | None = None) -> EngineKeys:
        """The keys of engines started with ``kv_connector_extra_config = extra_config`` on ``model``,
        without vLLM. ``dtype`` as vLLM names the KV cache's (``"torch.bfloat16"``); ``block_size``,
        ``head_size(_v)``, ``kv_cache_layout`` as the engine's KV cache spec (the CPU backend: block 128,
        ``LBHNC``); ``total_num_kv_heads`` the model's (all ranks; any value with ``use_mla``);
        ``weights`` defaults to ``config.weights_fingerprint(model)`` (a local directory's)."""
        cfg = parse_extra_config(extra_config, "kv_both", block_size)
        split = HeadSplit.for_model(total_num_kv_heads, 1, mla=use_mla, per_object=cfg.kv_heads_per_object)
        layout = kv_layout_name(kv_cache_layout, num_kv_heads=split.total_heads, head_size=head_size,
                                head_size_v=head_size if head_size_v is None else head_size_v,
                                block_size=block_size, num_layers=num_layers, split_heads=split.split,
                                heads_per_object=split.per_object)
        ns = make_namespace(cfg, model=model, revision=revision, dtype=dtype, kv_layout=layout,
                            weights=weights_fingerprint(model) if weights is None else weights)
        return cls.from_config(cfg, ns, num_layers, split)

    def parts(self) -> list[tuple[int, int | None]]:
        """The ``(layer, head)`` objects of one chunk that an engine's ranks need together."""
        return self.heads.parts(self.n_layers)

    def probe_parts(self) -> list[tuple[int, int | None]]:
        """One object of each KV-head object column of a chunk: the first layer's (``parts()`` of layer
        0; unsplit: ``[(0, None)]``). Every group a rank of any TP size saves holds whole columns (its
        heads in every layer), so these name each group of the chunk whichever TP size saved it; a
        probe of them bounds the chunks held whole from above (``SchedulerSide``'s first stage), it
        does not prove a chunk whole: that takes every part (``parts``)."""
        return [p for p in self.parts() if p[0] == 0]


@dataclass(frozen=True)
class PromptKeys:
    """One prompt's keys (``prompt_keys``): per whole chunk its key and placement key (None: each
    object routed by its own key, ``segment_tokens`` 0)."""

    chunk_keys: list[bytes]
    placement: list[bytes] | None

    def objects(self, engine: EngineKeys, upto: int | None = None,
                parts: Sequence[tuple[int, int | None]] | None = None
                ) -> tuple[list[bytes], list[bytes] | None, list[bytes] | None]:
        """``(keys, placement, groups)`` for ``Client.lookup``/``exists`` of the first ``upto`` chunks
        (default all): every object an engine needs (``parts``, default ``engine.parts()``; or
        ``engine.probe_parts()``), chunk-major, each chunk one group, so the run the pool holds,
        divided by ``len(parts)``, is the chunks whose ``parts`` a loading engine finds."""
        ck = self.chunk_keys[:upto]
        parts = engine.parts() if parts is None else parts
        place, groups = object_placement(ck, None if self.placement is None else self.placement[:upto], len(parts))
        return chunk_object_keys(engine.hasher, ck, parts), place, groups

    def held_run(self, client: Client, engine: EngineKeys, *, timeout_s: float, lease_ms: int = 0,
                 probe: bool = True, media: bool = True) -> LookupRun:
        """Leading chunks the pool holds whole: every object (every layer and KV head) that an engine's
        ranks need together, each chunk one group routed by its placement key (one request per shard
        per stage); the whole call within ``timeout_s`` (KVFabricError past it or on failure).

        In two stages when ``probe`` (the connector's ``lookup_probe``): an EXISTS of one object per
        KV-head column of each chunk (``EngineKeys.probe_parts``: ``T / g`` keys a chunk, not
        ``L * T / g``) bounds the run from above, without leases or tier reads; then a LOOKUP of every
        object of only the chunks below that bound, with the lease (``lease_ms``), decides. A chunk
        still counts only when all its objects were found (the probe never adds one); what the probe
        saves is the keys (hashing, wire, server) of the chunks past the first one missing. The second
        stage is skipped when the probe finds nothing.

        Counted in chunks: ``LookupRun(chunks held, chunks with an object only on an SSD tier)``.
        ``media`` (:meth:`Client.lookup_media`): the servers read nothing from their SSD tier for
        the lookup and say which objects are there (``on_ssd`` None without it, or where the pool
        cannot say: replicas); without it they prefetch those objects into DRAM before answering."""
        deadline = time.monotonic() + timeout_s
        parts, probe_parts = engine.parts(), engine.probe_parts()
        upto = len(self.chunk_keys)
        if probe and len(probe_parts) < len(parts):
            objs, place, groups = self.objects(engine, parts=probe_parts)
            present = client.exists(objs, placement=place, groups=groups,
                                    timeout_s=max(0.001, deadline - time.monotonic()))
            upto = next((i for i, p in enumerate(present) if not p), len(objs)) // len(probe_parts)
            if not upto:
                return LookupRun(0, 0 if media else None)
        objs, place, groups = self.objects(engine, upto=upto)
        run = client.lookup_media(objs, lease_ms=lease_ms, placement=place, groups=groups,
                                  timeout_s=max(0.001, deadline - time.monotonic()), media=media)
        chunks = run.count // len(parts)
        if run.on_ssd is None:
            return LookupRun(chunks, None)
        # a chunk's objects are one group, tiered whole; a torn count still prices the chunk as SSD
        return LookupRun(chunks, min(chunks, -(-run.on_ssd // len(parts))))


def prompt_keys(engine: EngineKeys, token_ids: Sequence[int], cache_salt: str | None = None) -> PromptKeys:
    """The keys of ``token_ids``'s whole chunks as the engine's scheduler derives them (vLLM's
    per-request ``cache_salt`` bound as the connector binds it)."""
    n = len(token_ids) // engine.chunk_tokens
    keys = engine.hasher.prefix_keys(request_namespace(engine.namespace, cache_salt),
                                     token_ids[: n * engine.chunk_tokens])
    return PromptKeys(list(keys), chunk_placement(keys, engine.segment_chunks))
