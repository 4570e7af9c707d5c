"""Trace files: the JSON-lines request format of the public Mooncake traces.

One JSON object per line::

    {"timestamp": 1200, "input_length": 6758, "output_length": 500,
     "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival time in milliseconds, ``input_length`` and
``output_length`` are token counts, and ``hash_ids`` holds one id per block of
``block_tokens`` prompt tokens (512 in Mooncake's traces; the last block may be
partial). Equal ids mean equal content *including the whole prefix*, so an id
plays the role of a kvfabric block key. Optional fields that kvfabric's own
writers add and the loader keeps: ``block_tokens`` (the block size the ids were
cut with), ``tenant`` and ``session`` (strings), and ``chunks``: the
position-independent view of the prompt for chunk reuse (blending), a list of
``[start_token, tokens, [chunk ids...]]``, one per chunk (a retrieved passage)
in prompt order, not overlapping; a chunk's blocks are cut from its own start
(``ceil(tokens / block_tokens)`` ids, the last one possibly partial) and equal
chunk ids mean equal chunk content up to and including that block, wherever
the chunk sits (:meth:`kvfabric.keys.KeyHasher.chunk_keys`). Chunk ids live in
their own id space. Unknown fields are ignored.

The chain property every bound here relies on: equal ids mean equal content
including the whole prefix, so an id has the same parent (the id before it)
and the same depth in every request that holds it, and no id appears twice in
one request (likewise for chunk ids within their chunk). :func:`load_trace`
checks it and refuses a trace that breaks it; a trace with no block at all is
refused too (no hit rate can be computed from it).

Loading checks every line and raises :class:`TraceError` naming the file and
line for anything malformed: bad JSON, a missing or mistyped field, negative
numbers, a block count that cannot cover ``input_length``, or a line whose
``block_tokens`` disagrees with the caller's. Requests are returned sorted by
timestamp (stable, so equal timestamps keep file order).

Replay needs real keys for the ids: :func:`block_keys` maps ids to 16-byte
keys with xxh3-128 under a salt, so two replays with different salts never
see each other's blocks on shared servers.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

DEFAULT_BLOCK_TOKENS = 512
# A trace line longer than this is refused before it is parsed (a 100k-block
# prompt is ~1 MB of JSON); protects the loader from a garbage file.
MAX_LINE_BYTES = 8 << 20
MAX_BLOCKS_PER_REQUEST = 1 << 20

_BUNDLED = Path(__file__).resolve().parents[2] / "data" / "traces"
BUNDLED_TRACES = {
    "mooncake-conversation": _BUNDLED / "mooncake" / "conversation_trace.jsonl",
    "mooncake-synthetic": _BUNDLED / "mooncake" / "synthetic_trace.jsonl",
    # Real multi-document RAG (MuSiQue), converted by kvfabric.bench.ragdata; see data/rag/musique/README.md.
    "musique-b16": _BUNDLED.parent / "rag" / "musique" / "musique-b16.jsonl",
    "musique-b256": _BUNDLED.parent / "rag" / "musique" / "musique-b256.jsonl",
}


class TraceError(ValueError):
    """A trace file or record that does not follow the format; the message names the line."""


@dataclass(slots=True)
class Request:
    """One request of a trace. ``hash_ids`` has one id per (possibly partial) block."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    tenant: str = ""
    session: str = ""
    chunks: list[tuple[int, int, list[int]]] = field(default_factory=list)

    def block_tokens(self, i: int, block_tokens: int) -> int:
        """Prompt tokens in block ``i`` (the last block may be partial)."""
        if i < len(self.hash_ids) - 1:
            return block_tokens
        return max(0, min(block_tokens, self.input_length - i * block_tokens))

    def to_json(self, block_tokens: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "timestamp": self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        if block_tokens is not None:
            out["block_tokens"] = block_tokens
        if self.tenant:
            out["tenant"] = self.tenant
        if self.session:
            out["session"] = self.session
        if self.chunks:
            out["chunks"] = [[s, n, ids] for s, n, ids in self.chunks]
        return out


@dataclass(slots=True)
class Trace:
    """Requests in timestamp order plus the block size their ids were cut with."""

    requests: list[Request]
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    name: str = ""
    _stats: dict[str, int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @property
    def total_blocks(self) -> int:
        """Block accesses over all requests (the denominator of block hit rates)."""
        if "total" not in self._stats:
            self._stats["total"] = sum(len(r.hash_ids) for r in self.requests)
        return self._stats["total"]

    @property
    def unique_blocks(self) -> int:
        """Distinct block ids; capacities are given as a fraction of this."""
        if "unique" not in self._stats:
            seen: set[int] = set()
            for r in self.requests:
                seen.update(r.hash_ids)
            self._stats["unique"] = len(seen)
        return self._stats["unique"]

    @property
    def has_chunks(self) -> bool:
        return any(r.chunks for r in self.requests)

    @property
    def unique_chunk_blocks(self) -> int:
        """Distinct chunk ids (0 for a trace without chunks)."""
        if "unique_chunks" not in self._stats:
            seen: set[int] = set()
            for r in self.requests:
                for _, _, ids in r.chunks:
                    seen.update(ids)
            self._stats["unique_chunks"] = len(seen)
        return self._stats["unique_chunks"]

    @property
    def total_tokens(self) -> int:
        return sum(sum(r.block_tokens(i, self.block_tokens) for i in range(len(r.hash_ids))) for r in self.requests)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests as a new trace."""
        return Trace(self.requests[:n], self.block_tokens, self.name)


def parse_request(obj: Any, block_tokens: int, where: str = "record") -> Request:
    """Validate one decoded JSON object; raises :class:`TraceError` naming ``where``."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
    ints = {}
    for name in ("input_length", "output_length"):
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(f"{where}: {name} must be a non-negative int, got {v!r}")
        ints[name] = v
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"{where}: hash_ids must be a list of ints")
    if len(ids) > MAX_BLOCKS_PER_REQUEST:
        raise TraceError(f"{where}: {len(ids)} blocks exceeds the limit of {MAX_BLOCKS_PER_REQUEST}")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or h < 0 or h >= 1 << 64:
            raise TraceError(f"{where}: hash_ids must be ints in [0, 2**64), got {h!r}")
    bt = obj.get("block_tokens", block_tokens)
    if bt != block_tokens:
        raise TraceError(f"{where}: the trace says block_tokens={bt!r} but {block_tokens} was asked for")
    # Mooncake cuts ceil(input_length / B) blocks (the last partial); a
    # converter that keys whole blocks only gives floor(...). Accept both.
    lo, hi = ints["input_length"] // block_tokens, -(-ints["input_length"] // block_tokens)
    if not lo <= len(ids) <= hi:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids cannot be {ints['input_length']} tokens in blocks of {block_tokens}"
            f" (expected {lo}..{hi})"
        )
    tenant, session = obj.get("tenant", ""), obj.get("session", "")
    if not isinstance(tenant, str) or not isinstance(session, str):
        raise TraceError(f"{where}: tenant and session must be strings")
    chunks = _parse_chunks(obj.get("chunks", []), ints["input_length"], block_tokens, where)
    return Request(ts, ints["input_length"], ints["output_length"], ids, tenant, session, chunks)


