"""native/shm data paths against the C raw-socket and memcpy ceilings; same as ``python -m kvfabric.bench.transport_native``."""

import sys

from kvfabric.bench.transport_native import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
