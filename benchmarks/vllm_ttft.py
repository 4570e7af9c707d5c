"""TTFT on real vLLM: cold vs kvfabric pool hit vs vLLM's local prefix-cache hit (see kvfabric.bench.vllm_ttft).

Run in the vLLM virtualenv: ``.venvs/vllm/bin/python benchmarks/vllm_ttft.py [--lengths 512,1500,3000,6000]``.
"""

import sys

from kvfabric.bench.vllm_ttft import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
