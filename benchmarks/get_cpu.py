"""Large Client GETs: GB/s and both processes' CPU per GiB against the C socket; same as ``kvfabric bench get_cpu``."""

import sys

from kvfabric.bench.get_cpu import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
