"""Hit rate with one of N servers SIGKILLed, per placement of a chunk's layer objects (issue 23); same as
``kvfabric bench placement``."""

import sys

from kvfabric.bench.placement import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
