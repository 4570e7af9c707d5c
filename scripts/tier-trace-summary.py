#!/usr/bin/env python3
"""Summarise KVFABRIC_TIER_TRACE files of kvfabric serve (docs/notes/bench-tier.md, "SSD GET path").

Usage: scripts/tier-trace-summary.py TRACE [TRACE ...]
One block per request kind (op, keys parked on the tier): mean / p50 / max of every stage in microseconds.
"""
import collections
import statistics
import sys

FIELDS = ["space_us", "queue_us", "io_us", "verify_us", "back_us", "promote_us", "redispatch_us", "total_us"]


def main(paths: list[str]) -> int:
    rows = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                d = {k: int(v) for k, v in (kv.split("=") for kv in line.split())}
                rows[(d["op"], d["n"])].append(d)
    for (op, n), rs in sorted(rows.items()):
        print(f"op={op} n={n} requests={len(rs)} parked_for_space={sum(r['parks'] > 0 for r in rs)}")
        for f in FIELDS:
            xs = [r.get(f, 0) for r in rs]
            print(f"   {f:14s} mean {statistics.mean(xs):8.0f}  p50 {statistics.median(xs):8.0f}  max {max(xs):8d}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
