"""Start-up time of a fresh pool server (listening line, first HELLO, stalls) against the interpreter's own start; same as ``kvfabric bench startup``."""

import sys

from kvfabric.bench.startup import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
