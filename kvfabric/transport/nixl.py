"""The ``nixl`` transport: one-sided READs and WRITEs into the server's arena through NIXL (UCX).

How it works
------------
The same protocol as :mod:`.shm` ("the client accesses the arena directly"):
shm maps the arena, nixl reads and writes it remotely; there is no second set
of opcodes. The native server, started with ``nixl`` in its transports
(``kvfabric serve --transports tcp,native,nixl``), maps its arena's memfd in
the hosting Python process, registers that mapping with a NIXL agent
(:class:`ArenaExport`, UCX backend) and hands C the agent's metadata and the
mapping's address (``_native.Server.set_remote_arena``). A client:

* connects over TCP and says HELLO listing ``nixl`` (with the token's proofs
  and AUTH when the server has one: nothing else is served before that);
* asks ``SHM_ATTACH``: on such a connection the reply carries, instead of the
  memfd, ``nixl_agent`` (the server agent's metadata) and ``arena_base``
  (:class:`~kvfabric.protocol.ShmAttachReply`); the client adds that agent to
  its own (one per process);
* GET = ``SHM_LEASE`` (the found objects pinned: offsets, sizes, checksums),
  one NIXL ``READ`` of the whole block list from the arena straight into the
  caller's buffers, then ``SHM_RELEASE``. The caller's buffers are registered
  with the client's agent for the call (shared with concurrent calls over the
  same memory: :class:`_LocalMemory`), unless they lie inside buffers given to
  ``Client.register_buffers`` (:meth:`NixlConnection.register_buffers`: registered once
  and kept; the vLLM connector registers its KV tensors so), then the call registers
  nothing. The :class:`~kvfabric.client.Client` verifies every object
  against the lease's checksum, so a slot reused under an expired lease reads
  as a miss;
* PUT = ``SHM_RESERVE`` (slots in no index), one NIXL ``WRITE`` of the
  reserved objects from the caller's buffers into their slots, then
  ``SHM_COMMIT`` with the checksums: the server verifies each slot before it
  indexes it. The COMMIT frame is the completion signal (no NIXL notification:
  nothing on the server would consume it).

Leases and reservations are the shm ones: bounded by ``--max-lease-ms`` and
the stall timeout, released when the connection closes. A transfer is polled
until the call's deadline; past it the transfer is released, the connection
closed (the server then drops the lease or frees the reservation) and
``DeadlineExceeded`` raised. A failed transfer (the server died) closes the
connection and raises ``TransportError``.

UCX picks its transports from the environment (``UCX_TLS``): ``tcp``, shared
memory (``sm,self``), or RC/DC verbs on a host with an RDMA device. The UCX
backend is created in UCX's ``peer`` error-handling mode where UCX has tcp or
RDMA, ``none`` over shared memory alone, which refuses ``peer`` (:func:`error_mode`). Verified here: UCX tcp and
shared memory on loopback. Not verified: RC verbs, GPUDirect (``VRAM_SEG``):
no RDMA device on the machines this was built on (docs/notes/nixl.md).

Trust: as for shm, a client that attached can read and write any byte of the
arena; checksums catch torn or stale objects, not a writer that forges them.
Offer ``nixl`` only to engines the operator trusts as much as the server, and
set a token: without one, anyone who reaches the TCP port can attach.

Negotiation: ``transport: auto`` picks nixl (after shm, before native) only when the server offers it
and UCX, asked in this process (:mod:`.ucx_info`: the library nixl bundles, this environment), offers an
RDMA transport (:func:`auto_reason`); otherwise it says why in the one line it logs for the server and
goes on to native. Asked for by name it is nixl or :class:`~kvfabric.errors.TransportUnavailable`,
never a silent fallback. The UCX resources each side may use (``tcp/lo``, ``posix/memory``,
``rc_mlx5/mlx5_0:1``, ...) are logged with the first connection to a server and with the server's
export, and exported: the server's on its ``--metrics-port`` (``kvfabric_server_info{ucx_transports}``,
from ``NativeServer.stats``; the wire STATS reply, built in C, does not carry it), the client's in
``Client.stats()["client"]["ucx_transports"]``. Which of them a
connection's lanes take is UCX's choice per peer (``UCX_PROTO_INFO=y`` prints it).
"""

from __future__ import annotations

