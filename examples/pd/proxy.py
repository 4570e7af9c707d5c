"""The prefill/decode (PD) proxy for vLLM instances sharing a kvfabric pool: ``kvfabric route --mode pd``.

    python examples/pd/proxy.py --port 8000 \\
        --prefill http://10.0.0.1:8100 [--prefill ...] --decode http://10.0.0.2:8200 [--decode ...]

is ``kvfabric route --mode pd`` with the same options (``--help``): each request is prefilled on a
kv_producer instance, which saves the prompt's KV to the pool and answers with
``kv_transfer_params``, then decoded on a kv_consumer instance, which loads it from the pool; the
producer and the consumer are chosen by the router's predicted time to first token (their prefix
caches, the pool, their queues: docs/route.md), or round robin with ``--policy rr``. Everything it
does, its limits and its ``/stats`` are :mod:`kvfabric.route.server`'s. It prints ``PD proxy
listening on HOST:PORT`` once it answers.
"""

from __future__ import annotations

import sys

from kvfabric.route.server import main as route_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return route_main(["--mode", "pd", *argv], banner="PD proxy listening on", prog="examples/pd/proxy.py")


if __name__ == "__main__":
    sys.exit(main())
