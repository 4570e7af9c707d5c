"""``kvfabric serve``: run the pool server (the C io_uring data plane) until SIGTERM/SIGINT.

There is one product server: :class:`kvfabric.server.native.NativeServer`,
whose data plane is the C extension ``kvfabric._native`` (csrc/). This module
is its command line: it parses and validates the options, starts the server
and, once the server can answer (the listening socket is opened only then),
prints exactly one line to stdout, flushed::

    kvfabric serve: listening on 127.0.0.1:7070

(with the real port when ``--port 0`` asked for a free one), which is what
``kvfabric.testing.servers`` waits for. SIGTERM or SIGINT: stop accepting,
let frames in flight finish, exit 0.

Transports offered by default: ``tcp`` (plain frames; any client) and
``native`` (the same frames, served by the io_uring plane to the C client).
``shm`` (same-host clients map the arena) is offered only when asked for
(``--transports tcp,native,shm``), because an attached client maps the whole
arena: it is for trusted engines on the same host. Its unix socket is a
filesystem socket, 0600 in a private directory (``--shm-socket``,
``--shm-group``), and peers are checked by uid (``--shm-allow-uid``,
``--shm-allow-gid``); see docs/notes/security.md.

Cluster membership (``--etcd URL --cluster NAME``): once listening, the
server registers itself in etcd (its ``--server-id``, its address per
transport, its capacity) under a lease of ``--etcd-ttl`` seconds that it
keeps alive; on SIGTERM/SIGINT it revokes the lease (leaving the cluster)
before it stops serving, so clients stop routing to it first. A server that
dies leaves when its lease expires. The address published is
``--advertise HOST`` (default: ``--host``, which must then not be a wildcard)
with the listening port. An unreachable etcd is logged and retried; the
server serves either way (see ``kvfabric/membership/registry.py``).

Settings: every option is a field of :class:`kvfabric.server.config.ServerConfig`
(default and why), set by a flag, a ``KVFABRIC_SERVE_<NAME>`` environment
variable or ``--config FILE.toml`` (flags > environment > file > defaults);
``--print-config`` prints the effective settings (docs/notes/operations.md).

A machine where the extension did not build gets one clear error saying what
to install and how to rebuild, and exit status 2; it never falls back to a
different server. The pure-Python server that used to be ``--data-plane
python`` is now the executable reference of the test suite
(``python -m kvfabric.testing.reference serve``), not a product mode.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, TransportUnavailable
from .eviction import POLICIES
from ..sizes import format_size, parse_size

# Every default and limit of the server is declared once, with why, in kvfabric/server/config.py.
from .config import MAX_LEASE_MS, MAX_NAMESPACES, ServerConfig, add_arguments, load

log = logging.getLogger("kvfabric.server")

LISTENING_PREFIX = "kvfabric serve: listening on "

#: What to tell a user whose installation has no C extension.
BUILD_HINT = (
    "the pool server needs kvfabric's C extension (kvfabric._native), which was not built{why}. "
    "Install a C compiler and the Python headers (Debian/Ubuntu: apt-get install gcc python3-dev; "
    "the kernel headers must provide linux/io_uring.h), then rebuild: "
    "pip install --force-reinstall --no-deps .  "
    "(or, in a source checkout, python setup.py build_ext --inplace)"
)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Options every pool server process takes (the product server and the test reference), with their
    defaults set (the reference server parses flags only)."""
    add_arguments(p, ["common"])


def help_epilog() -> str:
    """The end of ``kvfabric serve --help``: the eviction policies, one line each, and how sizes are written."""
    width = max(len(name) for name in POLICIES)
    lines = ["eviction policies (--policy):"]
    lines += [f"  {name:<{width}}  {cls.summary}" for name, cls in POLICIES.items()]
    lines += ["", "sizes (--capacity, --*-budget, --ssd-capacity, --ssd-write-queue, --min-rate):",
              "  bytes (1048576), binary units (4GiB, 512MiB, 64KiB) or decimal units written",
              "  in full (4GB = 4000000000); a bare 4G is refused as ambiguous."]
    return "\n".join(lines)