import bisect
import importlib
import importlib.util
import logging
import mmap
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import protocol
from ..errors import DeadlineExceeded, ProtocolError, TransportError, TransportUnavailable
from ..protocol import (
    GetReply,
    GetRequest,
    HelloReply,
    Message,
    PutReply,
    PutRequest,
    PutStatus,
    ShmAttachReply,
    ShmAttachRequest,
    ShmCommitRequest,
    ShmLeaseReply,
    ShmLeaseRequest,
    ShmReleaseRequest,
    ShmReserveReply,
    ShmReserveRequest,
)
from . import ucx_info
from .base import Reply, get_sinks, hello
from .native import MAX_REGISTERED_BUFFERS, MAX_REGISTERED_BYTES, check_registration
from .native import connect as _native_connect
from .native import probe as _native_probe
from .shm import ShmConnection

__all__ = ["NixlConnection", "ArenaExport", "connect", "probe"]

log = logging.getLogger("kvfabric.transport.nixl")


def error_mode() -> str:
    """The UCX backend's ``ucx_error_handling_mode`` for this process's UCX environment: ``peer`` when UCX has a
    transport that reports a dead peer (tcp, RDMA: :func:`.ucx_info.peer_failure`), else ``none`` (shared memory
    alone: UCX refuses ``peer`` there, NIXL_ERR_BACKEND; also when UCX cannot be asked).

    ``none`` over tcp was measured to leak: when a server was killed under a READ, the transfer failed
    (NIXL_ERR_REMOTE_DISCONNECT) but the rest of its UCX requests were never completed ("was not returned to
    mpool" at exit, 22 of them over 12 kills; with ``peer``, 0). (A segfault once blamed on those pending requests
    was two transfers sharing one registration: :class:`_LocalMemory`.) Over shared memory alone a dead server is
    seen by the control connection and the checksum."""
    try:
        names = ucx_info.resources()
    except ucx_info.UcxUnavailable:
        return "none"
    return "peer" if ucx_info.peer_failure(names) else "none"


#: how long the server's NIXL progress thread sleeps in poll() waiting for UCX events, in microseconds
#: (NIXL's ``pthrDelay``; NIXL rounds it up to whole milliseconds). UCX wakes the thread through its worker's
#: event fd when there is work, so this is only the bound on a wake-up UCX does not signal. nixl's Python
#: wrapper sets 0, and poll() with a timeout of 0 never sleeps: its thread then spun, a whole core of an
#: idle server here (~40% under load), taken from the data plane on a small host (docs/notes/nixl.md).
PROGRESS_WAIT_US = 10_000

_api: Any = None  # nixl._api, imported on first use
_IMPORT_ERROR: str | None = None


def _torch_without_cuda() -> bool:
    """True when no torch is installed, or the installed one says it has no CUDA (its ``version.py``, read without
    importing torch); False when it has CUDA or that cannot be read."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None:
        return True
    if not spec.origin:
        return False
    try:
        version_spec = importlib.util.spec_from_file_location("_kvfabric_torch_version",
                                                              os.path.join(os.path.dirname(spec.origin), "version.py"))
        assert version_spec is not None and version_spec.loader is not None
        module = importlib.util.module_from_spec(version_spec)
        version_spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - unreadable: let nixl decide
        return False
    return getattr(module, "cuda", "unknown") is None


def _import_api() -> Any:
    """nixl's ``_api`` module. nixl's package chooses its backend wheel (nixl_cu13, nixl_cu12, nixl_rocm) by the
    CUDA version of the torch installed; with a CPU torch not yet imported it reads torch's version.py (no CUDA),
    takes that for "unknown" and imports torch to ask again: 1.1 s and ~180 MiB in every process, a pool server
    included, only to learn there is no CUDA (measured here, nixl 1.5.1). Where nothing CUDA is imported and
    torch says it has no CUDA, nixl then loads the first installed backend of :data:`.ucx_info.NIXL_BACKENDS`
    (its order); this loads that one directly (a pool server offering nixl: ready in 0.8 s instead of 2.0-2.3,
    63 MB resident instead of 250). Otherwise (a CUDA torch, or a CUDA stack imported) nixl's own choice."""
    if not any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy")) and _torch_without_cuda():
        for name in ucx_info.NIXL_BACKENDS:
            try:
                return importlib.import_module(f"{name}._api")
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise
    from nixl import _api as api  # noqa: PLC0415 - optional dependency (kvfabric[nixl])
    return api


