"""``kvfabric serve``: run one pool server process until SIGTERM/SIGINT.

Once the listener is bound it prints exactly one line to stdout, flushed::

    kvfabric serve: listening on 127.0.0.1:7070

(with the real port when ``--port 0`` asked for a free one), which is what
``kvfabric.testing.servers`` waits for. SIGTERM or SIGINT: stop accepting,
let frames in flight finish, exit 0.

Transports other than ``tcp`` (``--transports tcp,native``) are plug-ins:
for a name ``X`` the module ``kvfabric.server.X`` is imported and its
``start_transport(ctx: ServerContext)`` called; it returns an object with
``close()``. A transport that is asked for but cannot start is an error (exit
status 2), never a silent fallback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from ..config import parse_size
from ..errors import ConfigError
from .eviction import POLICIES
from .handlers import Handlers
from .store import DEFAULT_MAX_LEASE_MS, Store
from .tcp import TcpServer

log = logging.getLogger("kvfabric.server")

LISTENING_PREFIX = "kvfabric serve: listening on "


@dataclass
class ServerContext:
    """What a transport plug-in gets: the shared store and handlers, and the parsed options."""

    store: Store
    handlers: Handlers
    host: str
    tcp_port: int
    args: argparse.Namespace


def build_parser(prog: str = "kvfabric serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a kvfabric pool server.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=7070, help="TCP port; 0 picks a free one (default 7070)")
    p.add_argument("--capacity", default="4GiB", help="arena size, e.g. 4GiB, 512MiB (default 4GiB)")
    p.add_argument("--policy", default="lru", help=f"eviction policy (known: {', '.join(sorted(POLICIES))})")
    p.add_argument("--auth-token", default=None, help="require this token in HELLO")
    p.add_argument("--auth-token-file", default=None, help="read the auth token from this file")
    p.add_argument("--max-connections", type=int, default=1024, help="concurrent connections (default 1024)")
    p.add_argument("--stall-timeout", type=float, default=10.0, help="seconds a peer may stall mid-frame (default 10)")
    p.add_argument("--min-rate", default="1MiB", help="slowest accepted transfer rate per frame, bytes/s (default 1MiB)")
    p.add_argument("--max-lease-ms", type=int, default=DEFAULT_MAX_LEASE_MS, help="cap on LOOKUP leases")
    p.add_argument("--transports", default="tcp", help="comma-separated transports to offer (default tcp)")
    p.add_argument("--server-id", default=None, help="id reported in HELLO/STATS (default host:port)")
    p.add_argument("--memfd", action="store_true", help="back the arena with a memfd (for same-host transports)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--data-plane", default="python", choices=DATA_PLANES,
        help="python: this process's connection threads over the Python store (default); native: the io_uring "
             "data plane in C (kvfabric.server.native; also takes --zerocopy and --evict-watermarks)",
    )
    return p


DATA_PLANES = ("python", "native")


def _data_plane(argv: list[str]) -> str:
    """The ``--data-plane`` in ``argv``, read before the full parse (the native server has extra options)."""
    pre = argparse.ArgumentParser(prog="kvfabric serve", add_help=False)
    pre.add_argument("--data-plane", default="python", choices=DATA_PLANES)
    known, _ = pre.parse_known_args(argv)
    return known.data_plane


def _options(args: argparse.Namespace) -> tuple[int, str | None, list[str], int]:
    try:
        capacity = parse_size(args.capacity)
    except ConfigError as e:
        raise SystemExit(f"kvfabric serve: --capacity: {e}") from None
    try:
        min_rate = parse_size(args.min_rate)
    except ConfigError as e:
        raise SystemExit(f"kvfabric serve: --min-rate: {e}") from None
    if min_rate < 1:
        raise SystemExit("kvfabric serve: --min-rate must be >= 1 byte/s")
    if capacity < 4096:
        raise SystemExit("kvfabric serve: --capacity must be at least 4KiB")
    if args.policy not in POLICIES:
        raise SystemExit(f"kvfabric serve: unknown --policy {args.policy!r}; known: {', '.join(sorted(POLICIES))}")
    if not 0 <= args.port < 65536:
        raise SystemExit("kvfabric serve: --port must be in 0..65535")
    if args.max_connections < 1:
        raise SystemExit("kvfabric serve: --max-connections must be >= 1")
    if args.stall_timeout <= 0:
        raise SystemExit("kvfabric serve: --stall-timeout must be > 0")
    token = args.auth_token
    if args.auth_token_file:
        try:
            with open(args.auth_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise SystemExit(f"kvfabric serve: cannot read --auth-token-file: {e}") from None
        if not token:
            raise SystemExit("kvfabric serve: --auth-token-file is empty")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if "tcp" not in transports:
        raise SystemExit("kvfabric serve: --transports must include tcp (the control path and fallback)")
    return capacity, token, transports, min_rate


def _raise_fd_limit(want: int) -> None:
    """Lift the soft open-files limit towards ``want`` (one fd per connection), within the hard limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < want:
            log.warning("open-files limit %d is below --max-connections + 64 = %d", soft, want)
    except (ImportError, ValueError, OSError) as e:
        log.warning("cannot raise the open-files limit: %s", e)


def main(argv: list[str] | None = None) -> int:
    """Run the server; returns the exit status (0 after a clean SIGTERM/SIGINT shutdown)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _data_plane(argv) == "native":
        from .native import main as native_main

        return native_main(argv)
    args = build_parser().parse_args(argv)
    capacity, token, transports, min_rate = _options(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    threading.stack_size(512 * 1024)  # many connection threads; they need little stack
    _raise_fd_limit(args.max_connections + 64)

    store = Store(capacity, args.policy, memfd=args.memfd, max_lease_ms=args.max_lease_ms)
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

    plugins: list[Any] = []
    ctx = ServerContext(store, handlers, host, port, args)
    for name in transports:
        if name == "tcp":
            continue
        try:
            module = importlib.import_module(f"kvfabric.server.{name}")
            start = getattr(module, "start_transport", None)
            if start is None:
                raise RuntimeError(
                    f"kvfabric.server.{name} has no start_transport(ctx) plug-in for this server"
                    f" (if it is a server of its own, run: python -m kvfabric.server.{name} serve ...)"
                )
            plugins.append(start(ctx))
        except Exception as e:
            print(f"kvfabric serve: transport {name!r} is not available: {e}", file=sys.stderr)
            for p in plugins:
                p.close()
            return 2
        handlers.transports.append(name)

    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)  # no locks, no logging here: the main thread may hold them
        tcp.stop()  # serve_forever returns; close() below lets in-flight frames finish

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.warning(
        "serving %s: capacity %d bytes, policy %s, transports %s, auth %s",
        handlers.server_id, store.capacity, store.policy.name, ",".join(handlers.transports), "on" if token else "off",
    )
    print(f"{LISTENING_PREFIX}{host}:{port}", flush=True)
    tcp.serve_forever()
    log.info("signal %s: shutting down", received[0] if received else "?")
    for p in plugins:
        p.close()
    tcp.close()  # waits for in-flight frames (up to the stall timeout + 1 s)
    log.info("stopped")
    return 0
