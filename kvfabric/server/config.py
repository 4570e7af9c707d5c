"""One :class:`ServerConfig`: every ``kvfabric serve`` setting, its default, and why it is that value.

A setting comes from, lowest precedence first:

1. the default declared here;
2. a TOML file, ``kvfabric serve --config FILE.toml`` (keys are the field names below, e.g.
   ``capacity = "8GiB"``, ``transports = ["tcp", "native"]``; an unknown key is an error naming it);
3. the environment, ``KVFABRIC_SERVE_<FIELD>`` (``KVFABRIC_SERVE_CAPACITY=8GiB``): per process,
   more specific than a file several servers share;
4. a command-line flag, ``--<field-with-dashes>``: what the operator typed last wins.

Adding a server setting is adding one field here (with ``opt(...)``): its flag, its file key,
its environment variable and its ``--help`` line follow. Values keep the types the flags have
always had (sizes as text such as ``"4GiB"``, or a plain number of bytes from a file; parsed by
``kvfabric/sizes.py``); checking them is ``kvfabric/server/main.py``'s, which exits with
status 2 naming the setting.
``kvfabric serve --print-config`` prints the effective settings as TOML (the token and an etcd
password masked).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..membership.etcd import redact_url
from ..protocol.wire import MAX_LEASE_MS


#: Server default cap on leases, ms (the protocol's own cap, MAX_LEASE_MS, is an hour). A lease only
#: has to outlive the gap between an engine's lookup
#: and its load of the same blocks (vLLM: the same or the next scheduler step; LMCache: the same
#: call), which is milliseconds unless the engine is saturated; 60 s covers a request that waits in
#: a long queue after its lookup, while a crashed or misbehaving client pins space for at most a minute.
DEFAULT_MAX_LEASE_MS = 60_000
#: Namespace tags a server can know (PUT ``ns``, RETIRE; issue 27; csrc/kvf_ns.h's limit): a tag is
#: never forgotten (a retired one must stay retired), so this bounds the table for the server's life.
MAX_NAMESPACES = 65535
#: Connections idle between frames this long are closed (0: never), so silent sockets cannot hold
#: --max-connections forever even without a token. Five minutes: far longer than an engine's gap
#: between requests under load; the client drops pooled connections the server closed and
#: connects afresh, so a quiet engine pays one connect, not a miss.
DEFAULT_IDLE_TIMEOUT_S = 300.0
#: On SIGTERM, frames in flight may finish for this long before every connection is closed: a
#: 1 GiB PUT at 1 GB/s fits, and an orchestrator's usual 10-30 s kill grace is not exceeded.
DEFAULT_DRAIN_TIMEOUT_S = 5.0
#: Queued replies of one connection over this many bytes pause reading its next request: one
#: connection cannot fill the server's memory with replies to a peer that does not read.
DEFAULT_REPLY_BUDGET_CONN = 1 << 20
#: ... and of all connections together, every connection's: bounds reply memory server-wide.
DEFAULT_REPLY_BUDGET = 32 << 20
#: Request buffers beyond the per-connection keep sizes (large metadata, large key batches),
#: server-wide; a request over it is answered BUSY (a 4096-key batch needs ~0.5 MiB).
DEFAULT_REQUEST_BUDGET = 32 << 20
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_STALL_TIMEOUT_S = 10.0
DEFAULT_MIN_RATE = 1 << 20

ENV_PREFIX = "KVFABRIC_SERVE_"


def opt(default: Any, help: str, *, why: str = "", type: Any = str, choices: Sequence[str] | None = None,
        metavar: str | None = None, group: str = "serve", kind: str = "") -> Any:
    """A :class:`ServerConfig` field: its default, ``--help`` text, why the default is what it is
    (``why``), the flag's ``type``, ``choices`` and ``metavar``, its ``group`` ("common": every pool
    server process, the test reference too; "serve": ``kvfabric serve`` only; "membership") and
    ``kind`` ("size": text or bytes; "list": comma-separated text, a TOML list allowed; "multi": a flag
    given once per value, a TOML list or a comma-separated variable)."""
    return field(default=default, metadata={"help": help, "why": why, "type": type, "choices": choices,
                                            "metavar": metavar, "group": group, "kind": kind})


@dataclass
class ServerConfig:
    """Every ``kvfabric serve`` setting (see the module docstring for where values come from)."""

    # ------------------------------------------------------------ every pool server process
    host: str = opt("127.0.0.1", "address to bind", group="common",
                    why="loopback: a pool holds prompt contents; listening on a network is a decision")
    port: int = opt(7070, "TCP port; 0 picks a free one", type=int, group="common",
                    why="a fixed, unprivileged port so clients can be configured without discovery")
    capacity: str = opt("4GiB", "arena size: 4GiB, 512MiB, 4GB (decimal) or bytes; a bare 4G is refused as "
                        "ambiguous", group="common", kind="size",
                        why="preallocated at start: large enough to hold a few long prompts of an 8B "
                            "model (128 KiB/token: 4 GiB = 32k tokens), small enough for a laptop")
    policy: str = opt("lru", "eviction policy (listed below)", group="common",
                      why="LRU is the policy every engine's own prefix cache uses; the others are opt-in")
    auth_token: str | None = opt(None, "require this token in HELLO (must not be empty)", group="common",
                                 why="off on loopback; set it whenever --host is not loopback")
    auth_token_file: str | None = opt(None, "read the auth token from this file", group="common",
                                      why="keeps the token out of the process list")
    max_connections: int = opt(DEFAULT_MAX_CONNECTIONS, "concurrent connections", type=int, group="common",
                               why="4 pooled connections per client x 256 engine processes")
    stall_timeout: float = opt(DEFAULT_STALL_TIMEOUT_S, "seconds a peer may stall mid-frame", type=float,
                               group="common",
                               why="far above any healthy pause (GC, a loaded host), short enough "
                                   "that a dead peer frees its slot and buffers quickly")
    min_rate: str = opt("1MiB", "slowest accepted transfer rate per frame, bytes/s", group="common",
                        kind="size", why="a peer trickling bytes slower than a 2000s modem is an attack")
    max_lease_ms: int = opt(DEFAULT_MAX_LEASE_MS, f"cap on LOOKUP and shm leases, 0..{MAX_LEASE_MS}", type=int,
                            group="common", why="see DEFAULT_MAX_LEASE_MS")
    max_namespaces: int = opt(MAX_NAMESPACES, f"namespace tags the server can know (PUT ns, RETIRE), 1..{MAX_NAMESPACES}",
                              type=int, group="common",
                              why="about 1.8 MB of table at the maximum; a tag past it is refused BUSY, since a "
                                  "retired tag is never forgotten")
    server_id: str | None = opt(None, "id reported in HELLO/STATS (default host:port)", group="common",
                                why="ownership follows the id; host:port is unique on one network")
    log_level: str = opt("info", "log level (warning: only what needs attention)",
                         choices=("debug", "info", "warning", "error"), group="common",
                         why="info: the start-up lines (capacity, policy, tiers) show what the server took of its "
                             "options; nothing is logged per request; the listening and shutdown lines are "
                             "printed whatever the level")
    # ------------------------------------------------------------ kvfabric serve
    transports: str = opt("tcp,native", "comma-separated transports to offer: tcp, native, shm, nixl "
                          "(shm only when asked for: an attached same-host client maps the arena)", kind="list",
                          why="shm maps the whole arena into the client: only for trusted same-host engines")
    zerocopy: str = opt("auto", "IORING_OP_SEND_ZC for GET replies (default: for peers off this host, "
                        "when the kernel has it)", choices=("auto", "on", "off"),
                        why="zero-copy pays off for large objects to remote peers, not on loopback")
    huge_pages: str = opt("off", "advise transparent huge pages on the arena (MADV_HUGEPAGE); the host grants them "
                          "only where /sys/kernel/mm/transparent_hugepage/shmem_enabled is advise (or always, "
                          "within_size)", choices=("off", "on"),
                          why="SSD-tier reads into 2 MiB pages took ~30% less time here; where granted the arena "
                              "is faulted in before the port opens (a huge page first touched by a PUT stalled it "
                              "up to 32 ms), which can delay the start by seconds: opt in")
    shm_socket: str | None = opt(None, "path of the shm unix socket (default: shm-<port>.sock in "
                                 "$XDG_RUNTIME_DIR/kvfabric or /tmp/kvfabric-<uid>, a directory created 0700)",
                                 metavar="PATH", why="a private per-user directory")
    shm_group: str | None = opt(None, "let this group (name or gid) attach too: socket 0660, default "
                                "directory 0750", metavar="GROUP", why="same uid only unless asked")
    shm_allow_uid: str = opt("", "shm peers allowed besides the server's own uid (SO_PEERCRED)",
                             metavar="UID[,UID]", kind="list", why="same uid only unless asked")
    shm_allow_gid: str = opt("", "shm peers allowed by effective or supplementary group (SO_PEERCRED)",
                             metavar="GID[,GID]", kind="list", why="same uid only unless asked")
    idle_timeout: float = opt(DEFAULT_IDLE_TIMEOUT_S, "close connections idle between frames this many "
                              "seconds; 0 = never", type=float, why="see DEFAULT_IDLE_TIMEOUT_S")
    drain_timeout: float = opt(DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM, let frames in flight finish for up to "
                               "this many seconds", type=float, why="see DEFAULT_DRAIN_TIMEOUT_S")
    reply_budget_conn: str = opt("1MiB", "bytes of queued replies on one connection before its next "
                                 "request waits", kind="size", why="see DEFAULT_REPLY_BUDGET_CONN")
    reply_budget: str = opt("32MiB", "bytes of queued replies on all connections before every next "
                            "request waits", kind="size", why="see DEFAULT_REPLY_BUDGET")
    request_budget: str = opt("32MiB", "bytes of large request buffers (metadata > 4 KiB, batches > 64 keys) "
                              "server-wide; over it a request gets BUSY", kind="size",
                              why="see DEFAULT_REQUEST_BUDGET")
    reserve_budget: str = opt("auto", "bytes of PUT slots reserved but not yet received server-wide; over it "
                              "the next PUT object waits (auto: a quarter of the capacity)", kind="size",
                              why="slow uploads cannot reserve the whole arena ahead of their bytes")
    evict_watermarks: str = opt("auto", "evict ahead of demand when free space < LOW (fraction of capacity) "
                                "until HIGH is free; 0,0 evicts only when a PUT finds no room (auto: 64 MiB / "
                                "128 MiB, at most 5%% / 10%% of the capacity)", metavar="LOW,HIGH",
                                why="headroom keeps PUTs from waiting for a Python eviction round "
                                    "(kvfabric/server/native.py auto_watermarks)")
    metrics_port: int | None = opt(None, "serve Prometheus metrics (a view of STATS) at "
                                   "http://METRICS_HOST:PORT/metrics; 0 picks a free port (default: off)",
                                   type=int, why="off unless asked: one more open port is a decision")
    metrics_host: str = opt("127.0.0.1", "address of the metrics endpoint",
                            why="loopback: a Prometheus agent on the host scrapes it")
    metrics_max_connections: int = opt(8, "metrics requests served at once (one thread each); the next "
                                       "connection is answered 503 and closed", type=int,
                                       why="Prometheus scrapes with one connection; 8 leaves room for a few more "
                                           "scrapers while bounding the endpoint's threads and memory")
    metrics_timeout: float = opt(10.0, "seconds a metrics request may take to arrive (then the connection is "
                                 "dropped; idle keep-alive ones too) and each write of its answer may wait",
                                 type=float, why="Prometheus sends its ~300-byte request at once; a half-sent "
                                                 "request must not hold a thread for good")
    kv_events: str | None = opt(None, "publish this server's stored/removed objects by medium (DRAM, SSD) as "
                                "vLLM KV events on a ZMQ PUB socket bound here, tcp://HOST:PORT or ipc://PATH "
                                "(default: off; kvfabric/server/kv_events.py)", metavar="ENDPOINT",
                                why="off unless asked: one more open port, and a consumer to feed")
    kv_events_replay: str | None = opt(None, "with --kv-events: vLLM's replay ROUTER socket bound here, which "
                                       "answers a subscriber's request for the batches from a sequence number on",
                                       metavar="ENDPOINT", why="only consumers that recover gaps need it")
    kv_events_ring: int = opt(65536, "events kept for the publisher: the SSD tier's ring in C and the queue to "
                              "the publisher thread; a full one is published as AllBlocksCleared (counted in "
                              "kv_events resets)", type=int, metavar="N",
                              why="~10 MiB of rings; a round of the control thread moves far fewer")
    # ------------------------------------------------------------ SSD tier (docs/notes/tier.md)
    ssd_path: tuple[str, ...] = opt((), "directory of the SSD tier (its file kvfabric-tier.v1 is preallocated "
                                    "there; O_DIRECT required); repeat for several disks (default: no SSD tier)",
                                    metavar="DIR", group="serve", kind="multi",
                                    why="off unless asked: it needs a local disk and takes its space")
    ssd_capacity: str | None = opt(None, "bytes of SSD tier in all, split evenly over the --ssd-path directories "
                                   "(required with them)", metavar="SIZE", kind="size",
                                   why="no default: how much of a disk to take is the operator's decision")
    ssd_admit: str = opt("all", "which evicted objects are written to the SSD tier: all, or hit (only objects "
                         "read at least once while in DRAM)", choices=("all", "hit"),
                         why="keep every evicted block: a prefix written once is often read only later")
    ssd_write_queue: str = opt("64MiB", "bytes of evicted objects staged for writing; over it evictions are not "
                               "kept (counted in ssd_write_drops; the server never waits for the disk)",
                               metavar="SIZE", kind="size",
                               why="bounds the staging memory; ~30 ms of a fast NVMe's write bandwidth")
    shared_path: str | None = opt(None, "shared-filesystem tier: a directory every pool server mounts (NFS, CephFS, "
                                  "JuiceFS, DingoFS, Lustre); committed PUTs are written there once by key, keys "
                                  "missing here are looked for there (default: off; docs/notes/tier-shared.md)",
                                  metavar="DIR", why="off unless asked: it needs a filesystem every server mounts")
    shared_fsync: str = opt("never", "fdatasync each shared-tier object before it is linked into place (never: "
                            "every file is verified when read, so fsync only narrows what a host crash loses)",
                            choices=("always", "never"),
                            why="a torn file is detected and dropped on read; fsync per object costs a disk flush")
    tier_group: str | None = opt(None, "let this group (name or gid) share the tier directories: files the "
                                 "server creates there 0640 and directories 0770 of that group (default 0600 / "
                                 "0700), and a --ssd-path or --shared-path directory of that group may be "
                                 "group-writable", metavar="GROUP",
                                 why="the server's uid only unless asked, as --shm-group")
    tier_dir_insecure_ok: bool = opt(False, "start even when a --ssd-path or --shared-path directory is writable "
                                     "by group or others, or owned by another uid (anyone who can write it can "
                                     "plant or remove tier objects)", type=bool,
                                     why="refused by default, as the shm directory is: such a directory lets "
                                         "another local user plant objects or redirect the server's writes")
    # ------------------------------------------------------------ membership (etcd)
    etcd: str | None = opt(None, "register in this etcd (https://HOST:PORT or http://HOST:PORT, or a "
                           "comma-separated list; USER:PASSWORD@ for etcd auth) under --cluster", metavar="URL",
                           group="membership", why="static lists need none")
    etcd_ca: str | None = opt(None, "CA file (PEM) that https:// etcd endpoints are verified against (default: "
                              "the system's trust store)", metavar="FILE", group="membership",
                              why="production etcd is TLS with its own CA (docs/cluster.md)")
    etcd_cert: str | None = opt(None, "client certificate (PEM) for an etcd that requires one", metavar="FILE",
                                group="membership", why="only etcds started with --client-cert-auth need it")
    etcd_key: str | None = opt(None, "private key of --etcd-cert when it is a separate file", metavar="FILE",
                               group="membership", why="often in the certificate's own file")
    cluster: str = opt("default", "cluster name to register under", group="membership",
                       why="one cluster per etcd is the common case")
    etcd_ttl: int = opt(10, "etcd lease TTL: a server that dies leaves the cluster this long after",
                        type=int, metavar="SECONDS", group="membership",
                        why="clients stop routing to a dead server within 10 s; keep-alives every few s")
    advertise: str | None = opt(None, "host clients should connect to, published in etcd (default --host; "
                                "needed when --host is a wildcard such as 0.0.0.0)", metavar="HOST",
                                group="membership", why="--host is right unless it is a wildcard")

    def to_toml(self) -> str:
        """The settings as a TOML file ``--config`` reads back (None settings left out, the token and an
        etcd password masked)."""
        lines = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "auth_token":
                v = "***"
            elif f.name == "etcd":
                v = redact_url(v)
            lines.append(f"{f.name} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser, groups: Sequence[str], *, suppress: bool = False) -> None:
    """Add the flags of the fields in ``groups`` to ``p``. ``suppress``: a flag not given leaves no
    attribute (so :func:`load` can tell given from default); otherwise the default is set."""
    for f in fields(ServerConfig):
        md = f.metadata
        if md["group"] not in groups:
            continue
        kw: dict[str, Any] = {"help": md["help"] + ("" if f.default is None or "default" in md["help"]
                                                     else f" (default {f.default})")}
        kw["default"] = argparse.SUPPRESS if suppress else (list(f.default) if md["kind"] == "multi" else f.default)
        if md["kind"] == "multi":
            kw["action"] = "append"
        if md["type"] is bool:  # a switch: given means true
            kw["action"] = "store_true"
        elif md["type"] is not str:
            kw["type"] = md["type"]
        if md["choices"]:
            kw["choices"] = list(md["choices"])
        if md["metavar"]:
            kw["metavar"] = md["metavar"]
        p.add_argument(flag(f.name), dest=f.name, **kw)


def _coerce(name: str, value: Any, source: str) -> Any:
    """``value`` (from a file or the environment) as the field's type; SystemExit naming it otherwise."""
    f = _FIELDS[name]
    md = f.metadata
    typ, kind = md["type"], md["kind"]
    if kind == "multi":  # a TOML list, a comma-separated variable, or repeated flags
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) and x for x in items):
            raise SystemExit(f"kvfabric serve: {source} setting {name}={value!r}: expected a list of strings")
        return tuple(items)
    try:
        if kind == "list" and isinstance(value, list):
            value = ",".join(str(x) for x in value)
        if isinstance(value, str) and source == "env":
            if typ is bool:
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError("expected 1/0, true/false or yes/no")
                value = value.lower() in ("1", "true", "yes")
            elif typ is int:
                value = int(value)
            elif typ is float:
                value = float(value)
        if kind == "size" and isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if typ is int and isinstance(value, bool) or not isinstance(value, typ):
            raise TypeError(f"expected {typ.__name__}, got {type(value).__name__}")
    except (TypeError, ValueError) as e:
        raise SystemExit(f"kvfabric serve: {source} setting {name}={value!r}: {e}") from None
    if md["choices"] and value not in md["choices"]:
        raise SystemExit(f"kvfabric serve: {source} setting {name}={value!r}: choose from {list(md['choices'])}")
    return value