def _nixl() -> Any:
    global _api, _IMPORT_ERROR
    if _api is None and _IMPORT_ERROR is None:
        try:
            api = _import_api()
        except ImportError as e:
            _IMPORT_ERROR = f"nixl is not installed (pip install 'kvfabric[nixl]'): {e}"
        else:
            _api = api
            # nixl logs INFO to stdout; a server's stdout carries its LISTENING line: move them to stderr
            for h in logging.getLogger("nixl").handlers:
                if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
                    h.setStream(sys.stderr)
    return _api


def probe() -> str | None:
    """``None`` when nixl can be used from this process (the C extension is built, nixl imports)."""
    reason = _native_probe()
    if reason is not None:
        return reason
    return _IMPORT_ERROR if _nixl() is None else None


def ucx_summary() -> str:
    """One line for logs and errors: ``UCX_TLS`` and the UCX resources this process has (:mod:`.ucx_info`)."""
    got = ucx_info.describe()
    tls = os.environ.get("UCX_TLS", "<unset>")
    if "error" in got:
        return f"UCX_TLS={tls}; UCX resources unknown: {got['error']}"
    return f"UCX_TLS={tls}; UCX resources {', '.join(got['resources']) or 'none'}"


def auto_reason() -> str | None:
    """Why ``transport: auto`` should not pick nixl here (None: it may). It may only when UCX itself, in this
    process's environment, offers an RDMA transport (:func:`.ucx_info.rdma`: RC, DC or UD verbs, EFA's SRD):
    otherwise UCX would carry nixl over tcp, slower than ``native`` (docs/notes/nixl.md). Asking UCX, not
    sysfs, also covers an RDMA port with a UCX built without verbs, or a ``UCX_TLS`` that leaves them out."""
    if ucx_info.describe().get("rdma"):
        return None
    return f"UCX offers no RDMA transport here ({ucx_summary()}): it would run over tcp, slower than native"


_config_lock = threading.Lock()  # the swap of nixl's config class in _new_agent


def _new_agent(role: str, progress_thread: bool) -> Any:
    """A NIXL agent with one UCX backend (no listener thread, no port opened). ``progress_thread``: the
    server's, which UCX's tcp transport needs on the target to serve READs and WRITEs (it emulates them with
    active messages); a client progresses its own transfers while it polls them."""
    api = _nixl()
    if api is None:
        raise TransportUnavailable(_IMPORT_ERROR or "nixl is not installed")
    conf = api.nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[],
                                 sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    name = f"kvfabric-{role}-{os.getpid()}-{secrets.token_hex(6)}"
    if not progress_thread:
        agent = api.nixl_agent(name, conf)
    else:
        # nixl_agent builds its C++ config itself and assigns pthrDelay = 0 (no argument reaches it): the
        # binding's class is swapped, for this one construction, for a subclass that keeps PROGRESS_WAIT_US.
        binding = api.nixlBind
        real = binding.nixlAgentConfig

        class _WaitingConfig(real):  # type: ignore[misc, valid-type]
            def __setattr__(self, attr: str, value: Any) -> None:
                super().__setattr__(attr, PROGRESS_WAIT_US if attr == "pthrDelay" else value)

        with _config_lock:
            binding.nixlAgentConfig = _WaitingConfig
            try:
                agent = api.nixl_agent(name, conf)
            finally:
                binding.nixlAgentConfig = real
    mode = error_mode()
    try:
        agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
    except Exception as e:  # nixl raises plain exceptions from its bindings
        raise TransportUnavailable(f"nixl: cannot create the UCX backend (UCX_TLS={os.environ.get('UCX_TLS')!r}, "
                                   f"error mode {mode!r}): {e}") from e
    log.info("nixl: %s agent %s, UCX error-handling mode %s", role, name, mode)
    return agent


def _addr(buf: Any) -> tuple[int, int]:
    """(address, length) of a contiguous buffer (read-only ones included)."""
    import numpy as np  # a dependency of nixl

    a = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return (a.ctypes.data if a.size else 0), a.size


