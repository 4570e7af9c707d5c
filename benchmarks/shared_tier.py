"""The shared-filesystem tier: two servers share a directory; same as ``kvfabric bench shared_tier``."""

import sys

from kvfabric.bench.shared_tier import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
