"""Thin wrapper: ``python benchmarks/rag.py [flags]`` == ``kvfabric bench rag [flags]``.

``--dataset musique`` replays the bundled real RAG workload in the prefix and chunk key modes; without it the
synthetic generator's trace is replayed. Writes bench-results/rag.{json,png}.
"""

import sys

from kvfabric.bench.rag import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
