"""How every ``kvfabric`` tool reaches the servers: the shared options, one ClientConfig, a Client, one-line failures.

Config is parsed here, once, at the tools' edge: the command line's
``--token``/``--token-file``/``--timeout``/``--transport`` win over the
``KVFABRIC_*`` variables that :class:`~kvfabric.config.ClientConfig` declares
(``ClientConfig.from_env``: ``KVFABRIC_SERVERS``, ``KVFABRIC_AUTH_TOKEN``,
``KVFABRIC_TIMEOUT_S``, ...), which win over the tools' defaults (5 s to
reach and to answer, longer than an engine's 2 s call deadline: an operator
would rather wait than read a false "timed out").

Failures are one line each, never a traceback: a tool raises
:class:`ToolError` and :func:`run` prints ``kvfabric CMD: ADDRESS: what
happened`` on stderr and returns its exit status:

* 0: done;
* 1: a runtime failure (authentication refused, connection refused, no answer
  in time, the server answered an error, a file that cannot be read or
  written);
* 2: bad arguments (a malformed address, key or option; no server given);
* 3: a key was not found (``get``; ``exists`` when one of its keys is absent).

The client's own log lines (a shard marked down, the transport chosen) stay
quiet unless ``-v`` asks for them: the tool says what failed itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..client import Client
from ..config import ENV_VARS, TRANSPORTS, ClientConfig
from ..errors import ConfigError, ErrorCode, KVFabricError, RemoteError

OK, FAILED, USAGE, NOT_FOUND = 0, 1, 2, 3

#: the tools' defaults where neither a flag nor a KVFABRIC_* variable sets the field
TOOL_DEFAULTS: dict[str, Any] = {"timeout_s": 5.0, "connect_timeout_s": 5.0}


class ToolError(Exception):
    """What a tool reports instead of a traceback: ``lines`` (each printed as ``PROG: line``), ``status``."""

    def __init__(self, lines: str | Sequence[str], status: int = FAILED) -> None:
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        self.status = status
        super().__init__("; ".join(self.lines))


def add_options(p: argparse.ArgumentParser, *, transport: bool = True) -> None:
    """``--token``, ``--token-file``, ``--timeout``, ``-v``, and ``--transport`` unless the tool forces one."""
    p.add_argument("--token", "--auth-token", dest="token", default=None,
                   help="token for servers started with --auth-token (default: $KVFABRIC_AUTH_TOKEN; "
                        "prefer --token-file or the variable, a flag shows in the process list)")
    p.add_argument("--token-file", default=None, metavar="FILE", help="read the token from FILE")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds to reach each server and for each answer (default: $KVFABRIC_TIMEOUT_S, else 5)")
    if transport:
        p.add_argument("--transport", choices=TRANSPORTS, default=None,
                       help="how to talk to the servers (default: $KVFABRIC_TRANSPORT, else auto)")
    p.add_argument("-v", "--verbose", action="store_true", help="show the client's log lines on stderr")


def read_token(args: argparse.Namespace) -> str | None:
    """The token the flags give (None: none given, the environment's applies). ToolError (status 2) otherwise."""
    if args.token is not None and args.token_file:
        raise ToolError("give --token or --token-file, not both", USAGE)
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ToolError(f"cannot read --token-file: {e.strerror or e}: {args.token_file}", USAGE) from None
        if not token:
            raise ToolError(f"--token-file {args.token_file} is empty", USAGE)
        return token
    if args.token is not None and not args.token.strip():
        raise ToolError("--token must not be empty", USAGE)
    return args.token


def client_config(args: argparse.Namespace, servers: Sequence[str] = (), *, transport: str | None = None,
                  environ: Mapping[str, str] | None = None) -> ClientConfig:
    """Flags over ``KVFABRIC_*`` over :data:`TOOL_DEFAULTS`. ``servers`` given replace ``KVFABRIC_SERVERS``
    (and any ``KVFABRIC_ETCD``); ``transport`` forces one. ToolError (status 2) for a bad value."""
    env = os.environ if environ is None else environ  # the edge: the one place the tools look
    from_env = {ENV_VARS[v] for v in env if v in ENV_VARS}
    overrides: dict[str, Any] = {k: v for k, v in TOOL_DEFAULTS.items() if k not in from_env}
    if args.timeout is not None:
        overrides.update(timeout_s=args.timeout, connect_timeout_s=args.timeout)
    overrides["auth_token"] = read_token(args)
    overrides["transport"] = transport or getattr(args, "transport", None)
    if servers:
        overrides.update(servers=tuple(servers), etcd="")
    try:
        return ClientConfig.from_env(env, **overrides)
    except ConfigError as e:
        raise ToolError(str(e), USAGE) from None


def addresses(items: Sequence[str]) -> list[str]:
    """Command-line addresses, each ``HOST:PORT`` or a comma-separated list of them, as one list."""
    return [a for item in items for a in item.split(",") if a.strip()]


def require_servers(cfg: ClientConfig) -> None:
    if not cfg.servers and not cfg.etcd:
        raise ToolError("no server: give HOST:PORT[,HOST:PORT...] or set KVFABRIC_SERVERS", USAGE)


def describe(error: str | BaseException, timeout_s: float) -> str:
    """What went wrong, for a person: ``error`` is a shard's ``last_error`` ("TypeName: message", as
    ``Client.stats()`` reports it) or the exception itself."""
    if isinstance(error, RemoteError):
        kind, text, code = "RemoteError", str(error), error.code
    else:
        kind, _, text = str(error).partition(": ") if isinstance(error, str) else (type(error).__name__, "", str(error))
        code = None
    # AuthError: this side refused a server that did not prove it holds our token (protocol 3)
    if code == ErrorCode.AUTH_FAILED or kind == "AuthError" or (kind == "RemoteError" and "AUTH_FAILED" in text):
        return "authentication failed (wrong or missing --token)"
    if code == ErrorCode.BAD_VERSION or (kind == "RemoteError" and "BAD_VERSION" in text):
        return f"wire protocol version mismatch (kvfabric versions differ): {text}"
    if "Connection refused" in text:
        return "connection refused (is a server listening there?)"
    if kind == "DeadlineExceeded" or "timed out" in text:
        return f"no answer within {timeout_s:g}s (--timeout)"
    return text or kind or "unreachable"


def rejected_address(error: RemoteError, servers: Sequence[str]) -> str:
    """The server a Client constructor's RemoteError names ("server ADDRESS rejected this client: ..")."""
    return next((a for a in servers if f"server {a} " in error.message), "")


def open_client(cfg: ClientConfig) -> Client:
    """A Client over ``cfg``'s servers (or its etcd cluster). A server that rejects this client (a token it
    does not accept) starts out down like an unreachable one, so each is reported with its address;
    ToolError when every server rejects it."""
    require_servers(cfg)
    try:
        return Client(config=cfg, allow_rejects=True)
    except RemoteError as e:
        address = rejected_address(e, cfg.servers)
        raise ToolError(f"{address}: {describe(e, cfg.timeout_s)}" if address else describe(e, cfg.timeout_s)) from None
    except ConfigError as e:
        raise ToolError(str(e), USAGE) from None


def quiet_logs(verbose: bool) -> None:
    """The client's log lines on stderr at INFO with ``-v``, else none (the tool reports failures)."""
    log = logging.getLogger("kvfabric")
    handler = next((h for h in log.handlers if getattr(h, "kvfabric_tool", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.kvfabric_tool = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        log.addHandler(handler)  # a handler of its own: Python's last-resort one never prints the warnings
    handler.setLevel(logging.INFO if verbose else logging.CRITICAL + 1)
    if verbose:
        log.setLevel(logging.INFO)


def run(prog: str, body: Callable[[], int]) -> int:
    """Run a tool's ``body``; a ToolError, a kvfabric error or an I/O error becomes one line per failure."""
    try:
        return body()
    except ToolError as e:
        for line in e.lines:
            print(f"{prog}: {line}", file=sys.stderr)
        return e.status
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return USAGE
    except (KVFabricError, OSError) as e:
        print(f"{prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return FAILED


__all__ = ["FAILED", "NOT_FOUND", "OK", "TOOL_DEFAULTS", "ToolError", "USAGE", "add_options", "addresses",
           "client_config", "describe", "open_client", "quiet_logs", "read_token", "rejected_address",
           "require_servers", "run"]
