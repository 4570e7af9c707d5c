"""vLLM's KV events -> which prompt prefixes each engine holds, keyed by kvfabric's own key spec.

A vLLM instance started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:PORT"}'`` publishes every change of its prefix cache on a ZMQ PUB
socket: multipart ``(topic, seq: 8-byte big-endian, payload)`` where the payload is msgpack of
vLLM's ``KVEventBatch`` (``vllm/distributed/kv_events.py``, vLLM 0.32): an array ``[ts, events,
dp_rank]``, each event a map tagged by ``"type"``:

* ``BlockStored``: ``block_hashes`` (the engine's hashes of ``n`` new blocks), ``parent_block_hash``
  (the engine hash of the block before the first of them, None at the start of a prompt),
  ``token_ids`` (the ``n * block_size`` tokens of those blocks), ``block_size``, ``medium``;
* ``BlockRemoved``: ``block_hashes`` (evicted);
* ``AllBlocksCleared``.

The engine's hashes are opaque to the router (and depend on the engine's hash function and its
seed): :class:`EngineIndex` recomputes each stored block's key with kvfabric's chained prefix key
(:meth:`kvfabric.keys.KeyHasher.prefix_keys`, continuing from the parent block's key), keeps a map
engine hash -> kvfabric key only to apply removals, and answers "how many leading blocks of this
prompt does the engine hold" by the prompt's own kvfabric keys. A store whose parent the index
never saw (events missed or evicted from the index) cannot be keyed and is counted
(``orphan_blocks``), never guessed. The index is bounded: at most ``max_entries`` blocks, the
oldest stored forgotten first (counted: ``forgotten``), which only makes the router under-predict
a hit.

:class:`Subscriber` is one thread per instance: a SUB socket with a bounded receive queue
(``RCVHWM``), polled with a timeout so that it stops within ``POLL_S``; a dead or silent publisher
only leaves the index as it was (ZMQ reconnects by itself), and a gap in the sequence numbers is
counted (``seq_gaps``): events lost (the publisher's high-water mark, a restart) leave stale or
missing entries, i.e. a wrong prediction, never a wrong answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..keys import KeyHasher, Namespace
from ..protocol.kv_events import MAX_PAYLOAD_BYTES, EventError, decode_batch

log = logging.getLogger("kvfabric.route.events")

POLL_S = 0.2                       # a subscriber checks its stop flag this often
DEFAULT_MAX_ENTRIES = 1 << 18      # blocks per instance (~40 MiB of index at most)
RCVHWM = 10_000                    # batches queued in ZMQ before it drops (the publisher's side re-sends none)
MAX_BLOCK_TOKENS = 1 << 16


class EngineIndex:
    """One engine's prefix-cache residency in kvfabric keys (module docstring). Thread-safe."""

    def __init__(self, hasher: KeyHasher, namespace: Namespace, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if type(max_entries) is not int or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.hasher, self.namespace, self.max_entries = hasher, namespace, max_entries
        self.block_size: int | None = None           # learned from the first BlockStored
        self._lock = threading.Lock()
        self._by_hash: OrderedDict[Any, bytes] = OrderedDict()   # engine hash -> kvfabric key, oldest first
        self._keys: dict[bytes, int] = {}            # kvfabric key -> engine hashes naming it
        self.counts = {"stored": 0, "removed": 0, "cleared": 0, "orphan_blocks": 0, "forgotten": 0,
                       "bad_events": 0}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_hash)

    def apply(self, events: Sequence[dict[str, Any]]) -> None:
        """Apply decoded events in order; a malformed one is counted (``bad_events``) and skipped."""
        for e in events:
            try:
                kind = e.get("type")
                if kind == "BlockStored":
                    self._stored(e)
                elif kind == "BlockRemoved":
                    self._removed(e["block_hashes"])
                elif kind == "AllBlocksCleared":
                    with self._lock:
                        self._by_hash.clear()
                        self._keys.clear()
                        self.counts["cleared"] += 1
                else:
                    raise EventError(f"unknown event type {kind!r}")
            except (KeyError, TypeError, ValueError) as exc:
                with self._lock:
                    self.counts["bad_events"] += 1
                log.debug("bad KV event %r: %s", str(e)[:200], exc)

    def _ns(self, block_size: int) -> Namespace:
        return replace(self.namespace, block_tokens=block_size)

    def _stored(self, e: dict[str, Any]) -> None:
        hashes, parent, tokens, bs = e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"]
        if type(bs) is not int or not 1 <= bs <= MAX_BLOCK_TOKENS or len(tokens) != bs * len(hashes):
            raise EventError(f"BlockStored of {len(hashes)} blocks, {len(tokens)} tokens, block_size {bs!r}")
        if e.get("lora_name") or e.get("lora_id") or any(x for x in (e.get("extra_keys") or ())):
            # LoRA, multimodal inputs or a cache salt change the KV of the same tokens: such blocks are
            # not the plain prompt's, and requests are keyed without them here
            with self._lock:
                self.counts["orphan_blocks"] += len(hashes)
            return
        with self._lock:
            parent_key = None if parent is None else self._by_hash.get(parent)
            if parent is not None and parent_key is None:
                self.counts["orphan_blocks"] += len(hashes)
                return
        keys = self.hasher.prefix_keys(self._ns(bs), tokens, parent=parent_key)   # outside the lock: hashing
        with self._lock:
            self.block_size = bs
            for h, k in zip(hashes, keys):
                if h in self._by_hash:
                    self._by_hash.move_to_end(h)
                    continue
                self._by_hash[h] = k
                self._keys[k] = self._keys.get(k, 0) + 1
                self.counts["stored"] += 1
            while len(self._by_hash) > self.max_entries:
                _, k = self._by_hash.popitem(last=False)
                self._drop_key(k)
                self.counts["forgotten"] += 1

    def _drop_key(self, k: bytes) -> None:
        n = self._keys.get(k, 0) - 1
        if n > 0:
            self._keys[k] = n
        else:
            self._keys.pop(k, None)

    def _removed(self, hashes: Sequence[Any]) -> None:
        with self._lock:
            for h in hashes:
                k = self._by_hash.pop(h, None)
                if k is not None:
                    self._drop_key(k)
                    self.counts["removed"] += 1

    def prompt_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The kvfabric keys of the prompt's whole engine blocks ([] before the block size is known)."""
        bs = self.block_size
        return [] if bs is None else self.hasher.prefix_keys(self._ns(bs), tokens)

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's block keys, in order) the engine holds from the first on."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._keys:
                    break
                n += 1
        return n

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Leading prompt tokens in the engine's prefix cache, by the events seen so far."""
        bs = self.block_size
        return 0 if bs is None else self.leading(self.prompt_keys(tokens)) * bs

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts, entries=len(self._by_hash), block_size=self.block_size or 0)


