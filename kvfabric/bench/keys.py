"""``kvfabric bench keys``: block-key throughput, against one-shot hashing of the same bytes.

For each prompt length, block size and algorithm it measures how many tokens
per second :meth:`KeyHasher.prefix_keys` turns into keys (from a Python list
of ints, as engines hand them over, and from a numpy array), and in the same
run the ceiling: one call of the same hash over the whole packed prompt (no
per-block chaining, no conversion). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import write_json
from ..keys import KeyAlgorithm, KeyHasher, Namespace, pack_tokens


def _best_rate(fn, tokens: int, min_time: float) -> float:
    """Tokens/s of the fastest of several timed repetitions lasting >= min_time in all."""
    best = float("inf")
    spent = 0.0
    reps = 0
    while spent < min_time or reps < 3:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
        reps += 1
    return tokens / best


def run(prompt_tokens: list[int], block_sizes: list[int], algorithms: list[str], min_time: float) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for n in prompt_tokens:
        arr = rng.integers(0, 128_000, size=n, dtype=np.int64)
        lst = arr.tolist()
        for bt in block_sizes:
            ns = Namespace(model="bench", block_tokens=bt)
            for alg in algorithms:
                h = KeyHasher(alg, b"bench-secret")
                packed = pack_tokens(arr)
                ceiling = _best_rate(lambda: h.hash(packed), n, min_time)
                from_list = _best_rate(lambda: h.prefix_keys(ns, lst), n, min_time)
                from_np = _best_rate(lambda: h.prefix_keys(ns, arr), n, min_time)
                rows.append({
                    "prompt_tokens": n, "block_tokens": bt, "algorithm": alg,
                    "list_mtok_s": from_list / 1e6, "numpy_mtok_s": from_np / 1e6,
                    "ceiling_mtok_s": ceiling / 1e6,
                    "list_ratio": from_list / ceiling, "numpy_ratio": from_np / ceiling,
                })
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'tokens':>7} {'block':>5} {'algorithm':>9} {'list Mtok/s':>12} {'numpy Mtok/s':>13} "
          f"{'one-shot Mtok/s':>16} {'list/ceil':>9} {'np/ceil':>8}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['block_tokens']:>5} {r['algorithm']:>9} {r['list_mtok_s']:>12.1f} "
              f"{r['numpy_mtok_s']:>13.1f} {r['ceiling_mtok_s']:>16.1f} {r['list_ratio']:>9.2f} {r['numpy_ratio']:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench keys", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1500, 32768])
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--algorithms", nargs="+", default=[a.value for a in KeyAlgorithm])
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds spent per measurement")
    ap.add_argument("--out", default="bench-results/keys.json")
    args = ap.parse_args(argv)
    rows = run(args.prompt_tokens, args.block_tokens, args.algorithms, args.min_time)
    print_table(rows)
    write_json(args.out, {"benchmark": "keys", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