def _merged(regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching (address, length) regions merged: what one call registers."""
    out: list[list[int]] = []
    for a, n in sorted(r for r in regions if r[1] > 0):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


# ---------------------------------------------------------------------------- server side


class ArenaExport:
    """The server's arena registered with a NIXL agent: ``metadata`` (the agent's, for clients) and ``base``
    (where the arena is mapped in this process: offset 0). :meth:`close` after the data plane stopped."""

    def __init__(self, memfd: int, capacity: int) -> None:
        self._map = mmap.mmap(memfd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self.base, _ = _addr(self._map)
            self._agent = _new_agent("server", progress_thread=True)
            self._reg = self._agent.register_memory([(self.base, capacity, 0, "")], "DRAM")
            self.metadata: bytes = self._agent.get_agent_metadata()
        except BaseException:
            self._map.close()
            raise
        got = ucx_info.describe()
        #: the UCX resources this server's agent may use, comma-separated ("unknown: why" if UCX cannot say)
        self.ucx_transports: str = ",".join(got["resources"]) if "resources" in got else f"unknown: {got['error']}"
        log.info("nixl: arena of %d bytes registered with agent %s (%s)", capacity, self._agent.name,
                 ucx_summary())

    def close(self) -> None:
        reg, self._reg = self._reg, None
        if reg is not None:
            self._agent.deregister_memory(reg)
            self._agent = None
            try:
                self._map.close()
            except BufferError:  # a numpy view still holds it: the mapping goes with the object
                pass


# ---------------------------------------------------------------------------- client side

_agent_lock = threading.Lock()
_agents: dict[tuple, _LocalMemory] = {}  # UCX environment at creation (ucx_info.ucx_env) -> this process's agent
_peers: dict[tuple[tuple, bytes], str] = {}  # (UCX environment, server agent metadata) -> its name in that agent
_peer_users: dict[tuple[tuple, bytes], int] = {}  # the same key -> attached connections using that name
_logged: set[str] = set()


class _Registration:
    """One ``register_memory`` call's ranges and how many holders keep them registered."""

    __slots__ = ("reg", "ranges", "holders")

    def __init__(self, reg: Any, ranges: list[tuple[int, int]]) -> None:
        self.reg, self.ranges, self.holders = reg, ranges, 0


