"""The load guard's figure: TTFT of pool hits from a throttled pool, guard on vs off vs recompute-only (see
kvfabric.bench.vllm_guard).

Run in the vLLM virtualenv: ``.venvs/vllm/bin/python benchmarks/vllm_guard.py [--delays 0,1.0]``.
"""

import sys

from kvfabric.bench.vllm_guard import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
