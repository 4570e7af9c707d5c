"""PD TTFT on real vLLM: kv_consumer TTFT on a kv_producer's prompts vs vLLM's local prefix hit (see kvfabric.bench.pd).

Run in the vLLM virtualenv: ``.venvs/vllm/bin/python benchmarks/pd.py [--lengths 1500,3000,6000]``.
"""

import sys

from kvfabric.bench.pd import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
