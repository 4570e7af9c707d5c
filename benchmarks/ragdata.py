"""Thin wrapper: ``python benchmarks/ragdata.py --input musique_s.json`` == ``kvfabric bench ragdata ...``.

Converts a multi-document QA file (CacheBlend's MuSiQue JSON) into the bundled traces under data/rag/musique.
"""

import sys

from kvfabric.bench.ragdata import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