class _LocalMemory:
    """A client agent and the local memory registered with it, shared by every connection and thread of the
    process that use the agent.

    NIXL trusts its caller not to register overlapping memory: when a transfer is prepared
    (``initialize_xfer``) each local descriptor is matched to the first registered range that covers it,
    whoever registered it, and deregistering a range frees the UCX memory handle a transfer in flight took from
    it. When each call registered its own buffers, two fan-out threads writing the same objects to their two
    replicas registered the same memory twice, and the first to finish deregistered the range the other's
    WRITE was using: a segfault in ``ucp_put_nbx`` (a Client putting 120 objects to 3 servers, replicas 2:
    6 of 8 processes over UCX shared memory, and once in CI over tcp; 0 of 8 with the transfers serialized,
    docs/notes/nixl.md). So here a range is registered once however many calls use it, and a transfer holds,
    from before it is prepared until it is released, every registered range that overlaps its own: whatever
    NIXL matches stays registered under it. Registering and preparing happen under one lock, so no range
    registered later can be matched without being held."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], _Registration] = {}  # every registered (address, length)

    def _register(self, ranges: Sequence[tuple[int, int]]) -> list[_Registration]:
        """The registrations holding each of ``ranges`` (registering those not registered yet, in one call);
        ``_lock`` held."""
        new = [r for r in ranges if r not in self._ranges]
        if new:
            got = _Registration(self.agent.register_memory([(a, n, 0, "") for a, n in new], "DRAM"), new)
            for r in new:
                self._ranges[r] = got
        return list({id(g): g for g in (self._ranges[r] for r in ranges)}.values())

    def _overlapping(self, regions: Sequence[tuple[int, int]]) -> list[_Registration]:
        """Every registration with a range overlapping one of ``regions`` (sorted, disjoint); ``_lock`` held."""
        starts = [a for a, _ in regions]
        ends = [a + n for a, n in regions]
        found: dict[int, _Registration] = {}
        for (a, n), g in self._ranges.items():
            i = bisect.bisect_left(starts, a + n) - 1  # the last region starting before this range ends
            if i >= 0 and ends[i] > a:
                found[id(g)] = g
        return list(found.values())

    @staticmethod
    def _hold(regs: Sequence[_Registration]) -> list[_Registration]:
        for g in regs:
            g.holders += 1
        return list(regs)

    def pin(self, regions: Sequence[tuple[int, int]]) -> list[_Registration]:
        """Register ``regions`` (merged) for later transfers; what :meth:`release` takes back."""
        with self._lock:
            return self._hold(self._register(regions))

    def prepare(self, op: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], peer: str,
                register: bool) -> tuple[Any, list[_Registration]]:
        """A prepared ``op`` transfer of ``local`` (address, length) pairs to ``remote`` ones on agent ``peer``, and
        the registrations it holds (:meth:`release` them after the transfer handle is released). ``register``:
        ``local`` does not lie inside ranges pinned by the caller, register it for this transfer."""
        agent = self.agent
        regions = _merged(local)
        with self._lock:
            if register:
                self._register(regions)
            held = self._hold(self._overlapping(regions))
            try:
                ldescs = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
                rdescs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
                return agent.initialize_xfer(op, ldescs, rdescs, peer), held
            except BaseException:
                self._release(held)
                raise

    def release(self, regs: Sequence[_Registration]) -> None:
        with self._lock:
            self._release(regs)

    def _release(self, regs: Sequence[_Registration]) -> None:
        for g in regs:
            g.holders -= 1
            if g.holders == 0:
                for r in g.ranges:
                    del self._ranges[r]
                try:
                    self.agent.deregister_memory(g.reg)
                except Exception as e:  # nixl's bindings raise plain exceptions; the rest still goes
                    log.warning("nixl: deregistering %d local ranges failed: %s", len(g.ranges), e)


def _transfer(agent: Any, handle: Any, deadline: float | None) -> str:
    """Post the prepared transfer ``handle`` and poll it until it leaves ``PROC`` or ``deadline`` passes
    (then ``PROC`` is returned: still in flight); its last state otherwise (``DONE``, ``ERR``...). Past a short
    spin it yields the CPU (the GIL too) between polls."""
    state = agent.transfer(handle)
    spins = 0
    while state == "PROC":
        if deadline is not None and time.monotonic() > deadline:
            return state
        spins += 1
        if spins > 256:
            time.sleep(0)
        state = agent.check_xfer_state(handle)
    return state


def _covered(local: Sequence[tuple[int, int]], regions: Sequence[tuple[int, int]]) -> bool:
    """Every (address, length) of ``local`` lies inside one of ``regions`` (merged, few)."""
    return all(any(r <= a and a + n <= r + rn for r, rn in regions) for a, n in local)


def _peer(md: bytes) -> tuple[_LocalMemory, str, tuple[tuple, bytes]]:
    """This process's agent (with its local memory), the name of the server agent ``md`` describes in it, and the
    key to give back to :func:`_unpeer` when the connection that asked is done with it.
    UCX reads its ``UCX_*`` environment once, when an agent's backend is created: one agent per environment
    seen at connect time (one in practice). ``TransportUnavailable`` when the agent cannot be loaded: UCX has no
    transport of this process that reaches the server's (the message lists both sides' hints), or the metadata
    is malformed.

    NIXL forgets a server's agent by itself when a transfer with it fails with NIXL_ERR_REMOTE_DISCONNECT (UCX
    declared the endpoint dead: the server died, or the network was cut long enough); every later transfer to
    that name fails with NIXL_ERR_NOT_FOUND. So a known name is checked first and the agent loaded again if
    NIXL dropped it (a server that is alive after all is reached again on the next connection); other dropped
    names go with their connections, which fail and close. A server agent no connection uses any more is
    removed from NIXL (:func:`_unpeer`): a dead server's agent and UCX endpoints do not stay for the life of
    the process."""
    env = ucx_info.ucx_env()
    with _agent_lock:
        mem = _agents.get(env)
        if mem is None:
            mem = _agents[env] = _LocalMemory(_new_agent("client", progress_thread=False))
        name = _peers.get((env, md))
        if name is None or not mem.agent.check_remote_metadata(name):
            try:
                name = mem.agent.add_remote_agent(md)
            except Exception as e:
                raise TransportUnavailable(
                    f"nixl: cannot load the server's agent ({e}): UCX has no transport from here that reaches it "
                    f"({ucx_summary()}{ucx_info.bridge_hint()}), or its metadata is malformed") from e
            name = name.decode() if isinstance(name, bytes) else name
            _peers[(env, md)] = name
        _peer_users[(env, md)] = _peer_users.get((env, md), 0) + 1
        return mem, name, (env, md)


def _unpeer(key: tuple[tuple, bytes]) -> None:
    """A connection is done with the server agent ``key`` names (no transfer of it in flight): the last one
    removes the agent from NIXL (its metadata and UCX endpoints); the next connection to that server loads it
    again."""
    with _agent_lock:
        users = _peer_users.get(key, 0) - 1
        if users > 0:
            _peer_users[key] = users
            return
        _peer_users.pop(key, None)
        name = _peers.pop(key, None)
        mem = _agents.get(key[0])
        if name is None or mem is None:
            return
        try:
            if mem.agent.check_remote_metadata(name):
                mem.agent.remove_remote_agent(name)
        except Exception as e:  # nixl's bindings raise plain exceptions: the agent stays loaded, nothing else
            log.warning("nixl: removing server agent %s failed: %s", name, e)


def connect(
    address: str,
    *,
    timeout_s: float,
    auth_token: str | None = None,
    client_name: str = "kvfabric",
    hello_timeout_s: float | None = None,
) -> NixlConnection:
    """Connect to the native server at ``address`` ("host:port"), HELLO listing ``nixl``, attach.

    Raises ``TransportUnavailable`` (nixl or the extension missing, the server does not offer ``nixl``),
    ``TransportError``/``DeadlineExceeded`` when it cannot be reached in time, ``RemoteError`` when it
    refuses the HELLO.
    """
    reason = probe()
    if reason is not None:
        raise TransportUnavailable(reason)
    conn = _native_connect(address, timeout_s=timeout_s, auth_token=auth_token, client_name=client_name,
                           hello_timeout_s=hello_timeout_s, conn_class=NixlConnection)
    assert isinstance(conn, NixlConnection)
    deadline = time.monotonic() + (timeout_s if hello_timeout_s is None else hello_timeout_s)
    try:
        if "nixl" not in conn.hello.transports:
            raise TransportUnavailable(f"server {address} does not offer nixl (it offers "
                                       f"{', '.join(conn.hello.transports)})")
        conn._attach(deadline)
    except BaseException:
        conn.close()
        raise
    if address not in _logged:
        _logged.add(address)
        log.info("kvfabric: transport nixl for %s (server agent %s; %s)", address, conn._peer_name, ucx_summary())
    return conn


class NixlConnection(ShmConnection):
    """A TCP connection carrying the shm control frames, plus NIXL transfers into the server's arena.
    Not thread-safe (the process's NIXL agent is shared, and is)."""

    name = "nixl"

    def __init__(self, sock: Any, address: str) -> None:
        super().__init__(sock, address)
        self._mem: _LocalMemory | None = None  # this process's agent, once attached
        self._peer_name = ""
        self._peer_key: tuple[tuple, bytes] | None = None  # given back to _unpeer once closed and idle
        self._state_lock = threading.Lock()
        self._in_xfer = False  # a transfer handle is live: close() leaves _unpeer to _xfer
        self._base = 0
        self._capacity = 0
        self._regions: tuple[tuple[int, int], ...] = ()   # registered once (register_buffers)
        self._held: list[Any] = []                          # their buffers, kept exported
        self._pins: list[_Registration] = []                # what keeps them registered
        self._reg_stats = {"xfers_registered": 0, "xfers_per_call": 0}

    def _hello(self, client_name: str, auth_token: str | None, deadline: float) -> HelloReply:
        return hello(lambda m: self.request(m, deadline=deadline).msg, self.address, client_name, ("nixl",),
                     auth_token)

    def _attached(self) -> bool:
        return self._mem is not None

    def close(self) -> None:
        self.unregister_buffers()
        self._mem = None
        with self._state_lock:
            key, self._peer_key = (None, self._peer_key) if self._in_xfer else (self._peer_key, None)
        if key is not None:
            _unpeer(key)
        super().close()

    def register_buffers(self, buffers: Sequence[Any], *, max_buffers: int = MAX_REGISTERED_BUFFERS,
                         max_bytes: int = MAX_REGISTERED_BYTES) -> None:
        """Register reused buffers with this process's NIXL agent once (shared with every connection that
        registers the same set): later transfers whose local ranges lie inside them register nothing.
        Replaces an earlier registration; the buffers stay exported until :meth:`unregister_buffers` or
        :meth:`close`. ValueError as :meth:`NativeConnection.register_buffers` (checked before anything
        is registered); TransportError when NIXL refuses the registration."""
        if self._mem is None:
            raise TransportError(f"nixl connection to {self.address} is not attached")
        bufs = check_registration(buffers, max_buffers=max_buffers, max_bytes=max_bytes)
        regions = tuple(_merged([_addr(b) for b in bufs]))
        self.unregister_buffers()
        try:
            pins = self._mem.pin(regions)
        except Exception as e:  # nixl's bindings raise plain exceptions
            raise TransportError(f"nixl: registering {len(regions)} buffer regions failed: {e}") from e
        self._regions, self._held, self._pins = regions, bufs, pins

    def unregister_buffers(self) -> None:
        if self._pins and self._mem is not None:
            self._mem.release(self._pins)
        self._regions, self._held, self._pins = (), [], []

    def registered_stats(self) -> dict[str, int] | None:
        """``{buffers, bytes, xfers_registered, xfers_per_call}``: transfers that used the registration and
        transfers that registered their own buffers, or None without a registration."""
        if not self._regions:
            return None
        return {"buffers": len(self._held), "bytes": sum(n for _, n in self._regions), **self._reg_stats}

    def _attach(self, deadline: float) -> None:
        rep = self._control(ShmAttachRequest(), deadline)
        assert isinstance(rep, ShmAttachReply)
        if rep.nixl_agent is None or rep.arena_base is None:
            raise ProtocolError(protocol.ErrorCode.MALFORMED, f"{self.address} answered ATTACH without its agent")
        self._mem, self._peer_name, self._peer_key = _peer(rep.nixl_agent)
        self._base, self._capacity = rep.arena_base, rep.capacity

    def request(
        self,
        msg: Message,
        payload_parts: Sequence[Any] = (),
        recv_buffers: Sequence[Any] | None = None,
        *,
        deadline: float | None = None,
        checksums: bool = False,
    ) -> Reply:
        """GET and PUT go through the arena (``checksums`` is ignored: the caller verifies what it read);
        everything else is the ordinary frame on the TCP connection."""
        if self._mem is not None and isinstance(msg, GetRequest):
            return self._get(msg, recv_buffers, deadline)
        # a tagged PUT (ns) goes as a frame: SHM_RESERVE carries no namespace tag
        if self._mem is not None and isinstance(msg, PutRequest) and msg.ns is None:
            return self._put(msg, payload_parts, deadline)
        return super(ShmConnection, self).request(msg, payload_parts, recv_buffers, deadline=deadline)

    # ------------------------------------------------------------------ transfers

    def _xfer(self, op: str, local: Sequence[tuple[int, int]], remote: Sequence[int], deadline: float | None) -> None:
        """One NIXL ``op`` ("READ"/"WRITE") of the block list: local[i] = (address, length) <-> arena offset
        remote[i]. Every arena range is checked against the capacity the server announced."""
        if not local:
            return
        for (_, n), off in zip(local, remote):
            if off < 0 or off + n > self._capacity:
                self.close()
                raise ProtocolError(protocol.ErrorCode.MALFORMED, f"arena range {off}+{n} outside the arena")
        mem = self._mem
        assert mem is not None
        registered = bool(self._regions) and _covered(local, self._regions)
        self._reg_stats["xfers_registered" if registered else "xfers_per_call"] += 1
        handle, held = None, []
        with self._state_lock:
            self._in_xfer = True
        try:
            handle, held = mem.prepare(op, local, [(self._base + off, n) for (_, n), off in zip(local, remote)],
                                       self._peer_name, register=not registered)
            state = _transfer(mem.agent, handle, deadline)
            if state == "PROC":
                self.close()
                raise DeadlineExceeded(f"nixl {op} from {self.address} did not complete by the deadline")
            if state != "DONE":
                self.close()
                raise TransportError(f"nixl {op} with {self.address} failed (state {state})")
        except (DeadlineExceeded, TransportError, ProtocolError):
            raise
        except Exception as e:  # nixl's bindings raise plain exceptions (NIXL_ERR_*)
            self.close()
            raise TransportError(f"nixl {op} with {self.address} failed: {e}") from e
        finally:
            if handle is not None:
                try:
                    mem.agent.release_xfer_handle(handle)
                except Exception as e:  # an in-flight transfer that cannot be cancelled: keep its memory
                    log.warning("nixl: releasing a %s transfer with %s failed: %s", op, self.address, e)
                    held = []
            mem.release(held)
            with self._state_lock:  # closed under the transfer: the server agent is given back now
                self._in_xfer = False
                key = self._peer_key if self._mem is None else None
                if key is not None:
                    self._peer_key = None
            if key is not None:
                _unpeer(key)

    def _get(self, msg: GetRequest, recv_buffers: Sequence[Any] | None, deadline: float | None) -> Reply:
        n = len(msg.keys)
        if recv_buffers is not None and len(recv_buffers) != n:
            raise ValueError(f"{len(recv_buffers)} recv buffers for {n} keys")
        lease = self._control(ShmLeaseRequest(keys=msg.keys), deadline)
        assert isinstance(lease, ShmLeaseReply)
        payload = None
        problem = None
        try:
            offsets, sizes = lease.offsets, lease.sizes
            if len(offsets) != n or len(sizes) != n:
                self.close()
                raise ProtocolError(protocol.ErrorCode.MALFORMED, "lease reply does not match the keys")
            total = sum(s for s in sizes if s > 0)
            if recv_buffers is None:  # one payload, objects concatenated in key order
                payload = bytearray(total)
                pv, pos, cut = memoryview(payload), 0, []
                for s in sizes:
                    cut.append(pv[pos:pos + max(s, 0)])
                    pos += max(s, 0)
                recv_buffers = cut
            sinks, problem = get_sinks(sizes, recv_buffers, total)
            local: list[tuple[int, int]] = []
            remote: list[int] = []
            found = (i for i, s in enumerate(sizes) if s >= 0)
            for (_nbytes, view), i in zip(sinks, found):
                if view is None:
                    continue
                off = offsets[i]
                for part in view if isinstance(view, tuple) else (view,):
                    a, ln = _addr(part)
                    if ln:
                        local.append((a, ln))
                        remote.append(off)
                    off += ln
            if problem is None:
                self._xfer("READ", local, remote, deadline)
        finally:
            if self._sock is not None:
                self._control(ShmReleaseRequest(lease=lease.lease), deadline)
        if problem is not None:
            raise ValueError(problem)
        return Reply(GetReply(sizes=lease.sizes, checksums=lease.checksums), payload)

    def _put(self, msg: PutRequest, payload_parts: Sequence[Any], deadline: float | None) -> Reply:
        parts = [memoryview(p).cast("B") for p in payload_parts]
        if sum(p.nbytes for p in parts) != msg.payload_len():
            raise ValueError(f"payload parts hold {sum(p.nbytes for p in parts)} bytes, the message announces "
                             f"{msg.payload_len()}")
        n = len(msg.keys)
        rep = self._control(ShmReserveRequest(keys=msg.keys, sizes=msg.sizes, parents=msg.parents,
                                              groups=msg.groups, group_parts=msg.group_parts), deadline)
        assert isinstance(rep, ShmReserveReply)
        if len(rep.offsets) != n:
            self.close()
            raise ProtocolError(protocol.ErrorCode.MALFORMED, "reserve reply does not match the keys")
        # object i is bytes [start_i, start_i + size_i) of the concatenated parts: cut it out of them
        local: list[tuple[int, int]] = []
        remote: list[int] = []
        pi, pos = 0, 0  # current part, offset in it
        for i, size in enumerate(msg.sizes):
            want, off = size, rep.offsets[i]
            take = rep.status[i] == PutStatus.STORED
            while want:
                while parts[pi].nbytes == pos:
                    pi, pos = pi + 1, 0
                k = min(want, parts[pi].nbytes - pos)
                if take:
                    a, _ = _addr(parts[pi][pos:pos + k])
                    local.append((a, k))
                    remote.append(off)
                    off += k
                pos += k
                want -= k
        self._xfer("WRITE", local, remote, deadline)
        done = self._control(ShmCommitRequest(res=rep.res, checksums=list(msg.checksums)), deadline)
        assert isinstance(done, PutReply)
        if len(done.status) != n:
            self.close()
            raise ProtocolError(protocol.ErrorCode.MALFORMED, "commit reply does not match the keys")
        return Reply(PutReply(status=done.status))
