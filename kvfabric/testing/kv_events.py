"""A subscriber to a pool server's KV events for tests and tools: every batch kept, the stream applied
to a view of what the server holds by medium (kvfabric/server/kv_events.py)."""

from __future__ import annotations

import threading
from typing import Any

from ..protocol.kv_events import END_SEQ, decode_batch, seq_bytes


class EventLog:
    """SUB socket on ``endpoint`` read by a thread: ``batches`` [(seq, events)] in arrival order, ``view``
    {medium: set of block hashes} after applying them (``AllBlocksCleared`` empties every medium)."""

    def __init__(self, endpoint: str, rcvhwm: int = 100_000) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.batches: list[tuple[int, list[dict[str, Any]]]] = []
        self.view: dict[str, set[bytes]] = {}
        self.raw: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            topic, seq, payload = self._sock.recv_multipart()
            _, events = decode_batch(payload)
            with self._lock:
                self.raw.append(payload)
                self.batches.append((int.from_bytes(seq, "big"), events))
                apply(self.view, events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)

    def snapshot(self) -> tuple[list[int], dict[str, set[bytes]]]:
        with self._lock:
            return [s for s, _ in self.batches], {m: set(v) for m, v in self.view.items()}

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e for _, evs in self.batches for e in evs]


def apply(view: dict[str, set[bytes]], events: list[dict[str, Any]]) -> None:
    for e in events:
        if e["type"] == "AllBlocksCleared":
            for s in view.values():
                s.clear()
        elif e["type"] == "BlockStored":
            view.setdefault(e["medium"], set()).update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            view.setdefault(e["medium"], set()).difference_update(e["block_hashes"])


def replay(endpoint: str, start_seq: int, timeout_ms: int = 30_000) -> list[tuple[int, bytes]]:
    """Ask a replay ROUTER for the batches from ``start_seq`` on (vLLM's protocol); [(seq, payload)]."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", seq_bytes(start_seq)))
        out = []
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"no replay answer from {endpoint} within {timeout_ms} ms (got {len(out)})")
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(0)


__all__ = ["EventLog", "apply", "replay"]
