"""The ``shm`` transport: same-host clients read and write the server's arena directly.

How it works
------------
The native server (:mod:`kvfabric.server.native`) keeps its arena in a
``memfd`` (sealed: it cannot be shrunk or grown). A same-host client connects
to the server's TCP address, learns from the HELLO reply that it offers
``shm`` and the path of its unix socket (``HelloReply.shm_socket``, a
filesystem socket, 0600 by default), connects there (the server checks the
peer's uid with SO_PEERCRED), says HELLO again (both HELLOs prove, with the
token when there is one, that each side holds it, then AUTH: protocol 3,
:func:`.base.hello`), and asks for the arena (``SHM_ATTACH``): the reply carries
the memfd (``SCM_RIGHTS``), which the client maps shared. Every frame is a
typed message of :mod:`kvfabric.protocol` (``Shm*Request`` / ``Shm*Reply``).

* GET = ``SHM_LEASE`` (the server pins the found objects and answers their
  offsets, sizes and checksums), one ``memcpy`` per object from the arena
  into the caller's buffer with the GIL released (``_native.shm_get``), then
  ``SHM_RELEASE`` (no reply awaited). One round trip plus one copy. Asked for
  checksums (``request(..., checksums=True)``, what a verifying Client does),
  the copy runs slice by slice and each slice is hashed right after it is
  copied, while it is still in cache: one pass over the bytes, not a copy
  and then a second pass over the buffer.
* PUT = ``SHM_RESERVE`` (slots reserved for the objects that are not held
  yet; a reserved slot is in no index, so nobody can read it; ``parents``
  ride along for the eviction policy), one copy per object into its slot
  (``_native.copy_in``), then ``SHM_COMMIT`` with the checksums: the server
  verifies each slot against its checksum before it indexes it. Two round
  trips plus one copy.
* Everything else (EXISTS, LOOKUP, DELETE, STATS, PING) is the ordinary
  frame on the unix socket.

Leases and reservations belong to the unix connection: when a client dies
(or closes without releasing) the server releases its leases and frees its
reserved slots as the connection closes. They are bounded in time as well:
a lease lasts at most the server's ``--max-lease-ms``, an uncommitted
reservation at most its stall timeout (COMMIT then answers "reservation
expired").

Trust: a process that maps the arena can read and write any byte of it.
shm is for clients on the same host that the operator trusts as much as the
server (the engine processes of one deployment); checksums still catch torn
or corrupted objects (the client verifies every GET), but not a malicious
writer that also forges checksums. Use ``tcp``/``native`` across trust
boundaries (docs/notes/security.md).

``connect`` raises :class:`~kvfabric.errors.TransportUnavailable` when the
server is not on this host, does not offer ``shm``, or the extension is
missing, so ``auto`` moves on to the next transport.
"""

from __future__ import annotations

import ipaddress
from itertools import repeat
import mmap
from array import array
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import protocol
from ..errors import (
    FATAL_CODES,
    AuthError,
    ConfigError,
    DeadlineExceeded,
    RemoteError,
    NativeError,
    ProtocolError,
    TransportError,
    TransportUnavailable,
)
from ..protocol import (
    GetReply,
    GetRequest,
    Header,
    HelloReply,
    Message,
    PutReply,
    PutRequest,
    ShmAttachReply,
    ShmAttachRequest,
    ShmLeaseReply,
    ShmLeaseRequest,
    ShmOp,
    ShmReleaseRequest,
    ShmReserveRequest,
)
from .base import Reply, dial, get_sinks, hello, parse_address
from .native import NativeConnection
from .native import probe as _native_probe

try:
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["ShmConnection", "connect", "probe", "OP_SHM_ATTACH", "OP_SHM_LEASE", "OP_SHM_RELEASE",
           "OP_SHM_RESERVE", "OP_SHM_COMMIT"]

# GET into caller buffers and PUT run as one call into C each (_native.shm_get /
# shm_put); the step-by-step path (_control, copy_out) serves GET without buffers.

