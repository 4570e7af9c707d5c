"""vLLM's KV-events wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): the one place kvfabric
encodes or decodes it. A pool server publishes its objects' arrivals and departures in it
(``kvfabric serve --kv-events``, :mod:`kvfabric.server.kv_events`); ``kvfabric route`` reads vLLM
instances' prefix caches in it (:mod:`kvfabric.route.events`).

ZMQ multipart message on a PUB socket: ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian
unsigned counter per publisher (from 0), ``payload`` msgpack of a ``KVEventBatch``: an array
``[ts, events]`` (vLLM adds ``data_parallel_rank`` when it has one), each event a map tagged by
``"type"``:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name`` (every field without a default in vLLM's class is written);
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``.

Replay (vLLM's ``ZmqEventPublisher``): a ROUTER socket; a subscriber sends ``(b"", start_seq)``
(8 bytes big-endian) from a DEALER/REQ socket and gets every buffered batch with ``seq >= start_seq``
as ``(b"", topic, seq, payload)``, then ``(b"", b"", END_SEQ, b"")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

MAX_PAYLOAD_BYTES = 64 << 20       # one event batch; a reader drops larger ones
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# what a pool server names its media (vLLM's own engines say "GPU" and "CPU")
MEDIUM_DRAM = "DRAM"
MEDIUM_SSD = "SSD"


class EventError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def block_stored(hashes: Sequence[bytes | int], medium: str | None, *, parent: bytes | int | None = None,
                 token_ids: Sequence[int] = (), block_size: int = 0) -> dict[str, Any]:
    """A ``BlockStored`` event (a pool object has no tokens: ``token_ids`` empty, ``block_size`` 0)."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None}


def block_removed(hashes: Sequence[bytes | int], medium: str | None) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[dict[str, Any]]) -> bytes:
    """msgpack of a ``KVEventBatch`` ``[ts, events]``."""
    return msgpack.packb([float(ts), list(events)], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """``(ts, events)`` of one msgpack ``KVEventBatch``; EventError when it is not one."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventError(f"event batch of {len(payload)} bytes (limit {MAX_PAYLOAD_BYTES})")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventError(f"not msgpack: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise EventError(f"not a KVEventBatch [ts, events, ...]: {type(batch).__name__}")
    events = [e for e in batch[1] if isinstance(e, dict)]
    if len(events) != len(batch[1]):
        raise EventError("an event is not a map (vLLM 0.32 encodes each as a map tagged by 'type')")
    return float(batch[0]), events


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


__all__ = ["END_SEQ", "MAX_PAYLOAD_BYTES", "MEDIUM_DRAM", "MEDIUM_SSD", "EventError", "all_blocks_cleared",
           "block_removed", "block_stored", "decode_batch", "encode_batch", "seq_bytes"]