def _parse_chunks(raw: Any, input_length: int, block_tokens: int, where: str) -> list[tuple[int, int, list[int]]]:
    if not isinstance(raw, list):
        raise TraceError(f"{where}: chunks must be a list of [start_token, tokens, [ids]]")
    out: list[tuple[int, int, list[int]]] = []
    end = 0
    for c in raw:
        if not (isinstance(c, list) and len(c) == 3 and isinstance(c[2], list)):
            raise TraceError(f"{where}: each chunk must be [start_token, tokens, [ids]], got {c!r:.80}")
        start, n, ids = c
        for v in (start, n):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TraceError(f"{where}: chunk start and length must be non-negative ints, got {v!r}")
        if n == 0 or start < end or start + n > input_length:
            raise TraceError(f"{where}: chunk [{start}, {start + n}) is empty, overlaps the previous one or runs past "
                             f"input_length {input_length}")
        if len(ids) != -(-n // block_tokens):
            raise TraceError(f"{where}: a chunk of {n} tokens has {len(ids)} ids, expected {-(-n // block_tokens)}")
        for h in ids:
            if isinstance(h, bool) or not isinstance(h, int) or h < 0 or h >= 1 << 64:
                raise TraceError(f"{where}: chunk ids must be ints in [0, 2**64), got {h!r}")
        out.append((start, n, ids))
        end = start + n
    return out


def check_chained(trace: Trace) -> None:
    """Raise :class:`TraceError` unless every id keeps one parent and one depth (and chunk ids likewise).

    This is what "equal ids mean equal content including the whole prefix"
    implies, and what Belady's bound (:mod:`kvfabric.bench.belady`) assumes.
    """
    seen: dict[int, tuple[int | None, int]] = {}
    cseen: dict[int, tuple[int | None, int, int]] = {}
    for i, r in enumerate(trace.requests):
        parent: int | None = None
        for d, h in enumerate(r.hash_ids):
            if seen.setdefault(h, (parent, d)) != (parent, d):
                p0, d0 = seen[h]
                raise TraceError(
                    f"{trace.name or 'trace'}: request {i} (timestamp {r.timestamp}) holds id {h} at depth {d} after "
                    f"{parent}, but an earlier request had it at depth {d0} after {p0}; ids must name whole prefixes "
                    f"(equal id = equal content including the prefix)")
            parent = h
        for start, n, ids in r.chunks:
            parent = None
            for d, h in enumerate(ids):
                # The tail block's length is part of its content.
                v = (parent, d, min(trace.block_tokens, n - d * trace.block_tokens))
                if cseen.setdefault(h, v) != v:
                    raise TraceError(f"{trace.name or 'trace'}: request {i} holds chunk id {h} with another parent, "
                                     f"depth or length than before; chunk ids must name a chunk's content up to that block")
                parent = h


def sniff_block_tokens(path: str | os.PathLike[str]) -> int | None:
    """The ``block_tokens`` field of the first line, or None when the trace does not say."""
    with open(path, "rb") as f:
        line = f.readline(MAX_LINE_BYTES + 1)
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    bt = obj.get("block_tokens") if isinstance(obj, dict) else None
    return bt if isinstance(bt, int) and not isinstance(bt, bool) and bt > 0 else None


def resolve_trace_path(name: str | os.PathLike[str]) -> Path:
    """A bundled trace name (``mooncake-conversation``, ``mooncake-synthetic``, ``musique-b16``, ...) or a path."""
    if isinstance(name, str) and name in BUNDLED_TRACES:
        return BUNDLED_TRACES[name]
    p = Path(name)
    if not p.is_file():
        raise TraceError(f"no trace file {str(p)!r} (bundled names: {', '.join(sorted(BUNDLED_TRACES))})")
    return p


def load_trace(
    path: str | os.PathLike[str],
    block_tokens: int | None = None,
    limit: int | None = None,
) -> Trace:
    """Read a trace file (or a bundled name); requests come back sorted by timestamp.

    ``block_tokens`` defaults to the file's own ``block_tokens`` field, else
    512 (Mooncake). ``limit`` keeps the first N lines. Raises
    :class:`TraceError` for a missing file or any malformed line, and for an
    empty trace.
    """
    p = resolve_trace_path(path)
    if block_tokens is None:
        block_tokens = sniff_block_tokens(p) or DEFAULT_BLOCK_TOKENS
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise TraceError(f"block_tokens must be a positive int, got {block_tokens!r}")
    with open(p, "rb") as f:
        reqs = list(_iter_lines(f, str(p), block_tokens, limit))
    if not reqs:
        raise TraceError(f"{p}: the trace holds no requests")
    reqs.sort(key=lambda r: r.timestamp)
    trace = Trace(reqs, block_tokens, p.stem)
    if trace.total_blocks == 0:
        raise TraceError(f"{p}: the trace's {len(reqs)} requests hold no blocks (input_length < block_tokens "
                         f"{block_tokens}?); there is no hit rate to compute")
    check_chained(trace)
    return trace


def _iter_lines(f: io.BufferedReader, name: str, block_tokens: int, limit: int | None) -> Iterator[Request]:
    n = 0
    for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
        if limit is not None and n >= limit:
            return
        if len(line) > MAX_LINE_BYTES:
            raise TraceError(f"{name}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise TraceError(f"{name}:{lineno}: not JSON: {e}") from None
        yield parse_request(obj, block_tokens, f"{name}:{lineno}")
        n += 1


def write_trace(path: str | os.PathLike[str], requests: Iterable[Request], block_tokens: int | None = None) -> int:
    """Write requests as JSON lines (with ``block_tokens`` on each line when given); returns the count."""
    n = 0
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(block_tokens), separators=(",", ":")))
            f.write("\n")
            n += 1
    os.replace(tmp, path)
    return n