class Subscriber:
    """A thread feeding one instance's KV events from ``endpoint`` into ``index`` (module docstring)."""

    def __init__(self, endpoint: str, index: EngineIndex, topic: str = "") -> None:
        import zmq   # the 'route' extra (pyzmq); vLLM's own environment has it

        self.endpoint, self.index, self.topic = endpoint, index, topic
        self._zmq = zmq
        self._stop = threading.Event()
        self.last_seq: int | None = None
        self.last_event_s: float | None = None        # time.monotonic() of the last batch
        self.counts = {"batches": 0, "seq_gaps": 0, "bad_batches": 0}
        self._thread = threading.Thread(target=self._run, name=f"kvf-route-events {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.connect(self.endpoint)
            while not self._stop.is_set():
                if not sock.poll(int(POLL_S * 1000)):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                self._handle(frames)
        except Exception:   # noqa: BLE001 - the router goes on without this instance's events
            log.exception("KV event subscriber for %s stopped", self.endpoint)
        finally:
            sock.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["bad_batches"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.counts["seq_gaps"] += 1
        self.last_seq = seq
        try:
            _, events = decode_batch(frames[2])
        except EventError as exc:
            self.counts["bad_batches"] += 1
            log.debug("bad KV event batch from %s: %s", self.endpoint, exc)
            return
        self.index.apply(events)
        self.counts["batches"] += 1
        self.last_event_s = time.monotonic()

    def stop(self, timeout_s: float = 2 * POLL_S + 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def snapshot(self) -> dict[str, Any]:
        return dict(self.counts, endpoint=self.endpoint, last_seq=self.last_seq,
                    since_last_event_s=None if self.last_event_s is None else time.monotonic() - self.last_event_s)


__all__ = ["DEFAULT_MAX_ENTRIES", "EngineIndex", "EventError", "Subscriber", "decode_batch"]
