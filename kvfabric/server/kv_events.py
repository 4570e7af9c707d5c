"""A pool server's KV events: what it holds, published in vLLM's KV-events format (issue 26 part 1).

``kvfabric serve --kv-events tcp://127.0.0.1:PORT`` binds a ZMQ PUB socket there (``PORT`` ``*``: one
the system picks, logged) and publishes every
arrival and departure of the server's objects, by medium, as vLLM's ``KVEventBatch`` (wire format:
:mod:`kvfabric.protocol.kv_events`), so that a consumer of vLLM's events (llm-d's indexer, Dynamo's
router, ``kvfabric route``) can index the pool as one more medium. ``--kv-events-replay
tcp://127.0.0.1:PORT2`` adds vLLM's replay ROUTER socket: a subscriber that saw a gap in the
sequence numbers asks for the batches from a sequence number on.

What is published:

* ``BlockStored(medium="DRAM")`` when an object is indexed in the arena (a PUT committed, a promotion
  from SSD), ``BlockRemoved(medium="DRAM")`` when it leaves it (evicted, deleted, retired, replaced);
* ``BlockStored(medium="SSD")`` when its record on the SSD tier is written (or found by the start-up
  scan), ``BlockRemoved(medium="SSD")`` when the record leaves the tier's index (its segment reused,
  deleted, corrupt, retired). An eviction to SSD is thus a DRAM removal followed, once the write lands,
  by an SSD store: the tier move;
* ``AllBlocksCleared`` when this server's view of itself was lost (below): a consumer forgets every
  block of this server, then learns them again as they are stored.

The block hash is the object's key, or for a group (issue 23: a placement group, e.g. one vLLM chunk
of every layer) the group key, once: a group is stored on a medium when all its parts are, and removed
from it when the first part goes. ``token_ids`` is empty and ``block_size`` 0 (the pool never sees
tokens); a consumer computes the keys of a prompt with kvfabric's key spec (``kvfabric route`` does).
``parent_block_hash`` is the PUT's parent for an ungrouped object (None otherwise). The shared tier is
not published: its files are written and removed by every server and by operators, so no server knows
what it holds.

Never slows the data plane: the C loop records events in bounded rings (the store's, which the
eviction policy reads too, and the SSD tier's, ``--kv-events-ring`` entries) drained by the control
thread, which hands them to this publisher's own thread through a bounded queue (``--kv-events-ring``
events too); the ZMQ PUB socket drops messages for a subscriber whose queue (``hwm`` batches, 256) is full
rather than wait for it, and replies to replay requests are sent without waiting too. So a
subscriber that connects and never reads costs at most :func:`subscriber_bytes` (16 MiB); ZMQ's PUB
socket has no cap on how many may connect, so bind loopback or an ``ipc://`` path in a directory
only the pool's users can reach. When a ring or
the queue was full, events were lost: the publisher sends ``AllBlocksCleared`` (counted ``resets``)
and forgets its SSD group counts, so that a consumer under-predicts (misses what was stored before),
never over-predicts a removed block from a lost removal. The replay buffer keeps at most
``buffer_steps`` batches and ``buffer_bytes`` bytes. What all this can hold is :func:`kv_events_bytes`
(~124 MiB at the defaults), counted in the server's start-up memory check.

Counters (``kv_events`` in :meth:`NativeServer.stats`, ``kvfabric_kv_events_total{kind}`` on the
metrics port): ``batches``, ``events`` (published), ``resets``, ``lost`` (events dropped before
publication: a full ring or queue), ``replays`` (requests served), ``bad_replays``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..protocol.kv_events import (END_SEQ, MEDIUM_DRAM, MEDIUM_SSD, all_blocks_cleared, block_removed,
                                  block_stored, encode_batch, seq_bytes)

log = logging.getLogger("kvfabric.server.kv_events")

DEFAULT_RING = 65536          # SSD tier events kept in C, and events queued for the publisher thread
DEFAULT_BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
DEFAULT_BUFFER_BYTES = 16 << 20
DEFAULT_HWM = 256             # batches ZMQ queues per subscriber before it drops (vLLM's: 100,000)
MAX_RING = 1 << 22            # KVF_TIER_EVENTS_MAX (csrc/kvf_tier.h)
MAX_BATCH = 256               # events per published batch: < 64 KiB of msgpack (keys are at most 64 bytes)
BATCH_BYTES_MAX = 64 << 10
POLL_S = 0.05                 # the publisher thread's wake-up period (replay requests, stop)

# store events (csrc/kvf_store.h enum kvf_event_type; the eviction policy reads them too, native.py)
# and SSD events (csrc/kvf_tier.h)
EV_INSERT, EV_ACCESS, EV_REMOVE = 1, 2, 3
TIER_STORED, TIER_REMOVED = 1, 2

# memory (kvfabric/server/memory.py counts it in the start-up check)
TIER_EVENT_BYTES = 152        # sizeof(struct kvf_tier_event): the SSD ring in C
PY_EVENT_BYTES = 512          # one event held in Python (drained, translated or queued), generously
BATCH_OVERHEAD_BYTES = 256    # one replay-buffer entry besides its payload


def kv_events_bytes(ring: int, store_ring: int, buffer_steps: int = DEFAULT_BUFFER_STEPS,
                    buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> int:
    """Bytes of DRAM the publisher holds at most: the SSD ring, a round's drained events (the SSD ring's
    and the store's, ``store_ring``: NativeServer's EVENT_RING), the queue to the publisher thread, the
    replay buffer. Computed from the bounds, not measured; the SSD group counts (one entry per group
    with a part on SSD) come on top, like the index's."""
    return (ring * (TIER_EVENT_BYTES + 2 * PY_EVENT_BYTES) + store_ring * PY_EVENT_BYTES
            + buffer_bytes + buffer_steps * BATCH_OVERHEAD_BYTES)