_FIELDS = {f.name: f for f in fields(ServerConfig)}


def read_file(path: str) -> dict[str, Any]:
    """The settings of a TOML file (SystemExit naming the file, a syntax error or unknown keys)."""
    import tomllib

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise SystemExit(f"kvfabric serve: --config: cannot read {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"kvfabric serve: --config {path}: {e}") from None
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise SystemExit(f"kvfabric serve: --config {path}: unknown setting(s) {', '.join(unknown)}; "
                         f"known: {', '.join(_FIELDS)}")
    return {k: _coerce(k, v, f"--config {path}:") for k, v in data.items()}


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVFABRIC_SERVE_*`` settings (SystemExit for an unknown variable or a bad value)."""
    out = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in _FIELDS:
            raise SystemExit(f"kvfabric serve: unknown environment setting {var}; known: "
                             f"{', '.join(ENV_PREFIX + n.upper() for n in _FIELDS)}")
        out[name] = _coerce(name, raw, "env")
    return out


def load(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Defaults < ``--config`` file < ``KVFABRIC_SERVE_*`` < flags given in ``args`` (parsed with
    ``suppress=True``; ``args.config`` is the file or None)."""
    values: dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path:
        values.update(read_file(path))
    values.update(read_env(os.environ if environ is None else environ))
    values.update({k: tuple(v) if _FIELDS[k].metadata["kind"] == "multi" else v
                   for k, v in vars(args).items() if k in _FIELDS})
    return ServerConfig(**values)


def defaults() -> dict[str, Any]:
    """Field name -> default (for documentation and tests)."""
    return {f.name: f.default for f in fields(ServerConfig) if f.default is not MISSING}


__all__ = ["DEFAULT_MAX_LEASE_MS", "ENV_PREFIX", "MAX_LEASE_MS", "ServerConfig", "add_arguments", "load",
           "read_env", "read_file"]
