"""What publishing KV events costs a pool server's PUTs (off / a reading subscriber / a stuck one); same as ``kvfabric bench kv_events``."""

import sys

from kvfabric.bench.kv_events import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
