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
against an exhaustive search on small traces.

Cost: O(total blocks x log capacity) time, O(total blocks) memory for the
next-use table.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from .traces import Trace

NEVER = 1 << 62


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


def next_uses(trace: Trace) -> list[int]:
    """For every block access in trace order, the index of the next request that uses the block (NEVER if none)."""
    flat_len = trace.total_blocks
    out = [NEVER] * flat_len
    last: dict[int, int] = {}
    j = flat_len
    for i in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[i].hash_ids
        for h in reversed(ids):
            j -= 1
            out[j] = last.get(h, NEVER)
        for h in ids:
            last[h] = i
    return out


def belady(trace: Trace, capacity: int) -> HitCount:
    """Prefix hits of MIN with bypass at ``capacity`` blocks; ``ValueError`` if capacity < 0."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
    nu = next_uses(trace)
    cache: dict[int, int] = {}  # id -> next use it was filed under
    heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, id); stale when cache[id] differs
    res = HitCount()
    j = 0
    for i, r in enumerate(trace.requests):
        run = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            run += 1
        res.add(trace, i, run)
        for d, h in enumerate(r.hash_ids):
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
        if any(not c > 0 for c in caps):
            raise ValueError("capacities must be > 0")
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench belady: {e}", file=sys.stderr)
        return 2
    inf = infinite(trace)
    print(f"{'capacity':>9} {'blocks':>8} {'belady':>7} {'(tokens)':>8} {'reuse-oracle':>12} {'infinite':>8}")
    for c in caps:
        n = int(c * trace.unique_blocks)
        b = belady(trace, n)
        o = reuse_oracle(trace, n)
        print(f"{c:>9.1%} {n:>8} {b.block_hit_rate:>7.1%} {b.token_hit_rate:>8.1%} {o.block_hit_rate:>12.1%} "
              f"{inf.block_hit_rate:>8.1%}")
    return 0


__all__ = ["HitCount", "NEVER", "belady", "infinite", "next_uses", "reuse_oracle"]
