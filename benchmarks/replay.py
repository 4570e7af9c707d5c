"""Thin wrapper: ``python benchmarks/replay.py TRACE [flags]`` == ``kvfabric bench replay TRACE [flags]``.

Prints the three-level table and writes JSON (bench-results/replay-<trace>.json by default).
"""

import sys

from kvfabric.bench.replay import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
