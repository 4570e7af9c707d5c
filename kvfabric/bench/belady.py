"""The offline bound: Belady's MIN over a trace, and the infinite-capacity hit rate.

Model (shared with :mod:`kvfabric.bench.simulate`): requests are processed
in trace order; a request's *prefix hit* is the number of leading blocks held
when it arrives (a block counts only if every earlier block of the request
also hit); then every block of the request is used, and the missing ones are
inserted.

MIN with bypass: the cache holds at most ``capacity`` blocks; after each
insertion over capacity it drops the block whose next use lies farthest in
the future (possibly the one just inserted, i.e. it is not admitted). Ties go
to the deeper block (later in its request), and blocks never used again go
first.

Why this is the bound for *prefix* hits too: a block's parent is in every
request that holds the block, so the parent's next use is never later than
the child's; with the depth tie-break MIN never holds a block without its
parent (of the same request), so every block MIN finds is also a prefix hit.
MIN maximises plain hits over all policies with the same capacity (uniform
block sizes), and no policy's prefix hits exceed its plain hits; so no policy
gets more prefix hits than MIN. ``tests/unit/test_belady.py`` checks it
against an exhaustive search on small traces. The argument needs the chain
property (an id has one parent and one depth; no id twice in a request):
:func:`kvfabric.bench.traces.load_trace` refuses traces that break it
(:func:`~kvfabric.bench.traces.check_chained`), since on such a trace MIN can
fall below LRU.

Cost: O(total blocks x log capacity) time, O(total blocks) memory for the
next-use table.

Chunk reuse (traces with ``chunks``, see :mod:`kvfabric.bench.traces`): in the
*prefix+chunk* key mode the pool holds prefix-keyed blocks and, for every
passage, its position-independent chunk-keyed blocks. A request's *chunk hit*
(:class:`ChunkCount`) is the part of its passages that the pool holds under
chunk keys (the leading run of each passage's chunk ids) and that its prefix
hit does not already cover: KV an engine could reuse only by blending it in
at a new position with a selective recompute (CacheBlend), never a loadable
prefix hit, so it is counted apart. :func:`infinite_chunks` and
:func:`belady_chunks` give the infinite and MIN references for that mode;
MIN there maximises hits over both key streams together, which is not a
proven bound on the chunk level (a chunk hit under the prefix hit does not
count), so it is reported as a reference.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .traces import Request, Trace

NEVER = 1 << 62
CHUNK_ID_BASE = 1 << 64  # chunk ids are offset by this wherever they share a table with prefix ids


@dataclass(slots=True)
class HitCount:
    """Prefix hits of one run over a trace: blocks and tokens, totals and per request."""

    hit_blocks: int = 0
    total_blocks: int = 0
    hit_tokens: int = 0
    total_tokens: int = 0
    runs: list[int] = field(default_factory=list)

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    def add(self, trace: Trace, req_index: int, run: int) -> None:
        r = trace.requests[req_index]
        bt = trace.block_tokens
        n = len(r.hash_ids)
        self.runs.append(run)
        self.hit_blocks += run
        self.total_blocks += n
        full = min(run, n - 1) * bt if n else 0
        self.hit_tokens += full + (r.block_tokens(n - 1, bt) if run == n and n else 0)
        self.total_tokens += (n - 1) * bt + r.block_tokens(n - 1, bt) if n else 0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "hit_blocks": self.hit_blocks,
            "total_blocks": self.total_blocks,
            "block_hit_rate": self.block_hit_rate,
            "hit_tokens": self.hit_tokens,
            "total_tokens": self.total_tokens,
            "token_hit_rate": self.token_hit_rate,
        }


@dataclass(slots=True)
class ChunkCount:
    """Chunk hits beyond the prefix hit ("reusable with blending"), over the same totals as :class:`HitCount`.

    Blocks: chunk blocks (cut from a passage's start) of which at least one
    token lies beyond the prefix hit; tokens: exactly the tokens beyond it.
    Rates are over the trace's prompt blocks and tokens, so a request's prefix
    and chunk token rates add up to at most 100%.
    """

    hit_blocks: int = 0
    total_blocks: int = 0
    hit_tokens: int = 0
    total_tokens: int = 0
    chunk_tokens: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    def add(self, trace: Trace, req_index: int, prefix_run: int, chunk_runs: list[int]) -> None:
        r = trace.requests[req_index]
        self.add_blocks(trace, req_index, chunk_hit_blocks(r, trace.block_tokens, prefix_run, chunk_runs))

    def add_blocks(self, trace: Trace, req_index: int, hits: list[tuple[int, int, int]]) -> None:
        """Count request ``req_index`` with the given ``(chunk, block, tokens beyond the prefix)`` hits."""
        r = trace.requests[req_index]
        bt = trace.block_tokens
        n = len(r.hash_ids)
        self.total_blocks += n
        self.total_tokens += (n - 1) * bt + r.block_tokens(n - 1, bt) if n else 0
        self.chunk_tokens += sum(c[1] for c in r.chunks)
        self.hit_blocks += len(hits)
        self.hit_tokens += sum(h[2] for h in hits)

    def as_dict(self) -> dict[str, float | int]:
        return {"hit_blocks": self.hit_blocks, "total_blocks": self.total_blocks, "block_hit_rate": self.block_hit_rate,
                "hit_tokens": self.hit_tokens, "total_tokens": self.total_tokens, "token_hit_rate": self.token_hit_rate,
                "chunk_tokens": self.chunk_tokens}


def prefix_hit_tokens(r: Request, block_tokens: int, run: int) -> int:
    """Prompt tokens covered by a prefix hit of ``run`` blocks."""
    return min(run * block_tokens, r.input_length) if run else 0


def chunk_hit_blocks(r: Request, block_tokens: int, prefix_run: int, chunk_runs: list[int]) -> list[tuple[int, int, int]]:
    """``(chunk index, block index in the chunk, tokens beyond the prefix hit)`` of every chunk hit worth loading.

    ``chunk_runs[c]`` is how many leading blocks of chunk ``c`` the pool holds
    under chunk keys; of those, the blocks with at least one token past the
    prefix hit count. Tokens are counted only inside the prompt's blocks
    (a converted trace keys whole blocks only, so the tokens after its last
    whole block are in no rate's denominator either).
    """
    end = prefix_hit_tokens(r, block_tokens, prefix_run)
    limit = min(r.input_length, len(r.hash_ids) * block_tokens)
    out = []
    for c, ((start, n, _), run) in enumerate(zip(r.chunks, chunk_runs)):
        for j in range(run):
            s, e = start + j * block_tokens, min(start + min((j + 1) * block_tokens, n), limit)
            if e > end and e > s:
                out.append((c, j, e - max(s, end)))
    return out


def _run_of(ids: list[int], held) -> int:
    run = 0
    for h in ids:
        if h not in held:
            break
        run += 1
    return run


def chunk_stream(r: Request) -> list[int]:
    """The request's prefix ids then its chunk ids (offset by ``CHUNK_ID_BASE``): what a prefix+chunk pool sees."""
    out = list(r.hash_ids)
    for _, _, ids in r.chunks:
        out.extend(CHUNK_ID_BASE + h for h in ids)
    return out


def infinite_chunks(trace: Trace) -> tuple[HitCount, ChunkCount]:
    """Prefix and chunk hits of a prefix+chunk pool of unbounded capacity."""
    seen: set[int] = set()
    pre, ch = HitCount(), ChunkCount()
    for i, r in enumerate(trace.requests):
        run = _run_of(r.hash_ids, seen)
        pre.add(trace, i, run)
        ch.add(trace, i, run, [_run_of([CHUNK_ID_BASE + h for h in ids], seen) for _, _, ids in r.chunks])
        seen.update(chunk_stream(r))
    return pre, ch


def belady_chunks(trace: Trace, capacity: int) -> tuple[HitCount, ChunkCount]:
    """MIN with bypass over both key streams of a prefix+chunk pool (a reference; see the module doc)."""
    pre, ch = HitCount(), ChunkCount()

    def count(i: int, cache: dict[int, int]) -> None:
        r = trace.requests[i]
        run = _run_of(r.hash_ids, cache)
        pre.add(trace, i, run)
        ch.add(trace, i, run, [_run_of([CHUNK_ID_BASE + h for h in ids], cache) for _, _, ids in r.chunks])

    _min_replay([chunk_stream(r) for r in trace.requests], capacity, count)
    return pre, ch


def _next_uses(streams: list[list[int]]) -> list[int]:
    """For every id in ``streams`` (flattened in order), the index of the next stream that holds it (NEVER if none)."""
    out = [NEVER] * sum(len(ids) for ids in streams)
    last: dict[int, int] = {}
    j = len(out)
    for i in range(len(streams) - 1, -1, -1):
        ids = streams[i]
        for h in reversed(ids):
            j -= 1
            out[j] = last.get(h, NEVER)
        for h in ids:
            last[h] = i
    return out


def next_uses(trace: Trace) -> list[int]:
    """For every block access in trace order, the index of the next request that uses the block (NEVER if none)."""
    return _next_uses([r.hash_ids for r in trace.requests])


def _min_replay(streams: list[list[int]], capacity: int, count: Callable[[int, dict[int, int]], None]) -> None:
    """MIN with bypass at ``capacity`` ids over ``streams`` (one list of ids per request): before request
    ``i`` files its ids, ``count(i, cache)`` sees what the cache holds. ``ValueError`` if capacity < 0."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
    nu = _next_uses(streams)
    cache: dict[int, int] = {}  # id -> next use it was filed under
    heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, id); stale when cache[id] differs
    j = 0
    for i, ids in enumerate(streams):
        count(i, cache)
        for d, h in enumerate(ids):
            x = nu[j]
            j += 1
            cache[h] = x
            heapq.heappush(heap, (-x, -d, h))
            while len(cache) > capacity:
                negx, _, k = heapq.heappop(heap)
                if cache.get(k) == -negx:
                    del cache[k]
        if len(heap) > 4 * len(cache) + 1024:
            heap = [e for e in heap if cache.get(e[2]) == -e[0]]
            heapq.heapify(heap)


def belady(trace: Trace, capacity: int) -> HitCount:
    """Prefix hits of MIN with bypass at ``capacity`` blocks; ``ValueError`` if capacity < 0."""
    res = HitCount()
    _min_replay([r.hash_ids for r in trace.requests], capacity,
                lambda i, cache: res.add(trace, i, _run_of(trace.requests[i].hash_ids, cache)))
    return res


def reuse_oracle(trace: Trace, capacity: int) -> HitCount:
    """LRU given a perfect reuse predictor: blocks never used again are evicted first.

    Not a bound (MIN is); a reference for what knowing only *whether* a block
    returns, not *when*, is worth. The gap between this and MIN is the part of
    the bound no online policy can reach by predicting reuse alone.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
    nu = next_uses(trace)
    live: OrderedDict[int, None] = OrderedDict()
    dead: OrderedDict[int, None] = OrderedDict()
    res = HitCount()
    j = 0
    for i, r in enumerate(trace.requests):
        run = 0
        for h in r.hash_ids:
            if h not in live and h not in dead:
                break
            run += 1
        res.add(trace, i, run)
        for h in r.hash_ids:
            live.pop(h, None)
            dead.pop(h, None)
            (dead if nu[j] == NEVER else live)[h] = None
            j += 1
            while len(live) + len(dead) > capacity:
                (dead if dead else live).popitem(last=False)
    return res


def infinite(trace: Trace) -> HitCount:
    """Prefix hits with unbounded capacity (every block seen before is held)."""
    seen: set[int] = set()
    res = HitCount()
    for i, r in enumerate(trace.requests):
        run = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            run += 1
        res.add(trace, i, run)
        seen.update(r.hash_ids)
    return res


def main(argv: list[str] | None = None) -> int:
    """``kvfabric bench belady TRACE --capacity F ...``: print the bound and the infinite rate."""
    import argparse
    import sys

    from .traces import TraceError, load_trace

    p = argparse.ArgumentParser(prog="kvfabric bench belady", description="Belady (MIN) and infinite hit rates.")
    p.add_argument("trace")
    p.add_argument("--capacity", type=float, action="append", help="fraction of unique blocks (repeatable)")
    p.add_argument("--block-tokens", type=int, default=None)
    args = p.parse_args(argv)
    try:
        trace = load_trace(args.trace, args.block_tokens)
        caps = args.capacity or [0.01, 0.05, 0.1, 0.25, 0.5]
        if any(not 0 < c <= 10 for c in caps):  # also refuses inf and nan
            raise ValueError(f"capacities are fractions of unique blocks in (0, 10], got {caps}")
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench belady: {e}", file=sys.stderr)
        return 2
    inf = infinite(trace)
    print(f"{'capacity':>9} {'blocks':>8} {'belady':>7} {'(tokens)':>8} {'reuse-oracle':>12} {'infinite':>8}")
    for c in caps:
        n = max(1, int(c * trace.unique_blocks))  # at least one block, as simulate and replay size it
        b = belady(trace, n)
        o = reuse_oracle(trace, n)
        print(f"{c:>9.1%} {n:>8} {b.block_hit_rate:>7.1%} {b.token_hit_rate:>8.1%} {o.block_hit_rate:>12.1%} "
              f"{inf.block_hit_rate:>8.1%}")
    return 0


__all__ = ["CHUNK_ID_BASE", "ChunkCount", "HitCount", "NEVER", "belady", "belady_chunks", "chunk_hit_blocks",
           "chunk_stream", "infinite", "infinite_chunks", "next_uses", "prefix_hit_tokens", "reuse_oracle"]
