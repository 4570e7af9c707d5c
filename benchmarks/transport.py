"""Transport throughput/latency against the loopback ceiling; same as ``kvfabric bench transport``."""

import sys

from kvfabric.bench.transport import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
