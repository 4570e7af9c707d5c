"""The native pool server: the io_uring data plane of csrc/ with Python deciding eviction.

This is the one product server: ``kvfabric serve`` (``kvfabric/server/main.py``,
the command line) runs :class:`NativeServer`.

Division of work
----------------
* C (``kvfabric._native.Server``, csrc/kvf_server.c + kvf_send.c + kvf_ops.c + kvf_store.c)
  owns the arena (a memfd), the index, the allocator and every byte: it
  accepts, parses frames, receives PUT objects straight into arena slots,
  verifies and commits them, and sends GET replies from the slots
  (``IORING_OP_SEND_ZC`` to off-host peers when the kernel has it; the arena is
  registered as fixed buffers only with ``zerocopy="on"``). No
  Python runs per frame.
* Python (this module) owns the decisions: configuration, the HELLO reply,
  logging, and eviction. A control thread waits (GIL released) for the data
  plane's INSERT/ACCESS/REMOVE events, feeds them in batches to the
  :mod:`kvfabric.server.eviction` policy, and evicts the policy's victims by
  key when free space falls below the low watermark or a PUT is waiting for
  space; it then tells C the round is done, and parked PUTs retry (an
  exhausted round, where everything left is pinned, answers them NO_SPACE).

Same-host clients (``shm`` in ``--transports``) are served on a filesystem
unix socket whose path is in the HELLO reply (``shm_socket``): by default
``shm-<port>.sock`` in a private directory (:func:`default_shm_dir`, 0700),
the socket 0600 (``shm_group``: 0660 / 0750 for that group); C checks every
peer with SO_PEERCRED (the server's uid, plus ``shm_allow_uids`` /
``shm_allow_gids``). The socket is removed on shutdown; a server killed with
SIGKILL leaves it, and the next shm server using the default directory removes
it (:func:`sweep_stale_sockets`: only sockets of ours nobody listens on). See
:mod:`kvfabric.transport.shm` and docs/notes/security.md.

Failure: a missing extension or an io_uring that cannot be set up makes
:class:`NativeServer` raise :class:`~kvfabric.errors.TransportUnavailable`
(never a silent fallback to another server); ``kvfabric serve`` then exits 2
with what to install (:func:`native_unavailable_reason`).
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from .. import __version__
from ..errors import ConfigError, KVFabricError, TransportUnavailable
from ..protocol import DEFAULT_LIMITS, HelloReply, Limits
from .eviction import EvictionPolicy, make_policy
from .kv_events import DEFAULT_RING as DEFAULT_EVENTS_RING
from .kv_events import EV_ACCESS, EV_INSERT, PoolEvents
from ..sizes import format_size
from .config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_LEASE_MS,
    MAX_NAMESPACES,
    DEFAULT_MIN_RATE,
    DEFAULT_REPLY_BUDGET,
    DEFAULT_REPLY_BUDGET_CONN,
    DEFAULT_REQUEST_BUDGET,
    DEFAULT_STALL_TIMEOUT_S,
)

try:
    from .. import _native
except ImportError as _e:  # pragma: no cover - depends on the build
    _native = None
    _IMPORT_ERROR = str(_e)

log = logging.getLogger("kvfabric.server.native")

_DRAIN_BATCH = 4096
EVENT_RING = 65536   # the store's INSERT/ACCESS/REMOVE ring (csrc/kvf_store.h), drained by the control thread
# Index entries the control thread looks at per round for objects of a retired namespace
# generation (kvf_store_sweep): bounded work per 100 ms round, the whole index covered over rounds.
_SWEEP_ENTRIES = 4096
# How often the control thread reads the retirement records other servers appended to the shared
# directory (one readdir and one fstat per records file, and their new whole records).
_SHARED_RECORDS_S = 5.0
#: HELLO reply fields C writes itself (csrc/kvf_ops.c op_hello): the rest are passed as static pairs
_PER_CONNECTION_HELLO = frozenset(("auth_required", "nonce", "proof"))


def _pairs(d: dict[str, Any]) -> bytes:
    """A map's entries as msgpack key/value pairs without the map header (C writes that, counting them)."""
    return b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in d.items())


#: ``--evict-watermarks auto``: start evicting when less than this much is free ...
AUTO_LOW_BYTES = 64 << 20
#: ... and stop once this much is free; both capped at 5% / 10% of the capacity.
AUTO_HIGH_BYTES = 128 << 20


def native_unavailable_reason() -> str | None:
    """None when the C extension is importable here, else why it is not (the import error)."""
    return None if _native is not None else _IMPORT_ERROR


def auto_watermarks(capacity: int) -> tuple[float, float]:
    """The (low, high) fractions ``--evict-watermarks auto`` uses for ``capacity`` bytes.

    Enough headroom that the control thread evicts ahead of a stream of PUTs
    (a full arena with on-demand eviction parked each PUT for a Python round:
    p99 3.8 ms, max 25 ms for 1 MiB PUTs here, against p99 ~1 ms with
    headroom), small enough that a large arena keeps nearly all of itself for
    cache: 64 MiB / 128 MiB, at most 5% / 10% of the capacity.
    """
    if capacity <= 0:
        raise ConfigError("capacity must be > 0")
    return min(AUTO_LOW_BYTES / capacity, 0.05), min(AUTO_HIGH_BYTES / capacity, 0.10)


