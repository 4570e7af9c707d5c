"""LOOKUP/GET of a 128K-token prompt over 4 shards beside the PING floor; same as ``kvfabric bench lookup``."""

import sys

from kvfabric.bench.lookup import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
