"""Thin wrapper: ``python benchmarks/sweep.py [TRACES] [flags]`` == ``kvfabric bench sweep [TRACES] [flags]``.

Prints the capacity x policy table, writes bench-results/sweep.json and bench-results/sweep.png.
"""

import sys

from kvfabric.bench.sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
