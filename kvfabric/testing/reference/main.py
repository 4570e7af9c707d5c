"""Command line of the pure-Python reference server (see the package docstring).

Once the listener is bound it prints ``kvfabric serve: listening on
HOST:PORT``, flushed, as ``kvfabric serve`` does. SIGTERM or SIGINT: stop
accepting, let frames in flight finish, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from ...server.main import (
    LISTENING_PREFIX,
    add_common_arguments,
    exit_2_on_bad_options,
    raise_fd_limit,
    validate_common,
    warn_without_token,
)
from .handlers import Handlers
from .store import Store
from .tcp import TcpServer

log = logging.getLogger("kvfabric.testing.reference")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvfabric.testing.reference serve",
                                description="Run the pure-Python reference pool server (tests only).")
    add_common_arguments(p)
    p.add_argument("--memfd", action="store_true", help="back the arena with a memfd")
    return p


@exit_2_on_bad_options
def main(argv: list[str]) -> int:
    """Run the reference server; returns the exit status (0 after SIGTERM/SIGINT, 2 for bad options)."""
    args = build_parser().parse_args(argv)
    capacity, token, min_rate = validate_common(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    threading.stack_size(512 * 1024)  # many connection threads; they need little stack
    raise_fd_limit(args.max_connections + 64)

    store = Store(capacity, args.policy, memfd=args.memfd, max_lease_ms=args.max_lease_ms,
                  ns_max=args.max_namespaces)
    handlers = Handlers(store, server_id="", transports=["tcp"], auth_token=token)
    tcp = TcpServer(
        handlers, args.host, args.port,
        max_connections=args.max_connections, stall_timeout_s=args.stall_timeout, min_rate=min_rate,
    )
    try:
        host, port = tcp.start()
    except OSError as e:
        print(f"kvfabric serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    handlers.server_id = args.server_id or f"{host}:{port}"
    warn_without_token(token, None)
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)  # no locks, no logging here: the main thread may hold them
        tcp.stop()  # serve_forever returns; close() below lets in-flight frames finish

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # a signal taken by a connection thread must still wake the accept loop (tcp.signal_wakeup_fd); CI saw a
    # SIGTERM leave the server asleep in select() for over 120 s
    signal.set_wakeup_fd(tcp.signal_wakeup_fd())
    log.warning("reference server %s: capacity %d bytes, policy %s, auth %s",
                handlers.server_id, store.capacity, store.policy.name, "on" if token else "off")
    print(f"{LISTENING_PREFIX}{host}:{port}", flush=True)
    tcp.serve_forever()
    tcp.close()  # waits for in-flight frames (up to the stall timeout + 1 s)
    return 0
