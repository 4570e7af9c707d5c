"""SSD tier: GET vs the raw O_DIRECT read loop, DRAM PUT p99 tier on/off, restart after SIGKILL; same as ``kvfabric bench tier``."""

import sys

from kvfabric.bench.tier import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
