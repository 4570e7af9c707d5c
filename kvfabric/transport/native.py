"""The ``native`` transport: the same wire as ``tcp``, with the byte moving done in C.

Each :meth:`NativeConnection.request` is one call into ``kvfabric._native``
(csrc/kvf_client.c) with the GIL released: the header, metadata and payload
parts go out in one gathered ``sendmsg`` (PUT objects are sent straight from
the caller's buffers), and a GET reply's objects are received with
``recvmsg`` straight into the caller's buffers, object ``i`` into
``recv_buffers[i]`` (or, for a scatter entry, a tuple of buffers, filled
in order). Python keeps the decisions: it encodes and decodes the
metadata with :mod:`kvfabric.protocol`, checks the reply, and maps failures.

Deadlines: the absolute ``time.monotonic()`` deadline goes to C, which arms
the socket timeout with the time left before every syscall and gives up once
it has passed (the connection is then closed and ``DeadlineExceeded`` raised).

Pipelining: :meth:`NativeConnection.pipeline` sends several requests before
reading their replies (one GIL release for the sends, then one per reply),
so a batch split over several frames costs one round trip, not one per frame.

Registered buffers (opt-in): :meth:`NativeConnection.register_buffers` registers
buffers the caller reuses (an engine's staging buffer) as io_uring fixed
buffers on a ring of this connection's own. A GET object whose ``recv_buffers``
entry lies inside one of them (the buffer itself or any slice of it) is then
received with ``IORING_OP_READ_FIXED`` on the socket (no per-call page
pinning); the other objects of the same reply keep the ``recvmsg`` path. Limits
(count, total bytes, 1 GiB per buffer) are checked here before registering;
an io_uring setup that fails at registration raises then, never later.
Without a registration nothing changes.

Failures follow ``transport.base``; an error frame with request id 0 (a
server refusing the connection, e.g. BUSY over its connection bound) closes
the connection and raises ``RemoteError``, as in ``tcp``. The native client
talks to any server that speaks protocol v1 (the Python ``tcp`` server or the
io_uring native server): the wire is identical.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from array import array
from collections.abc import Sequence
from typing import Any

from .. import protocol
from ..errors import (
    FATAL_CODES,
    ConnectionClosed,
    DeadlineExceeded,
    KVFabricError,
    NativeError,
    ProtocolError,
    RemoteError,
    TransportError,
)
from ..protocol import GetReply, GetRequest, HelloReply, Message, PutRequest
from .base import Reply, SocketConnection, dial, hello

try:  # the extension is optional: without it this transport is unavailable
    from .. import _native
except ImportError as _e:  # pragma: no cover - depends on the build
    _native = None
    _IMPORT_ERROR: str | None = str(_e)
else:
    _IMPORT_ERROR = None

__all__ = ["NativeConnection", "connect", "probe", "send_requests"]

#: Defaults of :meth:`NativeConnection.register_buffers`' limits.
MAX_REGISTERED_BUFFERS = 64
MAX_REGISTERED_BYTES = 4 << 30
#: The kernel's bound on one fixed buffer.
MAX_REGISTERED_BUFFER_BYTES = 1 << 30


def probe() -> str | None:
    """``None`` when the C extension is importable, else why not."""
    if _native is None:
        return f"the C extension kvfabric._native is not built ({_IMPORT_ERROR})"
    return None


def connect(
    address: str,
    *,
    timeout_s: float,
    auth_token: str | None = None,
    client_name: str = "kvfabric",
    hello_timeout_s: float | None = None,
    conn_class: type[NativeConnection] | None = None,
) -> NativeConnection:
    """Connect to ``address`` ("host:port") and run HELLO (``conn_class``: a subclass of
    :class:`NativeConnection` to make, whose ``_hello`` says what it offers; the nixl transport's).

    ``timeout_s`` bounds reaching the server (the TCP handshake, which the kernel answers even when
    the server is loaded); ``hello_timeout_s`` (default: ``timeout_s``) bounds its HELLO reply
    from then on: a server that accepted the connection is alive, and a slow reply means load.

    Raises ``TransportUnavailable`` (via :func:`probe`'s reason) when the
    extension is missing, ``ConfigError`` for a bad address, ``TransportError``
    when the server cannot be reached in time, ``RemoteError`` when it refuses
    the HELLO or the connection (``BUSY``: an error frame with request id 0,
    sent by a server over its connection bound), ``ProtocolError`` for a bad
    HELLO reply.
    """
    reason = probe()
    if reason is not None:
        from ..errors import TransportUnavailable

        raise TransportUnavailable(reason)
    deadline = time.monotonic() + timeout_s
    sock = dial(address, deadline)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = (conn_class or NativeConnection)(sock, address)
    if hello_timeout_s is not None:
        deadline = time.monotonic() + hello_timeout_s
    try:
        conn.hello = conn._hello(client_name, auth_token, deadline)
    except BaseException:
        conn.close()
        raise
    return conn


def send_requests(conns: Sequence[NativeConnection], msgs: Sequence[Message], *,
                  deadline: float | None = None) -> list[int | KVFabricError]:
    """:meth:`NativeConnection.send_request` of ``msgs[i]`` on ``conns[i]`` (each a different connection),
    all of them handed to the kernel in one io_uring submission (``_native.send_frames``, up to 64 per
    submission): every server is woken before this thread can be preempted by the first one it woke,
    so a loaded machine does not run each server in between the sends and make this thread wait its
    turn again after every one (what sending them one by one costs a fan-out's tail).

    Returns, per request, its request id, or the ``KVFabricError`` its connection failed with (that
    connection is then closed; the others are sent). Programming errors (a GET/PUT, which carry a
    payload) raise before anything is sent.
    """
    out: list[int | KVFabricError] = []
    frames: dict[int, tuple[int, bytes]] = {}
    late = deadline is not None and deadline <= time.monotonic()
    for i, (c, m) in enumerate(zip(conns, msgs, strict=True)):
        try:
            frames[i] = c._frame(m)
        except ConnectionClosed as e:
            out.append(e)
            continue
        if late:
            c.close()
            out.append(DeadlineExceeded(f"deadline passed before talking to {c.address}"))
            del frames[i]
        else:
            out.append(frames[i][0])
    dl = 0.0 if deadline is None else deadline
    todo = list(frames)
    for lo in range(0, len(todo), 64):
        part = todo[lo:lo + 64]
        try:
            rcs = _native.send_frames([conns[i]._fd for i in part], [int(msgs[i].op) for i in part],
                                      [frames[i][0] for i in part], [frames[i][1] for i in part], dl)
        except NativeError as e:  # the ring itself failed: which frames went out is unknown
            rcs = [-(e.errno or errno.EIO)] * len(part)
        except BaseException:
            for i in part:
                conns[i].close()
            raise
        for i, rc in zip(part, rcs):
            if rc:
                conns[i].close()
                what = f"request to {conns[i].address} failed: {os.strerror(-rc)}"
                out[i] = DeadlineExceeded(what) if rc == -errno.ETIMEDOUT else TransportError(what)
    return out


MAX_SCATTER_PARTS = 64  # buffers one GET object may be scattered over (KVF_MAX_SEGMENTS in C)


def _writable_view(buf: Any, what: str) -> memoryview:
    """``memoryview(buf)``, or ValueError naming ``what`` when it is not a writable contiguous buffer."""
    try:
        v = memoryview(buf)
    except TypeError as e:
        raise ValueError(f"{what} does not support the buffer protocol: {e}") from None
    if v.readonly or not v.c_contiguous:
        raise ValueError(f"{what} is read-only or not contiguous")
    return v


def check_registration(
    buffers: Sequence[Any], *, max_buffers: int = MAX_REGISTERED_BUFFERS, max_bytes: int = MAX_REGISTERED_BYTES
) -> list[Any]:
    """The buffers as a list, once they pass the limits of :meth:`NativeConnection.register_buffers`.

    Raises ValueError (nothing registered) for an empty list, a buffer that is
    read-only, not contiguous, empty or over 1 GiB, more than ``max_buffers``
    buffers or more than ``max_bytes`` in total.
    """
    bufs = list(buffers)
    if not bufs:
        raise ValueError("register_buffers: no buffers given")
    if len(bufs) > max_buffers:
        raise ValueError(f"register_buffers: {len(bufs)} buffers, the limit is {max_buffers}")
    total = 0
    for i, b in enumerate(bufs):
        v = _writable_view(b, f"register_buffers: buffer {i}")
        if v.nbytes == 0 or v.nbytes > MAX_REGISTERED_BUFFER_BYTES:
            raise ValueError(f"register_buffers: buffer {i} holds {v.nbytes} bytes (1 B..{MAX_REGISTERED_BUFFER_BYTES})")
        total += v.nbytes
    if total > max_bytes:
        raise ValueError(f"register_buffers: {total} bytes in total, the limit is {max_bytes}")
    return bufs


class NativeConnection(SocketConnection):
    """A connection whose frames are moved by the C extension. Not thread-safe."""

    name = "native"

    def __init__(self, sock: socket.socket, address: str) -> None:
        sock.settimeout(None)  # blocking fd; deadlines are enforced in C per syscall
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self.address = address
        self._next_id = 1
        self._limits = protocol.DEFAULT_LIMITS
        self._ring: Any = None  # _native.ConnRing while buffers are registered

    # ------------------------------------------------------------------ registered buffers

    def register_buffers(
        self,
        buffers: Sequence[Any],
        *,
        max_buffers: int = MAX_REGISTERED_BUFFERS,
        max_bytes: int = MAX_REGISTERED_BYTES,
    ) -> None:
        """Register reused receive buffers as io_uring fixed buffers for this connection.

        Later GETs whose ``recv_buffers`` entries lie inside a registered
        buffer (whole or a slice) receive those objects with READ_FIXED.
        Replaces an earlier registration. The buffers stay exported (a
        bytearray cannot be resized, a numpy array stays alive) until
        :meth:`unregister_buffers` or :meth:`close`.

        Raises ValueError for an empty list, a read-only or non-contiguous
        buffer, an empty one, one over 1 GiB, more than ``max_buffers`` or more
        than ``max_bytes`` in total (all checked before anything is
        registered), ``ConnectionClosed`` on a closed connection, and
        ``NativeError`` when io_uring cannot be set up or refuses the
        registration (e.g. ENOMEM over RLIMIT_MEMLOCK).
        """
        if self.name != "native":  # shm copies out of the arena: nothing to receive into
            from ..errors import TransportUnavailable

            raise TransportUnavailable(f"registered buffers are a feature of the native transport, not {self.name}")
        if self._sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        bufs = check_registration(buffers, max_buffers=max_buffers, max_bytes=max_bytes)
        self.unregister_buffers()
        self._ring = _native.ConnRing(bufs)  # NativeError when io_uring setup fails: raised now

    def unregister_buffers(self) -> None:
        """Drop the registration (no-op without one); later GETs use recvmsg only.

        Raises RuntimeError (registration kept) while another thread's call uses it.
        """
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def registered_stats(self) -> dict[str, int] | None:
        """``{buffers, bytes, fixed_reads, fixed_bytes}`` of the registration, or None."""
        return None if self._ring is None else self._ring.stats()

    def close(self) -> None:
        # Dropping the reference is enough: a call still using the ring (from
        # another thread) holds its own, and the ring closes when it is freed.
        ring, self._ring = getattr(self, "_ring", None), None
        if ring is not None:
            try:
                ring.close()
            except RuntimeError:  # in use by a call in flight: freed after it
                pass
        super().close()

    # ------------------------------------------------------------------ public

    def request(
        self,
        msg: Message,
        payload_parts: Sequence[Any] = (),
        recv_buffers: Sequence[Any] | None = None,
        *,
        deadline: float | None = None,
        checksums: bool = False,
    ) -> Reply:
        return self.pipeline([(msg, payload_parts, recv_buffers)], deadline=deadline, checksums=checksums)[0]

    def pipeline(
        self,
        requests: Sequence[tuple[Message, Sequence[Any], Sequence[Any] | None]],
        *,
        deadline: float | None = None,
        checksums: bool = False,
    ) -> list[Reply]:
        """Send every ``(msg, payload_parts, recv_buffers)`` request, then read the replies in order.

        ``checksums``: each GET with ``recv_buffers`` has its objects' checksums
        computed in C slice by slice as the bytes land (``Reply.checksums``),
        not in a second pass over the buffers.

        At most the server's ``max_in_flight`` requests are outstanding. Errors
        as for :meth:`request`; the first error reply raises (after the
        remaining replies were read, so the connection stays in step) unless
        it is fatal, in which case the connection is closed.
        """
        if self._sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        hello = getattr(self, "hello", None)
        window = hello.limits.max_in_flight if hello is not None else 1
        prepared = [self._prepare(m, p, r) for m, p, r in requests]
        replies: list[Reply] = []
        first_error: Exception | None = None  # non-fatal: raised once every reply is read
        dl = 0.0 if deadline is None else deadline
        if deadline is not None and deadline <= time.monotonic():
            self.close()
            raise DeadlineExceeded(f"deadline passed before talking to {self.address}")
        lim = self._limits
        try:
            n = len(prepared)
            sent = 0
            for i, (msg, rid, meta, parts, recv) in enumerate(prepared):
                hkeys = digests = None
                if checksums and recv is not None:
                    hkeys, digests = msg.keys, array("Q", bytes(8 * len(recv)))
                if n == 1:  # one call into C: send + receive with one GIL release
                    res_call = lambda: _native.request(  # noqa: E731
                        self._fd, int(msg.op), rid, meta, parts, recv,
                        lim.max_meta_bytes, lim.max_payload_bytes, deadline=dl,
                        ring=self._ring if recv is not None else None, hash_keys=hkeys, digests=digests)
                else:
                    while sent < n and sent < i + window:
                        m2, rid2, meta2, parts2, _ = prepared[sent]
                        _native.send_frame(self._fd, int(m2.op), 0, rid2, meta2, parts2, dl)
                        sent += 1
                    res_call = lambda: _native.recv_frame(  # noqa: E731
                        self._fd, recv, lim.max_meta_bytes, lim.max_payload_bytes, dl,
                        self._ring if recv is not None else None, hkeys, digests)
                try:
                    reply = self._decode(msg, rid, res_call())
                    replies.append(reply if digests is None else Reply(reply.msg, reply.payload, digests))
                except RemoteError as e:
                    if e.code in FATAL_CODES or self._sock is None:  # closed: refused connection
                        raise
                    first_error = first_error or e
                    replies.append(Reply(msg))
                except ValueError as e:  # an object did not fit its buffer; payload drained
                    first_error = first_error or e
                    replies.append(Reply(msg))
        except NativeError as e:
            self.close()
            raise TransportError(f"request to {self.address} failed: {e}") from e
        except BaseException:
            # fatal error replies, broken/timed-out streams, malformed replies,
            # KeyboardInterrupt mid-frame: the stream is out of step
            self.close()
            raise
        if first_error is not None:
            raise first_error
        return replies

    def send_request(self, msg: Message, *, deadline: float | None = None) -> int:
        rid, meta = self._frame(msg)
        if deadline is not None and deadline <= time.monotonic():
            self.close()
            raise DeadlineExceeded(f"deadline passed before talking to {self.address}")
        try:
            _native.send_frame(self._fd, int(msg.op), 0, rid, meta, [], 0.0 if deadline is None else deadline)
        except NativeError as e:
            self.close()
            raise TransportError(f"request to {self.address} failed: {e}") from e
        except BaseException:
            self.close()
            raise
        return rid

    def recv_reply(self, msg: Message, request_id: int, *, deadline: float | None = None) -> Reply:
        if self._sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        lim = self._limits
        try:
            res = _native.recv_frame(self._fd, None, lim.max_meta_bytes, lim.max_payload_bytes,
                                     0.0 if deadline is None else deadline, None)
            return self._decode(msg, request_id, res)
        except RemoteError as e:
            if e.code in FATAL_CODES:
                self.close()
            raise
        except NativeError as e:
            self.close()
            raise TransportError(f"request to {self.address} failed: {e}") from e
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ internals

    def _frame(self, msg: Message) -> tuple[int, bytes]:
        """(request id, metadata) of a request without payload, checked as :meth:`send_request` checks it."""
        if self._sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        if isinstance(msg, (GetRequest, PutRequest)):  # shm moves those through the arena
            raise ValueError("send_request is for requests without payload (not GET/PUT)")
        _, rid, meta, _, _ = self._prepare(msg, (), None)
        return rid, meta

    def _prepare(self, msg: Message, payload_parts: Sequence[Any], recv_buffers: Sequence[Any] | None):
        parts = [memoryview(p).cast("B") for p in payload_parts]
        sent_len = sum(p.nbytes for p in parts)
        if sent_len != msg.payload_len():
            raise ValueError(f"payload parts hold {sent_len} bytes, the message announces {msg.payload_len()}")
        if recv_buffers is not None:
            if not isinstance(msg, GetRequest):
                raise ValueError("recv_buffers only apply to GET")
            if len(recv_buffers) != len(msg.keys):
                raise ValueError(f"{len(recv_buffers)} recv buffers for {len(msg.keys)} keys")
            recv_buffers = list(recv_buffers)
            for i, b in enumerate(recv_buffers):  # checked before sending: C must not fail mid-stream
                if isinstance(b, tuple):  # scatter entry: the object fills these in order
                    if not 1 <= len(b) <= MAX_SCATTER_PARTS:
                        raise ValueError(f"GET buffer {i}: a scatter entry holds 1..{MAX_SCATTER_PARTS} buffers")
                    for j, part in enumerate(b):
                        _writable_view(part, f"GET buffer {i} part {j}")
                else:
                    _writable_view(b, f"GET buffer {i}")
        rid = self._next_id
        self._next_id += 1
        return msg, rid, protocol.encode_meta(msg.to_meta()), parts, recv_buffers

    def _decode(self, msg: Message, rid: int, res: tuple) -> Reply:
        opcode, flags, got_rid, meta, payload_len, payload = res
        header = protocol.Header(opcode, flags, got_rid, len(meta), payload_len)
        if got_rid == 0 and header.is_reply and header.is_error and not payload_len:
            # An error frame with request id 0 answers no request: the server
            # refused the connection as a whole (BUSY over its connection
            # bound) and closes it. Raise it as the RemoteError it is.
            err = protocol.ErrorReply.from_meta(protocol.decode_meta(meta, self._limits))
            self.close()
            raise RemoteError(err.code, err.message)
        if got_rid != rid:
            raise ProtocolError(protocol.ErrorCode.MALFORMED, f"reply for request {got_rid}, expected {rid}")
        reply = protocol.decode_reply(header, meta, msg.op, self._limits)
        if isinstance(reply, GetReply) and payload is not None:
            return Reply(reply, payload)
        return Reply(reply)

    def _hello(self, client_name: str, auth_token: str | None, deadline: float) -> HelloReply:
        """HELLO (and the token's proofs and AUTH: :func:`.base.hello`) on this new connection."""
        return hello(lambda m: self.request(m, deadline=deadline).msg, self.address, client_name, ("native",),
                     auth_token)