def subscriber_bytes(hwm: int = DEFAULT_HWM) -> int:
    """Bytes ZMQ may queue for one connected subscriber (or replay requester) that does not read: ``hwm``
    batches of at most BATCH_BYTES_MAX (16 MiB at the defaults), the kernel's socket buffers aside."""
    return hwm * BATCH_BYTES_MAX


def check_endpoint(flag: str, endpoint: str) -> str:
    """A ZMQ endpoint to bind: ``tcp://HOST:PORT`` or ``ipc://PATH``; ConfigError otherwise."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) < 7:
        raise ConfigError(f"{flag} must be a ZMQ endpoint to bind, tcp://HOST:PORT or ipc://PATH; got {endpoint!r}")
    return endpoint


class _SsdGroups:
    """Which groups are whole on the SSD tier, from its per-object events (control thread only).

    A group's objects carry its hash (``ghash``) on every event and its key on a store: per group the
    key, the parts it stated and how many are indexed. Bounded by the tier's own index (one entry per
    group with a part on SSD)."""

    def __init__(self) -> None:
        self.groups: dict[int, list[Any]] = {}   # ghash -> [gkey, gparts, parts indexed, published]

    def apply(self, kind: int, key: bytes, gkey: bytes | None, gparts: int, ghash: int,
              out: list[tuple[bool, str, bytes, bytes | None]]) -> None:
        if not ghash:
            out.append((kind == TIER_STORED, MEDIUM_SSD, key, None))
            return
        g = self.groups.get(ghash)
        if kind == TIER_STORED:
            if g is None:
                if gkey is None:
                    return
                g = self.groups[ghash] = [gkey, max(1, gparts), 0, False]
            g[2] += 1
            if not g[3] and g[2] >= g[1]:
                g[3] = True
                out.append((True, MEDIUM_SSD, g[0], None))
        elif g is not None:
            g[2] -= 1
            if g[3] and g[2] < g[1]:
                g[3] = False
                out.append((False, MEDIUM_SSD, g[0], None))
            if g[2] <= 0:
                del self.groups[ghash]


class PoolEvents:
    """The publisher (module docstring). ``round`` is called by the control thread with what it
    drained; everything ZMQ runs on this object's thread. ``start`` binds (ConfigError when it
    cannot), ``stop`` joins."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 ring: int = DEFAULT_RING, buffer_steps: int = DEFAULT_BUFFER_STEPS,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, hwm: int = DEFAULT_HWM) -> None:
        try:
            import zmq  # noqa: F401 - checked here: the server does not start without it
        except ImportError as e:
            raise ConfigError(f"--kv-events needs pyzmq (pip install 'kvfabric[events]'): {e}") from None
        self.endpoint = check_endpoint("--kv-events", endpoint)
        self.replay_endpoint = (check_endpoint("--kv-events-replay", replay_endpoint)
                                if replay_endpoint is not None else None)
        for name, v in (("--kv-events-ring", ring), ("buffer_steps", buffer_steps), ("buffer_bytes", buffer_bytes),
                        ("hwm", hwm)):
            if type(v) is not int or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        if ring > MAX_RING:
            raise ConfigError(f"--kv-events-ring must be at most {MAX_RING}, got {ring}")
        self.topic = topic.encode()
        self.ring, self.buffer_steps, self.buffer_bytes, self.hwm = ring, buffer_steps, buffer_bytes, hwm
        self._ssd = _SsdGroups()
        self._cv = threading.Condition()
        self._queue: deque[tuple[bool, str, bytes, bytes | None]] = deque()
        self._lost = False
        self._stop = False
        self._store_dropped = 0
        self._tier_dropped = 0
        self.counts = {"batches": 0, "events": 0, "resets": 0, "lost": 0, "replays": 0, "bad_replays": 0}
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control thread side

    def round(self, dram: Sequence[tuple[int, bytes, int, bytes | None, bytes | None]], dram_dropped: int,
              ssd: Sequence[tuple[int, bytes, int, bytes | None, int, int]], ssd_dropped: int) -> None:
        """One round of the control thread: the store events it drained (``(kind, key, size, parent,
        group)``) with the store's count of events dropped ever (read before the drain), and the SSD
        tier's (``(kind, key, size, gkey, gparts, ghash)``, drained before the store's) with its count;
        queued in that order, at once. A count that changed since the last round means events were
        lost: the round's events are not published (they may be older than the lost ones: a removal
        among those would leave a consumer a stale block) and a reset is; after an SSD loss the group
        counts are forgotten too (a part's removal may be among the lost). What came after the loss is
        published from the next round on."""
        lost = dram_dropped != self._store_dropped or ssd_dropped != self._tier_dropped
        if ssd_dropped != self._tier_dropped:
            self._ssd = _SsdGroups()
        self._store_dropped, self._tier_dropped = dram_dropped, ssd_dropped
        out: list[tuple[bool, str, bytes, bytes | None]] = []
        if not lost:
            for kind, key, _size, parent, group in dram:
                if kind == EV_INSERT:
                    out.append((True, MEDIUM_DRAM, group or key, None if group else parent))
                elif kind == EV_REMOVE:
                    out.append((False, MEDIUM_DRAM, group or key, None))
            for kind, key, _size, gkey, gparts, ghash in ssd:
                self._ssd.apply(kind, key, gkey, gparts, ghash, out)
        self._put(out, lost=lost)

    def _put(self, out: list[tuple[bool, str, bytes, bytes | None]], lost: bool) -> None:
        if not out and not lost:
            return
        with self._cv:
            if not lost and len(self._queue) + len(out) > self.ring:
                self.counts["lost"] += len(out)
                lost, out = True, []
            if lost:   # what is queued is older than the loss: the AllBlocksCleared covers it
                self.counts["lost"] += len(self._queue)
                self._queue.clear()
                self._lost = True
            self._queue.extend(out)
            self._cv.notify()

    # ------------------------------------------------------------------ publisher thread

    def start(self) -> PoolEvents:
        self._thread = threading.Thread(target=self._run, name="kvf-kv-events", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._thread.join()
            raise ConfigError(f"--kv-events: cannot bind: {self._bind_error}") from self._bind_error
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(10)

    def snapshot(self) -> dict[str, int]:
        with self._cv:
            return dict(self.counts)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)   # tcp://HOST:* names the port picked
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, self.hwm)
                replay.setsockopt(zmq.RCVHWM, 64)
                replay.setsockopt(zmq.MAXMSGSIZE, 64)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._bind_error = e
            pub.close(0)
            if replay is not None:
                replay.close(0)
            self._bound.set()
            return
        self._bound.set()
        log.info("KV events: publishing on %s%s", self.endpoint,
                 f", replay on {self.replay_endpoint}" if replay is not None else "")
        buffer: deque[tuple[int, bytes]] = deque()
        buffered = 0
        seq = 0
        try:
            while True:
                with self._cv:
                    if not self._queue and not self._lost and not self._stop:
                        self._cv.wait(POLL_S)
                    stopping = self._stop
                    reset, self._lost = self._lost, False
                    if reset:
                        self.counts["resets"] += 1
                    n = min(len(self._queue), MAX_BATCH)
                    items = [self._queue.popleft() for _ in range(n)]
                if replay is not None:
                    self._serve_replays(replay, buffer)
                if reset or items:
                    events = [all_blocks_cleared()] if reset else []
                    events.extend(block_stored([h], m, parent=p) if stored else block_removed([h], m)
                                  for stored, m, h, p in items)
                    payload = encode_batch(time.time(), events)
                    buffer.append((seq, payload))   # counted and kept before it is sent: a subscriber that
                    buffered += len(payload)        # received batch N finds N counted and replayable
                    while len(buffer) > self.buffer_steps or (buffered > self.buffer_bytes and len(buffer) > 1):
                        buffered -= len(buffer.popleft()[1])
                    with self._cv:
                        self.counts["batches"] += 1
                        self.counts["events"] += len(events)
                    try:
                        pub.send_multipart((self.topic, seq_bytes(seq), payload), zmq.NOBLOCK)
                    except zmq.Again:
                        pass   # no subscriber can take it now: it stays in the replay buffer
                    seq += 1
                    continue
                if stopping:
                    return
        except Exception:   # noqa: BLE001 - the server goes on without events; said once
            log.exception("KV events publisher stopped")
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _serve_replays(self, replay: Any, buffer: deque[tuple[int, bytes]]) -> None:
        """Answer the replay requests waiting now (vLLM's protocol, module docstring of the format)."""
        import zmq

        for _ in range(16):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                with self._cv:
                    self.counts["bad_replays"] += 1
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            with self._cv:   # counted before the answer goes out: whoever got it sees it counted
                self.counts["replays"] += 1
            try:
                for s, payload in list(buffer):
                    if s >= start:
                        replay.send_multipart((ident, b"", self.topic, seq_bytes(s), payload), zmq.NOBLOCK)
                replay.send_multipart((ident, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.Again:
                pass   # that subscriber does not read: its answer is cut, it asks again


__all__ = ["DEFAULT_RING", "PoolEvents", "check_endpoint", "kv_events_bytes", "subscriber_bytes"]