def default_shm_dir() -> str:
    """Where the shm socket goes unless ``shm_socket`` names it: ``$XDG_RUNTIME_DIR/kvfabric`` when that
    runtime directory is ours, else ``/tmp/kvfabric-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                return os.path.join(xdg, "kvfabric")
        except OSError:
            pass
    return f"/tmp/kvfabric-{os.geteuid()}"


def resolve_group(group: str | int) -> int:
    """A group name or number -> gid. ConfigError when there is no such group."""
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"unknown group {group!r}") from None


def _private_dir(path: str, gid: int | None) -> None:
    """Create (or check) the directory holding the shm socket: ours, not a symlink, writable by nobody
    else; then exactly 0700 (0750 with group ``gid``). ConfigError when someone else could have put
    things in it."""
    mode = 0o750 if gid is not None else 0o700
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"shm socket directory {path} is not a directory (a symlink?)")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"shm socket directory {path} belongs to uid {st.st_uid}, not to us ({os.geteuid()})")
    if st.st_mode & 0o022:
        raise ConfigError(f"shm socket directory {path} is writable by others (mode {st.st_mode & 0o777:o}); "
                          "remove it or give --shm-socket")
    os.chmod(path, mode)
    if gid is not None:
        os.chown(path, -1, gid)


def _probe_refused(path: str) -> bool:
    """True when nobody listens on the unix socket ``path``: connect() fails with ECONNREFUSED (the
    socket file of a process that died, or was SIGKILLed, without unlinking it). A live socket, a
    full backlog (a timeout) or any other error is False: only a refusal proves it is dead."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1)
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


#: shmem THP modes under which an arena advised huge pages gets them (``shmem_enabled``; ``force`` is a test mode)
THP_GRANTED = ("advise", "within_size", "always", "force")


def shmem_thp() -> str:
    """The host's transparent-huge-page mode for shared memory (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``,
    the bracketed word): an arena advised huge pages (``huge_pages``) gets them under ``advise``, ``within_size``,
    ``always`` or ``force``, not under ``never`` / ``deny``; ``unknown`` where the file cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            words = f.read().split()
    except OSError:
        return "unknown"
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), "unknown")


class _DirLock:
    """An exclusive flock on a directory, held while a server binds and listens on its socket there
    and while stale sockets are swept from it: a socket bound but not yet listening also refuses
    connections, so a sweep must not see one. Best effort: a directory that cannot be opened is not
    locked (only the default directory is swept, and it is always ours)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _DirLock:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1


#: The socket names :class:`NativeServer` gives its shm sockets in the default directory.
_SHM_NAME = re.compile(r"^shm-\d{1,5}\.sock$")
#: At most this many entries of the default directory are looked at per start-up (a limit on the work).
SWEEP_MAX_ENTRIES = 65536


def sweep_stale_sockets(directory: str) -> int:
    """Remove the stale shm sockets of servers that died in ``directory`` (the default one, private
    to us); returns how many were removed.

    A file is removed only when all of these hold: its name is ``shm-<port>.sock``, it is a socket
    (lstat: a symlink is never followed), it belongs to our uid, nobody listens on it (connect()
    is refused, :func:`_probe_refused`) and it is still the same inode just before the unlink.
    Runs under the directory's lock (:class:`_DirLock`), which every server of ours holds from bind
    to listen, so a server starting beside this one is never mistaken for a dead one. Errors
    (a file gone meanwhile, a directory that cannot be read) skip the file, never fail the start.
    """
    removed = 0
    uid = os.geteuid()
    with _DirLock(directory):
        try:
            with os.scandir(directory) as it:
                names = [e.name for _, e in zip(range(SWEEP_MAX_ENTRIES), it) if _SHM_NAME.match(e.name)]
        except OSError:
            return 0
        for name in names:
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid or not _probe_refused(path):
                    continue
                if os.lstat(path).st_ino != st.st_ino:
                    continue
                os.unlink(path)
                removed += 1
            except OSError:
                continue
    return removed


def _bind_shm_socket(path: str, gid: int | None) -> tuple[socket.socket, int]:
    """Bind and listen on the filesystem unix socket ``path`` (0600; 0660 for group ``gid``).

    A stale socket of ours at ``path`` (nobody listens: a server that died) is replaced; a live one,
    or anything else there, is an error. Returns the socket and the inode bound (removed on shutdown only if it is still that one).
    """
    if len(os.fsencode(path)) >= 108:
        raise ConfigError(f"shm socket path is too long for a unix socket (max 107 bytes): {path}")
    with _DirLock(os.path.dirname(path)):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                raise ConfigError(f"{path} exists and is not a socket of ours; not replacing it")
            if not _probe_refused(path):
                raise ConfigError(f"another server is listening on {path}; give --shm-socket")
            os.unlink(path)  # nobody listens: a server that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # bind() creates it by the umask; until chmod the SO_PEERCRED check still stands
            os.chmod(path, 0o660 if gid is not None else 0o600)
            if gid is not None:
                os.chown(path, -1, gid)
            sock.listen(256)
            return sock, os.lstat(path).st_ino
        except PermissionError as e:
            sock.close()
            raise ConfigError(f"cannot set up the shm socket {path}: {e}") from e
        except BaseException:
            sock.close()
            raise


