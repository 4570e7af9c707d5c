"""Block-key throughput; same as ``kvfabric bench keys``."""

import sys

from kvfabric.bench.keys import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