def build_parser(prog: str = "kvfabric serve") -> argparse.ArgumentParser:
    """The ``kvfabric serve`` flags: one per :class:`ServerConfig` field, plus ``--config FILE.toml``
    and ``--print-config``. A flag not given leaves no attribute (:func:`parse_config` fills it from
    the file, the environment or the default)."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a kvfabric pool server (the C io_uring data plane).\nSettings: flags > "
        "KVFABRIC_SERVE_<NAME> environment variables > --config file > defaults.",
        epilog=help_epilog())
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read settings from this TOML file (keys: the flag names with underscores)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective settings as TOML and exit")
    add_arguments(p, ["common", "serve", "membership"], suppress=True)
    return p


def parse_config(argv: list[str]) -> tuple[ServerConfig, argparse.Namespace]:
    """The effective :class:`ServerConfig` for ``argv`` and the parsed flags (SystemExit on errors)."""
    args = build_parser().parse_args(argv)
    return load(args), args


def tier_options(args: ServerConfig) -> dict[str, Any]:
    """The --ssd-* options as NativeServer keyword arguments (exits on bad ones)."""
    if not args.ssd_path:
        if args.ssd_capacity is not None:
            raise SystemExit("kvfabric serve: --ssd-capacity needs --ssd-path")
        return {}
    if args.ssd_capacity is None:
        raise SystemExit("kvfabric serve: --ssd-path needs --ssd-capacity")
    if len(args.ssd_path) > 8:
        raise SystemExit("kvfabric serve: at most 8 --ssd-path")
    if len(set(args.ssd_path)) != len(args.ssd_path):
        raise SystemExit("kvfabric serve: the same --ssd-path twice")
    capacity = _size("--ssd-capacity", args.ssd_capacity)
    queue = _size("--ssd-write-queue", args.ssd_write_queue)
    if queue < 8192:
        raise SystemExit("kvfabric serve: --ssd-write-queue must be at least 8KiB")
    return {"ssd_paths": list(args.ssd_path), "ssd_capacity": capacity, "ssd_admit": args.ssd_admit,
            "ssd_write_queue": queue}


def membership_registration(args: ServerConfig, server_id: str, address: str, transports: list[str],
                            capacity: int, token: str | None = None) -> Any:
    """A started :class:`~kvfabric.membership.registry.Registration` for ``--etcd``, or None without it;
    its record is signed with ``token`` (the pool's ``--auth-token``) when there is one. Exits (status 2)
    for bad membership options."""
    if not args.etcd:
        if args.etcd_ca or args.etcd_cert or args.etcd_key:
            raise SystemExit("kvfabric serve: --etcd-ca / --etcd-cert / --etcd-key need --etcd")
        return None
    import os
    import socket

    from .. import __version__
    from ..membership import Member
    from ..membership.etcd import EtcdClient, EtcdError
    from ..membership.registry import Registration, check_cluster_name

    try:
        check_cluster_name(args.cluster)
        etcd = EtcdClient(args.etcd, timeout_s=max(1.0, min(5.0, args.etcd_ttl / 2)), ca_file=args.etcd_ca,
                          cert_file=args.etcd_cert, key_file=args.etcd_key)
    except (ValueError, EtcdError) as e:
        raise SystemExit(f"kvfabric serve: {e}") from None
    if not 1 <= args.etcd_ttl <= 3600:
        raise SystemExit("kvfabric serve: --etcd-ttl must be in 1..3600 seconds")
    host, _, port = address.rpartition(":")
    if args.advertise:
        host = args.advertise
    elif host in ("0.0.0.0", "::", ""):
        raise SystemExit("kvfabric serve: --host is a wildcard; give --advertise HOST for clients to connect to")
    if "/" in server_id:
        raise SystemExit("kvfabric serve: --server-id must not contain '/' with --etcd")
    public = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    member = Member(
        server_id=server_id, address=public,
        addresses={t: public for t in transports if t in ("tcp", "native")}, capacity=capacity,
        info={"transports": transports, "hostname": socket.gethostname(), "pid": os.getpid(),
              "version": __version__, "started_unix": round(time.time(), 3)},
    )
    reg = Registration(etcd, args.cluster, member, ttl_s=args.etcd_ttl, token=token)
    reg.start()
    return reg


def _size(name: str, text: str) -> int:
    """The size option ``name`` given as ``text`` in bytes (kvfabric/sizes.py); exits naming both."""
    try:
        return parse_size(text)
    except ConfigError as e:
        raise SystemExit(f"kvfabric serve: {name} {text}: {e}") from None


#: The page allocator indexes 4 KiB pages with 32 bits (csrc/kvf_store.c): the arena stays below 16 TiB.
MAX_CAPACITY = ((1 << 32) - 1) * 4096


def validate_common(args: ServerConfig | argparse.Namespace) -> tuple[int, str | None, int]:
    """Check the common options; returns (capacity, auth token or None, min_rate). Exits with a message."""
    capacity = _size("--capacity", args.capacity)
    min_rate = _size("--min-rate", args.min_rate)
    if min_rate < 1:
        raise SystemExit("kvfabric serve: --min-rate must be >= 1 byte/s")
    if capacity < 4096:
        raise SystemExit("kvfabric serve: --capacity must be at least 4KiB")
    if capacity >= MAX_CAPACITY:
        raise SystemExit(f"kvfabric serve: --capacity {format_size(capacity)}: must be below 16TiB")
    if args.policy not in POLICIES:
        raise SystemExit(f"kvfabric serve: unknown --policy {args.policy!r}; known: {', '.join(sorted(POLICIES))}")
    if not 1 <= args.max_namespaces <= MAX_NAMESPACES:
        raise SystemExit(f"kvfabric serve: --max-namespaces must be in 1..{MAX_NAMESPACES}")
    if not 0 <= args.port < 65536:
        raise SystemExit("kvfabric serve: --port must be in 0..65535")
    if args.max_connections < 1:
        raise SystemExit("kvfabric serve: --max-connections must be >= 1")
    if args.stall_timeout <= 0:
        raise SystemExit("kvfabric serve: --stall-timeout must be > 0")
    if not 0 <= args.max_lease_ms <= MAX_LEASE_MS:
        raise SystemExit(f"kvfabric serve: --max-lease-ms must be in 0..{MAX_LEASE_MS}")
    if args.auth_token is not None and args.auth_token_file:
        raise SystemExit("kvfabric serve: give --auth-token or --auth-token-file, not both")
    token = args.auth_token
    if args.auth_token_file:
        try:
            with open(args.auth_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise SystemExit(f"kvfabric serve: cannot read --auth-token-file: {e}") from None
        if not token:
            raise SystemExit("kvfabric serve: --auth-token-file is empty")
    elif token is not None and not token.strip():
        # An empty token would be one that anyone can send; never read it as "auth off" either.
        raise SystemExit("kvfabric serve: --auth-token must not be empty (omit it to run without authentication)")
    if token is not None and "\0" in token:  # HMAC pads keys with zero bytes: "t" and "t\0" would be one key
        raise SystemExit("kvfabric serve: the auth token must not contain a NUL character")
    return capacity, token, min_rate


def warn_without_token(token: str | None, etcd: str | None) -> None:
    """Say once, at WARNING, what running without a pool token means (after logging is set up)."""
    if token is not None:
        return
    log.warning("no --auth-token: any peer that can reach this server's port can read and write every key%s; "
                "set --auth-token (or --auth-token-file) on every server and client to stop that",
                " and, with --etcd, any member entry in etcd is trusted" if etcd else "")


def _ids(flag: str, text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"kvfabric serve: {flag} takes numeric ids, comma-separated") from None
    if any(not 0 <= i < 2**32 - 1 for i in ids):
        raise SystemExit(f"kvfabric serve: {flag}: ids must be in 0..4294967294")
    return ids


def shm_options(args: ServerConfig, transports: list[str]) -> dict[str, Any]:
    """The --shm-* options as NativeServer keyword arguments (exits when given without shm)."""
    given = [f for f, v in (("--shm-socket", args.shm_socket), ("--shm-group", args.shm_group),
                            ("--shm-allow-uid", args.shm_allow_uid), ("--shm-allow-gid", args.shm_allow_gid)) if v]
    if given and "shm" not in transports:
        raise SystemExit(f"kvfabric serve: {', '.join(given)} need shm in --transports")
    return {"shm_socket": args.shm_socket, "shm_group": args.shm_group,
            "shm_allow_uids": _ids("--shm-allow-uid", args.shm_allow_uid),
            "shm_allow_gids": _ids("--shm-allow-gid", args.shm_allow_gid)}


def _watermarks(text: str, capacity: int) -> tuple[float, float]:
    from .native import auto_watermarks

    if text == "auto":
        return auto_watermarks(capacity)
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit("kvfabric serve: --evict-watermarks must be auto or LOW,HIGH fractions, e.g. 0.02,0.05") from None
    if not 0 <= low <= high < 1:
        raise SystemExit("kvfabric serve: --evict-watermarks must satisfy 0 <= LOW <= HIGH < 1")
    return low, high


def final_counters(st: dict[str, Any]) -> str:
    """One line of a server's counters for its shutdown message."""
    gets = st.get("hits", 0) + st.get("misses", 0)
    rate = f"{100.0 * st.get('hits', 0) / gets:.1f}%" if gets else "-"
    return (f"{st.get('objects', 0)} objects, {st.get('bytes_used', 0)} bytes held; {st.get('puts', 0)} puts, "
            f"{gets} GET keys ({rate} hits), {st.get('evictions', 0)} evictions, "
            f"{st.get('checksum_failures', 0)} checksum failures, {st.get('checksum_rejects', 0)} rejects; "
            f"{st.get('bytes_in', 0)} bytes in, {st.get('bytes_out', 0)} out; "
            f"{st.get('connections_total', 0)} connections"
            + (f"; ssd: {st['ssd_objects']} objects, {st['ssd_hits']} hits, {st['ssd_writes']} writes, "
               f"{st['ssd_write_drops']} drops, {st['ssd_errors']} errors, {st['ssd_corrupt']} corrupt"
               if "ssd_objects" in st else "")
            + (f"; shared: {st['shared_hits']} hits, {st['shared_writes']} writes, {st['shared_write_drops']} drops, "
               f"{st['shared_errors']} errors, {st['shared_corrupt']} corrupt"
               if "shared_hits" in st else ""))


def raise_fd_limit(want: int) -> None:
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


def exit_2_on_bad_options(run: Callable[[list[str]], int]) -> Callable[[list[str] | None], int]:
    """Wrap a server ``main``: a ``SystemExit("message")`` from option checking prints the message and
    returns 2, the status argparse uses for bad usage (not Python's 1 for a string exit)."""

    def main(argv: list[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["serve"]:
            argv = argv[1:]
        try:
            return run(argv)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                return 2
            raise

    main.__doc__ = run.__doc__
    return main


@exit_2_on_bad_options
def main(argv: list[str]) -> int:
    """Run the server; returns the exit status (0 after a clean SIGTERM/SIGINT shutdown, 2 for bad options
    or a server that cannot start here)."""
    args, flags = parse_config(argv)
    capacity, token, min_rate = validate_common(args)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(transports) - {"tcp", "native", "shm", "nixl"})
    if unknown:
        raise SystemExit(f"kvfabric serve: unknown --transports {unknown}; known: tcp, native, shm, nixl")
    if "tcp" not in transports:
        raise SystemExit("kvfabric serve: --transports must include tcp (the control path and fallback)")
    low, high = _watermarks(args.evict_watermarks, capacity)
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise SystemExit("kvfabric serve: --metrics-port must be in 0..65535")
    if args.metrics_max_connections < 1 or not args.metrics_timeout > 0:
        raise SystemExit("kvfabric serve: --metrics-max-connections must be >= 1 and --metrics-timeout > 0")
    shm = shm_options(args, transports)
    tier = tier_options(args)
    if args.shared_fsync == "always" and not args.shared_path:
        raise SystemExit("kvfabric serve: --shared-fsync needs --shared-path")
    given = [f for f, v in (("--tier-group", args.tier_group), ("--tier-dir-insecure-ok", args.tier_dir_insecure_ok))
             if v]
    if given and not (args.ssd_path or args.shared_path):
        raise SystemExit(f"kvfabric serve: {', '.join(given)} need --ssd-path or --shared-path")
    if args.shared_path and not tier:  # one tier thread, one write queue: it bounds the shared tier's copies too
        tier = {"ssd_write_queue": _size("--ssd-write-queue", args.ssd_write_queue)}
        if tier["ssd_write_queue"] < 8192:
            raise SystemExit("kvfabric serve: --ssd-write-queue must be at least 8KiB")
    if args.kv_events_replay and not args.kv_events:
        raise SystemExit("kvfabric serve: --kv-events-replay needs --kv-events")
    if not 1 <= args.kv_events_ring <= 1 << 22:
        raise SystemExit("kvfabric serve: --kv-events-ring must be in 1..4194304")
    if args.idle_timeout < 0:
        raise SystemExit("kvfabric serve: --idle-timeout must be >= 0 (0 = never)")
    if args.drain_timeout <= 0:
        raise SystemExit("kvfabric serve: --drain-timeout must be > 0")
    budgets = {name: _size(f"--{name.replace('_', '-')}", getattr(args, name))
               for name in ("reply_budget_conn", "reply_budget", "request_budget")}
    reserve = None if args.reserve_budget == "auto" else _size("--reserve-budget", args.reserve_budget)
    if min(*budgets.values(), reserve or 1) < 1:
        raise SystemExit("kvfabric serve: memory budgets must be >= 1 byte")
    if flags.print_config:  # after every check: what is printed is a config that starts
        print(args.to_toml(), end="")
        return 0
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_fd_limit(args.max_connections + 64)

    from .kv_events import kv_events_bytes
    from .memory import available_memory, dram_needs, over_memory_warning
    from .native import EVENT_RING, ListenError, NativeServer, listen_error, native_unavailable_reason

    why = native_unavailable_reason()
    if why is not None:
        print(f"kvfabric serve: {BUILD_HINT.format(why=f' ({why})')}", file=sys.stderr)
        return 2
    needs = dram_needs(capacity, reply_budget=budgets["reply_budget"], request_budget=budgets["request_budget"],
                       tier_write_queue=tier.get("ssd_write_queue", 0),
                       metrics_connections=None if args.metrics_port is None else args.metrics_max_connections,
                       kv_events=kv_events_bytes(args.kv_events_ring, EVENT_RING) if args.kv_events else 0)
    too_big = over_memory_warning(capacity, needs, available_memory())
    if too_big:
        log.warning("%s", too_big)
    try:
        server = NativeServer(
            args.host, args.port, capacity=capacity, policy=args.policy, auth_token=token, transports=transports,
            server_id=args.server_id, max_connections=args.max_connections, zerocopy=args.zerocopy,
            huge_pages=args.huge_pages == "on",
            stall_timeout_s=args.stall_timeout, low_watermark=low, high_watermark=high,
            max_lease_ms=args.max_lease_ms, max_namespaces=args.max_namespaces, min_rate=min_rate, **shm,
            idle_timeout_s=args.idle_timeout,
            drain_timeout_s=args.drain_timeout, reserve_budget=reserve, **budgets, **tier,
            shared_path=args.shared_path, shared_fsync=args.shared_fsync, tier_group=args.tier_group,
            tier_dir_insecure_ok=args.tier_dir_insecure_ok, prefault=too_big is None,
            kv_events=args.kv_events, kv_events_replay=args.kv_events_replay, kv_events_ring=args.kv_events_ring,
        )
    except ListenError as e:
        print(f"kvfabric serve: {e}", file=sys.stderr)
        return 2
    except (TransportUnavailable, ConfigError, OSError) as e:
        print(f"kvfabric serve: the server cannot start: {e}", file=sys.stderr)
        return 2
    done = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        done.set()  # no locks, no logging here: the main thread may hold them

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()  # returns once the port accepts connections (the C loop listens when it runs)
    except (TransportUnavailable, ConfigError) as e:
        print(f"kvfabric serve: the server cannot start: {e}", file=sys.stderr)
        return 2
    warn_without_token(token, args.etcd)  # once it serves: a server that did not start opened nothing
    metrics = None
    if args.metrics_port is not None:
        from .metrics import MetricsServer

        try:
            metrics = MetricsServer(server.stats, args.metrics_host, args.metrics_port,
                                    max_connections=args.metrics_max_connections, timeout_s=args.metrics_timeout)
        except (ImportError, OSError) as e:
            server.stop()
            if isinstance(e, OSError):
                e = listen_error(args.metrics_host, args.metrics_port, e)
            print(f"kvfabric serve: --metrics-port: {e}", file=sys.stderr)
            return 2
        print(f"kvfabric serve: metrics on {metrics.url}", file=sys.stderr, flush=True)
    try:
        registration = membership_registration(args, server.server_id, server.address, transports, capacity, token)
    except SystemExit:
        server.stop()
        if metrics is not None:
            metrics.close()
        raise
    print(f"{LISTENING_PREFIX}{server.address}", flush=True)
    try:
        while not done.wait(0.5):
            if server.loop_error is not None:
                if registration is not None:
                    registration.stop()
                server.stop()
                return 1
        log.info("signal received: shutting down")
        if registration is not None:
            registration.stop()  # leave the cluster first: clients stop routing here before the port closes
        server.stop()
        print(f"kvfabric serve: stopped; {final_counters(server.stats())}", file=sys.stderr, flush=True)
    finally:
        if metrics is not None:
            metrics.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