def block_keys(ids: Sequence[int], salt: int = 0) -> list[bytes]:
    """16-byte pool keys for trace ids: ``xxh3_128(le_u64(id), seed=salt)``.

    Ids already stand for whole prefixes, so no chaining is needed; distinct
    ids get distinct keys (up to 128-bit collisions), equal ids equal keys.
    """
    h = xxhash.xxh3_128_digest
    pack = struct.Struct("<Q").pack
    return [h(pack(i), seed=salt) for i in ids]


def chunk_block_keys(ids: Sequence[int], salt: int = 0) -> list[bytes]:
    """16-byte pool keys for chunk ids: ``xxh3_128(b"chunk" || le_u64(id), seed=salt)``, apart from :func:`block_keys`."""
    h = xxhash.xxh3_128_digest
    pack = struct.Struct("<Q").pack
    return [h(b"chunk" + pack(i), seed=salt) for i in ids]


def main(argv: list[str] | None = None) -> int:
    """``kvfabric bench traces FILE...``: validate traces and print their sizes."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="kvfabric bench traces", description="Validate traces and print their sizes.")
    p.add_argument("traces", nargs="*", default=sorted(BUNDLED_TRACES), help="files or bundled names (default all bundled)")
    p.add_argument("--block-tokens", type=int, default=None)
    args = p.parse_args(argv)
    for name in args.traces:
        try:
            t = load_trace(name, args.block_tokens)
        except TraceError as e:
            print(f"kvfabric bench traces: {e}", file=sys.stderr)
            return 2
        span = (t.requests[-1].timestamp - t.requests[0].timestamp) / 1000.0
        print(f"{name}: {len(t)} requests over {span:.0f} s, {t.total_blocks} block accesses, "
              f"{t.unique_blocks} unique blocks of {t.block_tokens} tokens, {t.total_tokens} prompt tokens")
    return 0


__all__ = [
    "BUNDLED_TRACES",
    "DEFAULT_BLOCK_TOKENS",
    "Request",
    "Trace",
    "TraceError",
    "block_keys",
    "check_chained",
    "chunk_block_keys",
    "load_trace",
    "parse_request",
    "resolve_trace_path",
    "sniff_block_tokens",
    "write_trace",
]
