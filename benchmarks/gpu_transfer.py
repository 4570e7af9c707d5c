"""Save / load GB/s of the vLLM connector's GPU transfer path against pinned cudaMemcpy (issue 21); same as
``kvfabric bench gpu_transfer``. Needs torch and ``connectors/`` on the path."""

import sys

from kvfabric.bench.gpu_transfer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
