"""End-to-end serving on real vLLM instances with kvfabric, alone and with peer L2s; same as ``kvfabric bench serve``.

``python benchmarks/serve.py --engine-python .venvs/vllm/bin/python [--trace mooncake-conversation] [--loads 2,6]``.
"""

import sys

from kvfabric.bench.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