#: ``--shared-fsync``: the C tier's fsync mode (kvf_shared.h KVF_SHARED_FSYNC_*).
SHARED_FSYNC_MODES = {"never": 0, "always": 1}


#: The flag that lets a server start on a tier directory :func:`check_tier_dir` refuses.
INSECURE_OK_FLAG = "--tier-dir-insecure-ok"


def check_tier_dir(flag: str, path: str, gid: int | None, insecure_ok: bool) -> None:
    """Refuse (ConfigError naming the path, the reason and the flag that overrides it) a tier directory
    (``--ssd-path`` / ``--shared-path``) that another local user could write: owned by another uid, or
    writable by others, or by its group unless that group is the tier group ``gid`` (``--tier-group``).
    The shm directory is checked the same way (:func:`_private_dir`). With ``insecure_ok``
    (``--tier-dir-insecure-ok``) such a directory is logged as a WARNING and used. A path that does not
    exist or is not a directory is left to the caller's own message. Below the directory the C tiers
    check every component as they open it (csrc/kvf_shared.c, kvf_tier.c)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    mode = st.st_mode & 0o7777
    why = None
    if st.st_uid != os.geteuid():
        why = f"belongs to uid {st.st_uid}, not to this server (uid {os.geteuid()}); chown it"
    elif mode & 0o002:
        why = f"is writable by others (mode {mode:o}); chmod o-w it (0700)"
    elif mode & 0o020 and (gid is None or st.st_gid != gid):
        why = (f"is writable by its group {st.st_gid} (mode {mode:o}), which is not --tier-group; chmod g-w it, "
               "or name that group with --tier-group")
    if why is None:
        return
    if insecure_ok:
        log.warning("%s %s %s: started anyway (%s): anyone who can write it can plant or remove tier objects",
                    flag, path, why.split(";")[0], INSECURE_OK_FLAG)
        return
    raise ConfigError(f"{flag} {path} {why}, or give {INSECURE_OK_FLAG} to start anyway: another local user "
                      "could plant tier objects there or redirect the server's writes")


#: The retirement records' directory under --shared-path (csrc/kvf_shared.h KVF_SHARED_RETIRED_DIR).
SHARED_RETIRED_DIR = "kvfabric-retired"


def check_shared_path(path: str, gid: int | None = None, insecure_ok: bool = False) -> str:
    """The absolute path of a usable ``--shared-path`` directory, or ConfigError saying what is wrong.

    The directory must exist (it is a mount every server shares; creating it here would hide a missing
    mount), pass :func:`check_tier_dir`, and this process must be able to create and remove a file in
    it. The C tier checks the same again when it opens the directory (kvf_shared_open).
    """
    full = os.path.abspath(path)
    if not os.path.exists(full):
        raise ConfigError(f"--shared-path {full}: no such directory (it must exist: the filesystem every "
                          "server mounts)")
    if not os.path.isdir(full):
        raise ConfigError(f"--shared-path {full}: not a directory")
    check_tier_dir("--shared-path", full, gid, insecure_ok)
    # the pool's retirement records (docs/notes/retire.md): the C tier refuses the same (kvf_shared_retired_open),
    # whatever --tier-dir-insecure-ok says: a redirected records directory could hide retirements
    records = os.path.join(full, SHARED_RETIRED_DIR)
    if os.path.islink(records):
        raise ConfigError(f"--shared-path {full}: {records} is a symlink (the retirement records must be in the "
                          "directory itself); remove it")
    if os.path.lexists(records):
        if not os.path.isdir(records):
            raise ConfigError(f"--shared-path {full}: {records} is not a directory; remove it")
        check_tier_dir("--shared-path", records, gid, False)
    probe = os.path.join(full, f".probe.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--shared-path {full}: cannot create files there ({e.strerror})") from None
    return full


class ListenError(OSError):
    """The TCP port cannot be bound: ``str()`` is one line naming it, ``cannot listen on
    127.0.0.1:7070: address already in use`` (``errno`` is the bind's)."""

    def __str__(self) -> str:
        return str(self.strerror)


def listen_error(host: str, port: int, e: OSError) -> ListenError:
    """The :class:`ListenError` for a bind of (host, port) that failed with ``e``."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    why = e.strerror or str(e)
    return ListenError(e.errno, f"cannot listen on {where}: {why[:1].lower()}{why[1:]}")


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), SO_REUSEADDR, not listening yet (the C loop listens).
    :class:`ListenError` when it cannot be bound (taken, not ours to bind, no such address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise listen_error(host, port, e) from e
    except BaseException:
        sock.close()
        raise
    return sock


class NativeServer:
    """One native pool server in this process: C data-plane thread + Python control thread.

    ``transports`` is what HELLO advertises; ``shm`` adds the unix listener
    (``shm_socket``: its path, default in :func:`default_shm_dir`;
    ``shm_group``: a group that may connect too, socket 0660; ``shm_allow_uids``
    / ``shm_allow_gids``: peers allowed besides our own uid, checked with
    SO_PEERCRED; ``shm_group`` is added to the allowed gids).
    ``low_watermark``/``high_watermark`` are fractions of the capacity: when
    free space drops below the low one the control thread evicts until the
    high one is free, ahead of demand. (0, 0), this class's default, evicts
    only on demand, when a PUT finds no room: the Python server's exact
    behaviour, but each such PUT waits for a Python eviction round. The
    command line defaults to :func:`auto_watermarks`, which takes that wait
    off the PUT path at the price of keeping up to 128 MiB free. The order
    of eviction is the policy's either way. A peer that stalls mid-frame, or stops reading a reply,
    for ``stall_timeout_s`` is disconnected (idle connections are kept), and so
    is one whose frame (or reply) of S bytes is not done within
    ``stall_timeout_s + S / min_rate`` seconds of its start even though bytes keep
    trickling (``min_rate`` bytes/s, default 1 MiB/s, as the Python server). A connection idle
    between frames for ``idle_timeout_s`` (0: never; default 300 s) is closed, and with a token
    one that has not authenticated within ``stall_timeout_s`` of its accept. Memory: queued replies pause a
    connection's reading over ``reply_budget_conn`` bytes (its own) or ``reply_budget`` (all),
    large request buffers answer BUSY over ``request_budget``, and PUT slots reserved but not yet
    received wait over ``reserve_budget`` (default: a quarter of the capacity); see
    docs/notes/server.md for the bound they give. ``prefault`` (default on): fault the arena in, in
    the background, once the server answers (off when the arena does not fit in free memory:
    :mod:`kvfabric.server.memory`). ``huge_pages``: advise transparent huge pages on the arena
    (MADV_HUGEPAGE), which the host grants per its shmem THP mode (:func:`shmem_thp`): SSD-tier reads
    into 2 MiB pages took ~30% less time here. Where granted, the arena is faulted in before the port
    opens (a huge page first touched by a PUT stalled it for up to 32 ms), which delays the start
    (0.2 s for 512 MiB here, 8-10 s for 1-3 GiB the VM had not touched before): off by default
    (docs/notes/bench-tier.md). With ``shm`` and no ``shm_socket``, stale sockets of dead
    servers are swept from the default directory first (:func:`sweep_stale_sockets`). Raises
    ``TransportUnavailable`` when the extension or io_uring is unavailable, ``ConfigError`` for bad
    options, :class:`ListenError` (an ``OSError``) when the port cannot be bound.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        capacity: int,
        policy: str = "lru",
        auth_token: str | None = None,
        transports: Sequence[str] = ("tcp", "native", "shm"),
        server_id: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        zerocopy: str = "auto",
        low_watermark: float = 0.0,
        high_watermark: float = 0.0,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        max_lease_ms: int = DEFAULT_MAX_LEASE_MS,
        max_namespaces: int = MAX_NAMESPACES,
        min_rate: float = DEFAULT_MIN_RATE,
        shm_socket: str | None = None,
        shm_group: str | int | None = None,
        shm_allow_uids: Sequence[int] = (),
        shm_allow_gids: Sequence[int] = (),
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        reply_budget_conn: int = DEFAULT_REPLY_BUDGET_CONN,
        reply_budget: int = DEFAULT_REPLY_BUDGET,
        request_budget: int = DEFAULT_REQUEST_BUDGET,
        reserve_budget: int | None = None,
        ssd_paths: Sequence[str] = (),
        ssd_capacity: int = 0,
        ssd_admit: str = "all",
        ssd_write_queue: int = 64 << 20,
        ssd_promote_max: int | None = None,
        shared_path: str | None = None,
        shared_fsync: str = "never",
        tier_group: str | int | None = None,
        tier_dir_insecure_ok: bool = False,
        prefault: bool = True,
        huge_pages: bool = False,
        kv_events: str | None = None,
        kv_events_replay: str | None = None,
        kv_events_ring: int = DEFAULT_EVENTS_RING,
    ) -> None:
        if _native is None:
            raise TransportUnavailable(f"the C extension is not built: {_IMPORT_ERROR}")
        if zerocopy not in ("auto", "on", "off"):
            raise ConfigError(f"zerocopy must be auto|on|off, got {zerocopy!r}")
        if min_rate <= 0:
            raise ConfigError("min_rate must be > 0 bytes/s")
        if idle_timeout_s < 0 or drain_timeout_s <= 0:
            raise ConfigError("idle_timeout_s must be >= 0 (0: never) and drain_timeout_s > 0")
        if min(reply_budget_conn, reply_budget, request_budget, reserve_budget or 1) < 1:
            raise ConfigError("memory budgets must be >= 1 byte")
        if not 0 <= low_watermark <= high_watermark < 1:
            raise ConfigError("watermarks must satisfy 0 <= low <= high < 1")
        unknown = set(transports) - {"tcp", "native", "shm", "nixl"}
        if unknown:
            raise ConfigError(f"unknown transports {sorted(unknown)}")
        if shared_fsync not in SHARED_FSYNC_MODES:
            raise ConfigError(f"shared_fsync must be always|never, got {shared_fsync!r}")
        self.kv_events = (PoolEvents(kv_events, replay_endpoint=kv_events_replay, ring=kv_events_ring)
                          if kv_events is not None else None)
        if kv_events is None and kv_events_replay is not None:
            raise ConfigError("--kv-events-replay needs --kv-events")
        tier_gid = resolve_group(tier_group) if tier_group is not None else None
        for d in ssd_paths:
            check_tier_dir("--ssd-path", os.path.abspath(d), tier_gid, tier_dir_insecure_ok)
        self.shared_path = (check_shared_path(shared_path, tier_gid, tier_dir_insecure_ok)
                            if shared_path is not None else None)
        self.policy: EvictionPolicy = make_policy(policy)
        self._sizes: dict[bytes, int] = {}
        self._lock = threading.Lock()
        # Bound now (so the port is known and taken), listened on by the C loop
        # only once it runs: a client never connects to a server that cannot answer.
        self._max_meta = limits.max_meta_bytes
        self._tcp = _bound_socket(host, port)
        self.host, self.port = self._tcp.getsockname()[:2]
        self.server_id = server_id or f"{self.host}:{self.port}"
        self._unix: socket.socket | None = None
        self._unix_ino = 0
        self.shm_socket: str | None = None
        allow_gids = [int(g) for g in shm_allow_gids]
        if "shm" in transports:
            try:
                gid = resolve_group(shm_group) if shm_group is not None else None
                if gid is not None:
                    allow_gids.append(gid)
                if shm_socket is None:
                    shm_dir = default_shm_dir()
                    _private_dir(shm_dir, gid)
                    swept = sweep_stale_sockets(shm_dir)
                    if swept:
                        log.info("shm: removed %d stale socket(s) of servers that died from %s", swept, shm_dir)
                    shm_socket = os.path.join(shm_dir, f"shm-{self.port}.sock")
                self._unix, self._unix_ino = _bind_shm_socket(os.path.abspath(shm_socket), gid)
            except BaseException:
                self._tcp.close()
                raise
            self.shm_socket = os.path.abspath(shm_socket)
        self.transports = tuple(t for t in ("shm", "nixl", "native", "tcp") if t in transports or t == "tcp")
        hello = HelloReply(
            server=f"kvfabric-native/{__version__}", server_id=self.server_id, transports=self.transports,
            limits=limits, capacity=capacity, shm_socket=self.shm_socket,
        ).to_meta()
        # C writes the map around these, with auth_required and each connection's nonce and proof
        hello_pairs = _pairs({k: v for k, v in hello.items() if k not in _PER_CONNECTION_HELLO})
        extra = {"policy": self.policy.name, "transports": list(self.transports), "server_id": self.server_id}
        extra_bytes = _pairs(extra)
        try:
            self._srv = _native.Server(
                self._tcp.fileno(), self._unix.fileno() if self._unix else -1, capacity,
                hello_pairs=hello_pairs, stats_extra=extra_bytes, server_id=self.server_id, event_ring=EVENT_RING,
                auth=auth_token, max_conns=max_connections, max_keys=limits.max_keys_per_batch,
                max_key_bytes=limits.max_key_bytes, max_meta=limits.max_meta_bytes,
                max_payload=limits.max_payload_bytes, max_object=limits.max_object_bytes,
                max_in_flight=limits.max_in_flight, zerocopy={"auto": -1, "off": 0, "on": 1}[zerocopy],
                stall_ms=max(0, int(stall_timeout_s * 1000)), max_lease_ms=max(0, int(max_lease_ms)),
                ns_max=int(max_namespaces),
                min_rate=max(1, int(min_rate)), shm_uids=[int(u) for u in shm_allow_uids], shm_gids=allow_gids,
                idle_ms=int(idle_timeout_s * 1000),
                # with a token, a connection must authenticate within the stall timeout
                preauth_ms=max(1, int(stall_timeout_s * 1000)) if auth_token else 0,
                drain_ms=max(1, int(drain_timeout_s * 1000)),
                reply_conn_budget=int(reply_budget_conn), reply_budget=int(reply_budget),
                request_budget=int(request_budget),
                reserve_budget=int(reserve_budget if reserve_budget is not None else max(1, capacity // 4)),
                shared_path=self.shared_path, shared_fsync=SHARED_FSYNC_MODES[shared_fsync],
                tier_gid=-1 if tier_gid is None else tier_gid,
            )
        except (OSError, KVFabricError) as e:
            self._close_sockets()
            raise TransportUnavailable(f"the io_uring data plane cannot start here: {e}") from e
        self.huge_pages = "off"          # what the start-up line says
        self._huge_granted = False       # advised, and the host grants them: faulted in before the port opens
        if huge_pages:  # before anything touches the arena: its pages are faulted in as huge ones from the start
            try:
                self._srv.advise_huge_pages()
            except OSError as e:
                self.huge_pages = f"not advised: {e}"
            else:
                mode = shmem_thp()
                self.huge_pages = f"advised (host shmem THP {mode})"
                self._huge_granted = mode in THP_GRANTED
        self._nixl = None
        if "nixl" in self.transports:
            self._export_arena(capacity)
            if not auth_token:
                log.warning("nixl offered without --auth-token: any peer that reaches port %d can attach and "
                            "read and write every byte of the arena through NIXL", self.port)
        if ssd_paths:
            self._open_tier(ssd_paths, ssd_capacity, ssd_admit, ssd_write_queue, ssd_promote_max,
                            -1 if tier_gid is None else tier_gid, kv_events_ring if self.kv_events else 0)
        elif self.shared_path is not None:  # the tier thread alone runs the shared tier's I/O
            self._srv.tier_open([], 0, write_queue=int(ssd_write_queue), promote_max=int(ssd_promote_max or 0))
        if self.shared_path is not None:
            log.info("shared tier: %s (fsync %s); committed PUTs are written through%s", self.shared_path,
                     shared_fsync, "; files carry a MAC keyed by the token" if auth_token else "")
            if not auth_token:
                log.warning("shared tier %s: no --auth-token, so its files carry no MAC: anyone who can write "
                            "that directory can plant objects this server will serve", self.shared_path)
        self.capacity = capacity
        self._prefault = prefault
        self._low = int(capacity * low_watermark)
        self._high = int(capacity * high_watermark)
        self._stop = threading.Event()
        self._stopping = False
        self._events_dropped = 0
        self._next_records_read = time.monotonic() + _SHARED_RECORDS_S  # loaded at start (Server init)
        self.loop_error: BaseException | None = None  # set if the io_uring loop failed (the process should stop)
        self._threads: list[threading.Thread] = []
        self._drain_timeout_s = drain_timeout_s

    def _export_arena(self, capacity: int) -> None:
        """Register the arena with a NIXL agent and hand C its metadata: SHM_ATTACH on a TCP connection
        whose HELLO listed ``nixl`` answers it (after AUTH when there is a token). ConfigError when nixl
        cannot be used here: asked for, it is offered or the server does not start."""
        from ..transport import nixl

        reason = nixl.probe()
        if reason is not None:
            self._close_sockets()
            raise ConfigError(f"--transports lists nixl but it cannot be used here: {reason}")
        try:
            self._nixl = nixl.ArenaExport(self._srv.memfd, capacity)
            self._srv.set_remote_arena(self._nixl.metadata, self._nixl.base)
        except ValueError as e:
            self._close_sockets()
            raise ConfigError(f"nixl: the agent's metadata ({len(self._nixl.metadata) if self._nixl else 0} bytes) "
                              f"does not fit the metadata limit ({self._max_meta} bytes): raise max_meta_bytes") from e
        except TransportUnavailable as e:
            self._close_sockets()
            raise ConfigError(f"--transports lists nixl but it cannot be used here: {e}") from e

    def _open_tier(self, paths: Sequence[str], capacity: int, admit: str, write_queue: int,
                   promote_max: int | None, gid: int, events: int = 0) -> None:
        """Open the SSD tier (rebuilding its index from the files) and attach it to the data plane.

        ConfigError (the server does not start) for bad options, a missing or unwritable directory, a
        filesystem without O_DIRECT (there is no buffered fallback: the tier must not go through the page
        cache), too little space to preallocate ``capacity``, or a tier file another user could have
        planted or could read (a symlink, another uid's, group/other access beyond ``gid``'s).
        """
        if admit not in ("all", "hit"):
            raise ConfigError(f"ssd_admit must be all|hit, got {admit!r}")
        if capacity <= 0 or write_queue < 8192:
            raise ConfigError("ssd_capacity must be > 0 and ssd_write_queue >= 8 KiB")
        try:
            self._srv.tier_open([os.path.abspath(p) for p in paths], int(capacity), admit={"all": 0, "hit": 1}[admit],
                                write_queue=int(write_queue), promote_max=int(promote_max or 0), gid=gid,
                                events=events)
        except OSError as e:
            self._close_sockets()
            raise ConfigError(f"SSD tier: {e.strerror or e}") from e
        log.info("SSD tier: %s, %s (%d bytes), admit %s; %d objects found", ",".join(paths), format_size(capacity),
                 capacity, admit, self.stats()["ssd_objects"])

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> NativeServer:
        """Start the data-plane and control threads; returns self once the port accepts connections.

        The C loop calls ``listen()`` itself when it starts, so the port
        accepts only when the loop can answer. Raises ``TransportUnavailable``
        when the loop fails to start (the threads are stopped).
        """
        if self.kv_events is not None:
            try:
                self.kv_events.start()   # bound before the data plane runs: no event is published to nobody
            except ConfigError:
                self.stop()   # nothing runs yet: closes the tier, the nixl export and the sockets
                raise
        # Huge pages are faulted in before the port opens: the first touch of one (allocated and zeroed 2 MiB at
        # a time) in the data plane stalled PUTs for up to 32 ms (docs/notes/bench-tier.md)
        populate_first = self._prefault and self._huge_granted
        if populate_first:
            self._populate()
        for target, name in ((self._run_loop, "kvf-io_uring"), (self._control, "kvf-control")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        while not self._tcp.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            if self.loop_error is not None or not self._threads[0].is_alive():
                err = self.loop_error
                self.stop()
                raise TransportUnavailable(f"the io_uring loop did not start: {err}")
            time.sleep(0.001)
        if self._prefault and not populate_first:
            t = threading.Thread(target=self._populate, name="kvf-populate", daemon=True)
            t.start()
            self._threads.append(t)
        st = self.stats()
        log.info(
            "native server %s: capacity %s (%d bytes), policy %s, transports %s, send_zc %s, fixed buffers %s, "
            "arena huge pages %s",
            self.server_id, format_size(self.capacity), self.capacity, self.policy.name, ",".join(self.transports),
            st["zerocopy"], st["fixed_buffers"], self.huge_pages,
        )
        return self

    def stop(self) -> None:
        """Stop accepting, drain, join the threads (idempotent).

        Idle connections are closed at once; frames being received finish and
        their replies go out, for at most ``drain_timeout_s``, then everything
        is closed. The control thread runs until the loop is done, so a PUT
        waiting for eviction during the drain still gets its space.
        """
        if self._stopping:
            return
        self._stopping = True
        self._srv.stop()
        if self._threads:
            self._threads[0].join(self._drain_timeout_s + 10)
        self._stop.set()
        for t in self._threads[1:]:
            t.join(10)
        if self.kv_events is not None:
            self.kv_events.stop()
        if not self._threads or not self._threads[0].is_alive():
            self._srv.tier_close()  # after the loop and the control thread: queued write-behind finishes
            if self._nixl is not None:  # no connection is left to start a transfer
                self._nixl.close()
        self._close_sockets()

    def __enter__(self) -> NativeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """What STATS reports, as a dict: the same map, built by the same C function (csrc/kvf_stats.c), and
        ``zerocopy`` / ``fixed_buffers`` read off its ``data_plane``; with nixl offered, ``ucx_transports``
        (the UCX resources its agent may use, comma-separated: a label of ``kvfabric_server_info``)."""
        out = msgpack.unpackb(self._srv.stats_map(), raw=False)
        out["zerocopy"] = "send_zc" in out["data_plane"]
        out["fixed_buffers"] = out["data_plane"].endswith("+fixed")
        if self.kv_events is not None:
            out["kv_events"] = self.kv_events.snapshot()
        if self._nixl is not None:  # what UCX may carry nixl over here (kvfabric/transport/ucx_info.py)
            out["ucx_transports"] = self._nixl.ucx_transports
        return out

    def _close_sockets(self) -> None:
        for s in (self._tcp, self._unix):
            if s is not None:
                s.close()
        if self.shm_socket and self._unix_ino:
            ino, self._unix_ino = self._unix_ino, 0
            try:
                if os.lstat(self.shm_socket).st_ino == ino:  # still ours, not a successor's
                    os.unlink(self.shm_socket)
            except OSError:
                pass

    def _run_loop(self) -> None:
        try:
            self._srv.run()
        except BaseException as e:  # noqa: BLE001 - reported, then the process stops
            self.loop_error = e
            log.error("io_uring loop failed: %s", e)
            self._stop.set()

    def _populate(self) -> None:
        """Fault the arena in, in the background, once the server answers.

        Start-up does not wait for it (faulting 3 GiB in takes seconds here),
        but without it every 4 KiB of the first pass through the arena costs a
        page fault on the loop thread (1 MiB PUTs were 2-6x slower until each
        page had been written once). Pages are populated, not pinned; the
        memory bound counts the whole capacity anyway.
        """
        chunk = 64 << 20
        for off in range(0, self.capacity, chunk):
            if self._stopping:
                return
            try:
                self._srv.populate(off, chunk)
            except OSError as e:  # no MADV_POPULATE_WRITE here: first use faults the pages in
                log.info("arena not populated ahead of use: %s", e)
                return

    # ------------------------------------------------------------------ control thread

    def _control(self) -> None:
        """Feed events to the policy; evict on low space or a waiting PUT. Runs until stop()."""
        srv = self._srv
        srv.set_low_watermark(self._low)
        while not self._stop.is_set():
            want, free, dropped = srv.wait(100)
            self._log_auth_failures()
            srv.sweep(_SWEEP_ENTRIES)  # retired namespaces (issue 27): their objects' space back, a bounded bit a round
            if self.shared_path is not None and time.monotonic() >= self._next_records_read:
                self._read_shared_records()
            self._apply_events(dropped)
            if dropped != self._events_dropped:
                self._events_dropped = dropped
                self._resync()
            if want or free < self._low:
                want, free, _ = srv.wait(0)  # fresh figures: PUTs went on while events were applied
                exhausted = self._evict(free, max(self._high, free + want) if want else self._high, want)
                if want:
                    srv.space_done(exhausted)

    def _read_shared_records(self) -> None:
        """Read the retirements other servers recorded in the shared directory since the last round
        (docs/notes/retire.md): a server that missed a RETIRE (down or unreachable when it was sent)
        retires the same within _SHARED_RECORDS_S. A failure is logged, and the next round tries again."""
        self._next_records_read = time.monotonic() + _SHARED_RECORDS_S
        try:
            self._srv.shared_retired_refresh()
        except OSError as e:
            log.warning("shared tier %s: the retirement records could not be read (%s); tagged objects of "
                        "namespaces this server has not seen are misses until they can", self.shared_path, e)

    def _log_auth_failures(self) -> None:
        """Log the peers the data plane refused with AUTH_FAILED since the last round (C keeps 16 a round)."""
        peers, lost = self._srv.auth_failures()
        for peer in peers:
            log.warning("AUTH_FAILED from %s: it did not prove it holds the pool token; connection closed", peer)
        if lost:
            log.warning("AUTH_FAILED from %d more peers (not named: over 16 in 100 ms)", lost)

    def _apply_events(self, dropped: int) -> None:
        policy = self.policy
        pub = self.kv_events
        ssd: list[Any] = []
        ssd_dropped = 0
        # the SSD tier's events are drained before the store's and published after them: a move's DRAM
        # removal (recorded when evicted) then comes before its SSD store (recorded when the write landed)
        while pub is not None:
            got, ssd_dropped = self._srv.tier_events(_DRAIN_BATCH)
            ssd.extend(got)   # at most the ring (--kv-events-ring) and what came meanwhile
            if len(got) < _DRAIN_BATCH:
                break
        drained: list[Any] = []
        while True:
            events = self._srv.drain(_DRAIN_BATCH)
            if pub is not None:
                drained.extend(e for e in events if e[0] != EV_ACCESS)   # the store's ring, and what came meanwhile
            # a group's events name it by its representative key (its first part stored) with the group's
            # bytes: the policy sees one entry per group, and evicting that key evicts the whole group
            for kind, key, size, parent, _group in events:
                if kind == EV_INSERT:
                    self._sizes[key] = size
                    policy.on_insert(key, size, parent)
                elif kind == EV_ACCESS:
                    policy.on_access(key)
                elif self._sizes.pop(key, None) is not None:
                    policy.on_remove(key)
            if len(events) < _DRAIN_BATCH:
                if pub is not None:
                    pub.round(drained, dropped, ssd, ssd_dropped)
                return

    def _resync(self) -> None:
        """Events were dropped (ring full): make the policy track exactly the indexed keys."""
        held = dict(self._srv.keys())
        for key in list(self._sizes):
            if key not in held:
                del self._sizes[key]
                self.policy.on_remove(key)
        for key, size in held.items():
            if key not in self._sizes:
                self._sizes[key] = size
                self.policy.on_insert(key, size, None)
        log.warning("eviction events were dropped; policy resynchronised with %d keys", len(held))

    def _evict(self, free: int, target_free: int, want: int = 0) -> bool:
        """Evict the policy's victims until ``target_free`` bytes are free; True if it ran out.

        A request parked for space (``want``: the bytes it asked for, at the start or asked while
        the round runs) is let go as soon as that much is free (``space_done``: the data plane
        retries it at once), and the rest of the target is evicted while it goes on: with a tier
        below, each eviction first copies the object out for the write-behind, and a PUT that
        waited for the whole round waited for every victim's copy (`kvfabric bench tier --parts
        put`: the tiered server's own PUT p99 was 2-4x the untiered one's)."""
        srv = self._srv
        is_pinned = srv.is_pinned
        kept: list[bytes] = []
        exhausted = False
        while free < target_free:
            victim = self.policy.evict(is_pinned)
            if victim is None:
                exhausted = True
                break
            size = self._sizes.pop(victim, 0)
            freed = srv.evict(victim)
            free += freed
            if want and free >= want:
                srv.space_done(False)
                want = 0
            if not want:  # a PUT that parked meanwhile: its space may be here already
                want, now_free, _ = srv.wait(0)
                if want and now_free >= want:
                    srv.space_done(False)
                    want = 0
            if not freed and srv.is_pinned(victim):
                kept.append(victim)  # pinned since the policy looked: keep tracking it
                self._sizes[victim] = size
        for key in kept:
            self.policy.on_insert(key, self._sizes[key], None)
        return exhausted
