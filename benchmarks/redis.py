"""native GET/PUT of 1 MiB beside redis-benchmark and the loopback TCP limit; same as ``kvfabric bench redis``."""

import sys

from kvfabric.bench.redis import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
