"""LMCache store/retrieve through the kvfabric plugin vs LMCache's own ``lm://`` server; same as
``kvfabric bench lmcache_backend`` (run in the LMCache virtualenv: ``.venvs/lmcache/bin/python``).
"""

import sys

from kvfabric.bench.lmcache_backend import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