# Same-host control opcodes (kvfabric.protocol.ShmOp, mirrored in csrc/kvf_protocol.h);
# valid only on the unix socket.
OP_SHM_ATTACH = int(ShmOp.ATTACH)
OP_SHM_LEASE = int(ShmOp.LEASE)
OP_SHM_RELEASE = int(ShmOp.RELEASE)
OP_SHM_RESERVE = int(ShmOp.RESERVE)
OP_SHM_COMMIT = int(ShmOp.COMMIT)


def probe() -> str | None:
    """``None`` when shm can be used from this process (the C extension is built)."""
    return _native_probe()


def _is_local(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def on_this_host(address: str) -> bool:
    """True when ``address`` ("host:port") names this host the way :func:`connect` requires
    (every address it resolves to is loopback); False for anything else, malformed included."""
    try:
        host, _ = parse_address(address)
    except ConfigError:
        return False
    return _is_local(host)


def connect(
    address: str,
    *,
    timeout_s: float,
    auth_token: str | None = None,
    client_name: str = "kvfabric",
    hello_timeout_s: float | None = None,
) -> ShmConnection:
    """Attach to the arena of the native server at ``address`` ("host:port", same host).

    Raises ``TransportUnavailable`` (not on this host, no ``shm`` offered,
    extension missing), ``TransportError``/``DeadlineExceeded`` when the server
    cannot be reached in time, ``RemoteError`` when it refuses the HELLO.
    """
    reason = probe()
    if reason is not None:
        raise TransportUnavailable(reason)
    host, _ = parse_address(address)
    if not _is_local(host):
        raise TransportUnavailable(f"shm needs a server on this host; {address} is not a loopback address")
    # same host: nothing to blackhole the handshake, so one deadline covers reaching it and its HELLOs
    deadline = time.monotonic() + max(timeout_s, hello_timeout_s or 0.0)
    hello = _tcp_hello(address, client_name, auth_token, deadline)
    path = hello.shm_socket
    if "shm" not in hello.transports or path is None:
        raise TransportUnavailable(f"server {address} does not offer shm")
    usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    usock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        usock.connect(path)
    except OSError as e:
        usock.close()
        raise TransportUnavailable(f"cannot reach the shm socket {path} of {address} (permissions, another host "
                                   f"or namespace?): {e}") from e
    conn = ShmConnection(usock, address)
    conn._shm_socket = path
    try:
        try:
            conn.hello = conn._hello(client_name, auth_token, deadline)
        except RemoteError as e:
            # The TCP HELLO proved both sides hold the token, so AUTH_FAILED from the server here is
            # its peer check (SO_PEERCRED: another uid): shm is not for this process, another
            # transport may be. Our own refusal of the unix socket's server (AuthError) stands.
            if e.code != protocol.ErrorCode.AUTH_FAILED or isinstance(e, AuthError):
                raise
            raise TransportUnavailable(f"the shm socket of {address} refused this process: {e}") from e
        except DeadlineExceeded:
            raise
        except TransportError as e:  # refused and closed before our HELLO went out
            raise TransportUnavailable(f"the shm socket of {address} closed on this process: {e}") from e
        conn._attach(deadline)
    except BaseException:
        conn.close()
        raise
    return conn


def _tcp_hello(address: str, client_name: str, auth_token: str | None, deadline: float) -> HelloReply:
    """HELLO over TCP, with the token's proofs and AUTH (:func:`.base.hello`); the reply names the shm socket."""
    sock = dial(address, deadline)
    lim = protocol.DEFAULT_LIMITS
    rid = 0

    def request(msg: Message) -> Message:
        nonlocal rid
        rid += 1
        try:
            opcode, flags, got, meta, plen, _ = _native.request(
                sock.fileno(), int(msg.op), rid, protocol.encode_meta(msg.to_meta()), [], None,
                lim.max_meta_bytes, lim.max_payload_bytes, deadline=deadline)
        except NativeError as e:
            raise TransportError(f"{msg.op.name} to {address} failed: {e}") from e
        if got != rid:
            raise ProtocolError(protocol.ErrorCode.MALFORMED, f"reply for request {got}, expected {rid}")
        return protocol.decode_reply(Header(opcode, flags, got, len(meta), plen), meta, msg.op, lim)

    try:
        sock.settimeout(None)
        return hello(request, address, client_name, ("shm",), auth_token)
    finally:
        sock.close()


# One mapping per server per process, shared by its pooled connections:
# mapping (and pre-faulting) a large arena is done once, not per connection.
_arenas: dict[str, list] = {}  # shm socket name -> [mmap, users]
_arenas_lock = threading.Lock()


def _map_arena(name: str, fd: int, capacity: int) -> mmap.mmap:
    """The shared mapping of the arena behind ``name`` (mapped from ``fd`` on first use).

    MAP_POPULATE fills the page tables up front, so copies never stop on
    first-touch page faults (they cost more than the copy itself).
    """
    with _arenas_lock:
        got = _arenas.get(name)
        if got is not None:
            if len(got[0]) != capacity:
                raise ProtocolError(protocol.ErrorCode.MALFORMED, f"arena of {name!r} changed size")
            got[1] += 1
            return got[0]
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(fd, capacity, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        _arenas[name] = [m, 1]
        return m


def _unmap_arena(name: str) -> None:
    with _arenas_lock:
        got = _arenas.get(name)
        if got is None:
            return
        got[1] -= 1
        if got[1] == 0:
            del _arenas[name]
            try:
                got[0].close()
            except BufferError:  # a caller still holds a view: the mapping goes with the object
                pass


class ShmConnection(NativeConnection):
    """A unix-socket connection plus the mapped arena. Not thread-safe."""

    name = "shm"

    def __init__(self, sock: socket.socket, address: str) -> None:
        super().__init__(sock, address)
        self._arena: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._shm_socket = ""

    def close(self) -> None:
        view, self._view = self._view, None
        arena, self._arena = self._arena, None
        if view is not None:
            view.release()
        if arena is not None:
            _unmap_arena(self._shm_socket)
        super().close()

    def request(
        self,
        msg: Message,
        payload_parts: Sequence[Any] = (),
        recv_buffers: Sequence[Any] | None = None,
        *,
        deadline: float | None = None,
        checksums: bool = False,
    ) -> Reply:
        """``checksums``: a GET into plain buffers (no scatter entries) has its objects hashed in C
        slice by slice as they are copied out of the arena (``Reply.checksums``), not in a second
        pass over the buffers; other calls leave ``Reply.checksums`` None."""
        if isinstance(msg, GetRequest):
            return self._get(msg, recv_buffers, deadline, checksums)
        if isinstance(msg, PutRequest) and msg.ns is None:  # a tagged PUT goes as a frame: RESERVE has no ns
            return self._put(msg, payload_parts, deadline)
        return super().request(msg, payload_parts, recv_buffers, deadline=deadline)

    # ------------------------------------------------------------------ shm ops

    def _attached(self) -> bool:
        """True once ATTACH succeeded: the arena ops may be sent (the nixl transport attaches its own way)."""
        return self._view is not None

    def _control(self, msg: Message, deadline: float | None) -> Message | None:
        """One shm control frame and its typed reply (None for RELEASE, which has none).
        Failures close the connection; an error reply raises RemoteError."""
        if self._sock is None or not self._attached() and msg.op != ShmOp.ATTACH:
            from ..errors import ConnectionClosed

            raise ConnectionClosed(f"connection to {self.address} is closed")
        rid = self._next_id
        self._next_id += 1
        dl = 0.0 if deadline is None else deadline
        lim = self._limits
        meta = protocol.encode_meta(msg.to_meta())
        try:
            if msg.op == ShmOp.RELEASE:
                _native.send_frame(self._fd, int(msg.op), 0, rid, meta, [], dl)
                return None
            opc, flags, got, mbytes, plen, _ = _native.request(
                self._fd, int(msg.op), rid, meta, [], None, lim.max_meta_bytes, 0, deadline=dl)
            if got != rid or plen:
                raise ProtocolError(protocol.ErrorCode.MALFORMED, f"unexpected reply to shm op {int(msg.op)}")
            return protocol.decode_reply(Header(opc, flags, got, len(mbytes), plen), mbytes, msg.op, lim)
        except NativeError as e:
            self.close()
            raise TransportError(f"shm op to {self.address} failed: {e}") from e
        except RemoteError as e:
            if e.code in FATAL_CODES:
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _attach(self, deadline: float) -> None:
        sock = self._sock
        assert sock is not None
        rid = self._next_id
        self._next_id += 1
        msg = ShmAttachRequest()
        _native.send_frame(self._fd, int(msg.op), 0, rid, protocol.encode_meta(msg.to_meta()), [], deadline)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            head, fds, _flags, _addr = socket.recv_fds(sock, protocol.HEADER_SIZE, 1)
            try:
                while len(head) < protocol.HEADER_SIZE:
                    more = sock.recv(protocol.HEADER_SIZE - len(head))
                    if not more:
                        raise TransportError(f"{self.address} closed the shm socket during attach")
                    head += more
                header = protocol.unpack_header(head)
                mbytes = b""
                while len(mbytes) < header.meta_len:
                    more = sock.recv(header.meta_len - len(mbytes))
                    if not more:
                        raise TransportError(f"{self.address} closed the shm socket during attach")
                    mbytes += more
                reply = protocol.decode_reply(header, mbytes, msg.op)  # raises RemoteError for an error reply
                assert isinstance(reply, ShmAttachReply)
                if len(fds) != 1 or header.request_id != rid:
                    raise ProtocolError(protocol.ErrorCode.MALFORMED, "shm attach reply without the arena")
                self._arena = _map_arena(self._shm_socket, fds[0], reply.capacity)
            finally:
                for fd in fds:
                    import os

                    os.close(fd)
        except TimeoutError as e:
            raise DeadlineExceeded(f"shm attach to {self.address} timed out") from e
        except OSError as e:
            raise TransportError(f"shm attach to {self.address} failed: {e}") from e
        finally:
            sock.settimeout(None)
        self._view = memoryview(self._arena)

    def _fused(self, fn, *args: Any, deadline: float | None, tail: tuple = ()) -> tuple:
        """Run a one-call shm operation in C (two frames: request ids rid and rid + 1): ``fn(fd, arena, rid,
        *args, deadline, *tail)``; returns what it returns, ``(opcode, flags, rid, meta, ...)``."""
        if self._sock is None or self._view is None:
            from ..errors import ConnectionClosed

            raise ConnectionClosed(f"connection to {self.address} is closed")
        rid = self._next_id
        self._next_id += 2
        try:
            return fn(self._fd, self._view, rid, *args, 0.0 if deadline is None else deadline, *tail)
        except ValueError:
            raise  # a buffer too small: nothing copied, lease released, stream in step
        except NativeError as e:
            self.close()
            raise TransportError(f"shm op to {self.address} failed: {e}") from e
        except BaseException:
            self.close()
            raise

    def _decoded(self, got: tuple, op: ShmOp) -> Message:
        """The typed reply of a :meth:`_fused` call's ``(opcode, flags, rid, meta, ...)``; an error reply
        raises RemoteError (closing the connection for a fatal code)."""
        opcode, flags, rid, mbytes = got[:4]
        try:
            return protocol.decode_reply(Header(opcode, flags, rid, len(mbytes), 0), mbytes, op, self._limits)
        except RemoteError as e:
            if e.code in FATAL_CODES:
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _get(self, msg: GetRequest, recv_buffers: Sequence[Any] | None, deadline: float | None,
             checksums: bool = False) -> Reply:
        n = len(msg.keys)
        if recv_buffers is not None and len(recv_buffers) != n:
            raise ValueError(f"{len(recv_buffers)} recv buffers for {n} keys")
        if recv_buffers is not None and any(map(isinstance, recv_buffers, repeat(tuple))):  # scatter entries
            return self._get_scatter(msg, recv_buffers, deadline)
        if recv_buffers is not None:
            # the common case: one call into C, GIL released throughout; C writes the LEASE, checks and
            # parses its reply (ShmLeaseReply's checks) and hashes what it copies when asked
            lim = self._limits
            digests = array("Q", bytes(8 * n)) if checksums else None
            got = self._fused(_native.shm_get, list(msg.keys), list(recv_buffers), lim.max_meta_bytes,
                              lim.max_object_bytes, deadline=deadline, tail=(digests,))
            if got[4] is None:  # an error reply: raises
                self._decoded(got, ShmOp.LEASE)
                raise ProtocolError(protocol.ErrorCode.MALFORMED, "a LEASE error reply that decodes as none")
            return Reply(GetReply(sizes=got[4], checksums=got[5]), None, digests)
        lease_msg = ShmLeaseRequest(keys=msg.keys)
        lease = self._control(lease_msg, deadline)
        assert isinstance(lease, ShmLeaseReply)
        try:
            offsets, sizes, sums = lease.offsets, lease.sizes, lease.checksums
            if len(offsets) != n:
                self.close()
                raise ProtocolError(protocol.ErrorCode.MALFORMED, "lease reply does not match the keys")
            total = sum(s for s in sizes if s > 0)
            payload = bytearray(total)
            pv = memoryview(payload)
            bufs, pos = [], 0
            for s in sizes:
                bufs.append(pv[pos:pos + max(s, 0)])
                pos += max(s, 0)
            _native.copy_out(self._view, offsets, sizes, bufs, None)
        finally:
            if self._sock is not None:
                self._control(ShmReleaseRequest(lease=lease.lease), deadline)
        return Reply(GetReply(sizes=sizes, checksums=sums), payload)

    def _get_scatter(self, msg: GetRequest, recv_buffers: Sequence[Any], deadline: float | None) -> Reply:
        """GET with scatter entries (see ``transport.base``): lease, one ``copy_out`` of every piece
        (object ``i`` cut over its entry's buffers), release. Still one copy per byte."""
        n = len(msg.keys)
        lease = self._control(ShmLeaseRequest(keys=msg.keys), deadline)
        assert isinstance(lease, ShmLeaseReply)
        problem = None
        try:
            offsets, sizes, sums = lease.offsets, lease.sizes, lease.checksums
            if len(offsets) != n or len(sizes) != n:
                self.close()
                raise ProtocolError(protocol.ErrorCode.MALFORMED, "lease reply does not match the keys")
            sinks, problem = get_sinks(sizes, recv_buffers, sum(s for s in sizes if s > 0))
            p_off: list[int] = []
            p_len: list[int] = []
            p_buf: list[Any] = []
            found = (i for i, s in enumerate(sizes) if s >= 0)
            for (nbytes, view), i in zip(sinks, found):
                if view is None:
                    continue
                off = offsets[i]
                for part in view if isinstance(view, tuple) else (view,):
                    p_off.append(off)
                    p_len.append(part.nbytes)
                    p_buf.append(part)
                    off += part.nbytes
            if problem is None and p_buf:
                _native.copy_out(self._view, p_off, p_len, p_buf, None)
        finally:
            if self._sock is not None:
                self._control(ShmReleaseRequest(lease=lease.lease), deadline)
        if problem is not None:
            raise ValueError(problem)
        return Reply(GetReply(sizes=sizes, checksums=sums))

    def _put(self, msg: PutRequest, payload_parts: Sequence[Any], deadline: float | None) -> Reply:
        parts = [memoryview(p).cast("B") for p in payload_parts]
        if sum(p.nbytes for p in parts) != msg.payload_len():
            raise ValueError(f"payload parts hold {sum(p.nbytes for p in parts)} bytes, the message announces "
                             f"{msg.payload_len()}")
        # reserve, copy, commit: one call into C, GIL released throughout (C builds the COMMIT frame,
        # the bytes of ShmCommitRequest: tests/native/test_golden.py pins both)
        reserve = ShmReserveRequest(keys=msg.keys, sizes=msg.sizes, parents=msg.parents, groups=msg.groups,
                                    group_parts=msg.group_parts)
        rep = self._decoded(self._fused(_native.shm_put, protocol.encode_meta(reserve.to_meta()), list(msg.sizes),
                                        list(msg.checksums), parts, self._limits.max_meta_bytes, deadline=deadline),
                            ShmOp.COMMIT)
        assert isinstance(rep, PutReply)
        if len(rep.status) != len(msg.keys):
            self.close()
            raise ProtocolError(protocol.ErrorCode.MALFORMED, "commit reply does not match the keys")
        return Reply(PutReply(status=rep.status))
