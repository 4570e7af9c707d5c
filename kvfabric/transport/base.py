"""The interface every kvfabric transport implements: one request out, its reply in.

A :class:`Connection` is a connected, HELLO-negotiated link to one pool server.
It is *not* thread-safe: the client keeps a small pool of connections per shard
and hands each to one thread at a time. A request is strictly one frame out and
one reply frame in; there is no pipelining at this layer.

Failure model (the client relies on it):

* An error reply from the server raises :class:`~kvfabric.errors.RemoteError`.
  If its code is one after which the server closes the stream
  (``errors.FATAL_CODES``) the connection marks itself closed.
* Anything that leaves the byte stream in an unknown state (a socket error, a
  timeout mid-frame, the peer closing, a malformed reply) raises
  :class:`~kvfabric.errors.TransportError` (or a subclass) and closes the
  connection; it is never reused.
* A GET reply object larger than the caller's buffer raises ``ValueError``
  (a programming error) *after* the reply has been read completely, so the
  connection stays usable.

GET payloads go straight into the caller's buffers: ``recv_buffers`` holds one
writable buffer per requested key; the reply's ``sizes`` say which keys were
found, and found objects arrive concatenated in key order, so object ``i`` is
received into ``recv_buffers[i][:sizes[i]]`` with no intermediate copy. An
entry may instead be a tuple of writable buffers (a scatter entry, e.g. a
small header buffer and the caller's payload buffer): the object fills them in
order, and buffers past its end get nothing.
"""

from __future__ import annotations

import fcntl
import select
import socket
import termios
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import protocol
from ..errors import AuthError, ConfigError, DeadlineExceeded, ErrorCode, ProtocolError, TransportError
from ..protocol import HEADER, HEADER_SIZE, AuthReply, AuthRequest, HelloReply, HelloRequest, Limits, Message

__all__ = ["Connection", "Reply", "parse_address", "remaining", "get_sinks", "hello"]

Buffer = Any  # anything that supports the writable buffer protocol


@dataclass(frozen=True, slots=True)
class Reply:
    """One decoded reply.

    ``msg`` is the protocol reply message (``protocol.GetReply`` for a GET...).
    ``payload`` holds the reply payload only when a GET was made without
    ``recv_buffers`` (one bytearray, objects concatenated in key order);
    otherwise the bytes are already in the caller's buffers and it is ``None``.
    ``checksums`` (a GET into ``recv_buffers`` asked with ``checksums=True``,
    on a transport that computes them while receiving; ``None`` otherwise):
    :func:`protocol.checksum` of each object received, index ``i`` for key
    ``i`` (meaningless for a miss), to compare with the reply's.
    """

    msg: Message
    payload: bytearray | None = None
    checksums: Sequence[int] | None = None


class Connection(ABC):
    """A negotiated connection to one server (see the module docstring)."""

    #: registry name of the transport ("tcp", "native", "shm", ...)
    name: ClassVar[str]

    #: the "host:port" this connection was made to
    address: str
    #: the server's HELLO reply (server_id, transports, limits, capacity)
    hello: HelloReply

    @abstractmethod
    def request(
        self,
        msg: Message,
        payload_parts: Sequence[Buffer] = (),
        recv_buffers: Sequence[Buffer] | None = None,
        *,
        deadline: float | None = None,
        checksums: bool = False,
    ) -> Reply:
        """Send one request frame (``msg`` + payload) and return its reply.

        ``payload_parts`` are sent back to back as the frame payload without
        being joined; their total must equal ``msg.payload_len()``.
        ``recv_buffers`` (GET only) receive the found objects, one buffer per
        key. ``checksums``: a transport that can compute each received
        object's checksum while receiving does so (``Reply.checksums``);
        others ignore it. ``deadline`` is an absolute ``time.monotonic()`` value; past it
        the call raises :class:`~kvfabric.errors.DeadlineExceeded` and the
        connection is closed. Errors: see the module docstring.
        """

    @abstractmethod
    def close(self) -> None:
        """Close the connection; idempotent, never raises."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once the connection is closed or broken."""

    def stale(self) -> bool:
        """For an idle connection (no request outstanding): True when it can no longer serve one,
        because the peer closed it (a server's idle timeout, a restart) or left bytes nobody asked
        for. Never blocks, never raises. Connections that cannot tell answer False."""
        return self.closed

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SocketConnection(Connection):
    """A connection that owns one socket: ``closed`` and an idempotent ``close``.

    Its requests can also be split in two, so that one thread can have a
    request outstanding on several connections at once (the client's
    single-thread fan-out of small requests): :meth:`send_request` puts the
    frame on the wire, :meth:`reply_ready` says (without blocking) whether the
    whole reply has arrived, and :meth:`recv_reply` reads it. Only for
    requests that carry no payload and expect none (not GET/PUT).
    """

    _sock: socket.socket | None
    _limits: Limits

    @abstractmethod
    def send_request(self, msg: Message, *, deadline: float | None = None) -> int:
        """Send ``msg`` and return its request id, without waiting for the reply.

        The reply must be read with :meth:`recv_reply` before anything else is
        sent. Raises ``ValueError`` for GET/PUT (and sends nothing); errors
        otherwise as for :meth:`request`.
        """

    @abstractmethod
    def recv_reply(self, msg: Message, request_id: int, *, deadline: float | None = None) -> Reply:
        """Read the reply to ``msg`` sent by :meth:`send_request`. Errors as for :meth:`request`."""

    def fileno(self) -> int:
        """The socket's descriptor (for ``poll``); -1 once closed."""
        sock = self._sock
        return -1 if sock is None else sock.fileno()

    def reply_ready(self) -> bool:
        """True when :meth:`recv_reply` will not block: a whole reply frame is queued on the
        socket, or the read will fail at once (closed connection, peer gone, a header over
        the limits). Never blocks, never raises. A partly arrived frame is not ready."""
        sock = self._sock
        if sock is None:
            return True
        try:
            head = sock.recv(HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if len(head) < HEADER_SIZE:
            return not head  # b"": the peer closed
        _, _, _, _, _, meta_len, payload_len, _ = HEADER.unpack(head)
        if meta_len > self._limits.max_meta_bytes or payload_len > self._limits.max_payload_bytes:
            return True  # refused at the header
        want = HEADER_SIZE + meta_len + payload_len
        queued = bytearray(4)
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, queued)
        except OSError:
            return True
        return int.from_bytes(queued, "little", signed=True) >= want

    @property
    def closed(self) -> bool:
        return self._sock is None

    def stale(self) -> bool:
        sock = self._sock
        if sock is None:
            return True
        try:  # poll, not a recv: it never waits, whatever timeout the socket has
            p = select.poll()
            p.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            # readable = closed by the peer (EOF), an error, or bytes nobody asked for
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


def hello(
    request: Callable[[Message], Message], address: str, client_name: str, transports: tuple[str, ...],
    auth_token: str | None,
) -> HelloReply:
    """HELLO, and with a token the mutual proof and AUTH (protocol 3, :mod:`kvfabric.protocol.auth`).

    ``request(msg)`` sends one request on the new connection and returns its decoded reply (the
    transport's own request path, with its deadline). Returns the HELLO reply once the connection
    may be used: nothing but HELLO (and, when the server proved it holds the token, AUTH) has been
    sent. Raises ``ConfigError`` (before anything is sent) for a token with a NUL character,
    ``ProtocolError(BAD_VERSION)`` for a reply of another version, :class:`AuthError`
    (naming ``address``) when a server with a token did not prove it or one without claims it needs
    none while we hold one, or requires a token we do not have; ``RemoteError`` when the server
    refuses our AUTH; whatever ``request`` raises. The caller closes the connection on any of them.
    """
    protocol.check_token(auth_token)
    nonce = protocol.new_nonce()
    reply = request(HelloRequest(client=client_name, transports=transports, nonce=nonce))
    assert isinstance(reply, HelloReply)
    if reply.version != protocol.VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"server {address} speaks protocol {reply.version}, this client protocol {protocol.VERSION} "
            "(since protocol 3 HELLO proves both sides hold the pool token)",
        )
    if auth_token is None:
        if reply.auth_required:
            raise AuthError(f"server {address} requires a pool token (auth_token / KVFABRIC_AUTH_TOKEN): refused")
        return reply
    if not reply.auth_required or reply.nonce is None or not protocol.proof_ok(
        protocol.server_proof(auth_token, nonce, reply.nonce, reply.server_id), reply.proof
    ):
        raise AuthError(f"server {address} did not prove it holds the pool token: refused")
    ok = request(AuthRequest(proof=protocol.client_proof(auth_token, reply.nonce, nonce)))
    assert isinstance(ok, AuthReply)
    return reply


def dial(address: str, deadline: float) -> socket.socket:
    """A TCP connection to ``address`` ("host:port") made before ``deadline`` (``time.monotonic()``).

    Raises ``ConfigError`` for a malformed address, ``DeadlineExceeded`` when
    the connect times out, ``TransportError`` (with the ``OSError`` as
    ``__cause__``) when the server cannot be reached.
    """
    host, port = parse_address(address)
    try:
        return socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
    except TimeoutError as e:
        raise DeadlineExceeded(f"connect to {address} timed out") from e
    except OSError as e:
        raise TransportError(f"cannot connect to {address}: {e}") from e


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``.

    Raises :class:`~kvfabric.errors.ConfigError` for anything else.
    """
    if not isinstance(address, str):
        raise ConfigError(f"server address must be a 'host:port' str, got {address!r}")
    host, sep, port_s = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_s.isdigit():
        raise ConfigError(f"server address must look like 'host:port', got {address!r}")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ConfigError(f"port out of range in {address!r}")
    return host, port


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``None`` = no deadline); may be <= 0."""
    if deadline is None:
        return None
    return deadline - time.monotonic()


def get_sinks(
    sizes: Sequence[int], recv_buffers: Sequence[Buffer], payload_len: int
) -> tuple[list[tuple[int, memoryview | tuple[memoryview, ...] | None]], str | None]:
    """Plan where each found object of a GET reply goes.

    Returns ``(sinks, problem)``: ``sinks`` is one ``(nbytes, view)`` per found
    object in payload order, ``view`` being the caller's buffer cut to
    ``nbytes`` (for a scatter entry, a tuple of its buffers' views cut so that
    they hold ``nbytes`` together, empty ones left out), or ``None`` when that
    buffer cannot take the object (too
    small, read-only, not contiguous): those bytes must be read and discarded,
    and once the frame is consumed the transport raises ``ValueError(problem)``.
    Raises :class:`~kvfabric.errors.ProtocolError` when the reply is
    inconsistent with the request (wrong number of sizes, sizes not adding up
    to ``payload_len``): the connection must then be dropped.
    """
    if len(sizes) != len(recv_buffers):
        raise ProtocolError(ErrorCode.MALFORMED, f"reply has {len(sizes)} sizes for {len(recv_buffers)} keys")
    total = 0
    sinks: list[tuple[int, memoryview | tuple[memoryview, ...] | None]] = []
    problem = None
    for i, (n, buf) in enumerate(zip(sizes, recv_buffers)):
        if not isinstance(n, int) or n < 0:
            continue
        total += n
        if isinstance(buf, tuple):
            parts, problem_i = _scatter_views(i, n, buf)
            problem = problem or problem_i
            sinks.append((n, parts))
            continue
        try:
            view = memoryview(buf).cast("B")
        except TypeError as e:
            problem = f"GET buffer {i} is not a contiguous buffer: {e}"
            sinks.append((n, None))
            continue
        if view.readonly:
            problem = f"GET buffer {i} is read-only"
            sinks.append((n, None))
        elif view.nbytes < n:
            problem = f"GET buffer {i} holds {view.nbytes} bytes, the object has {n}"
            sinks.append((n, None))
        else:
            sinks.append((n, view[:n]))
    if total != payload_len:
        raise ProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"reply sizes add up to {total} bytes but the payload is {payload_len}"
        )
    return sinks, problem


def _scatter_views(i: int, n: int, bufs: tuple[Buffer, ...]) -> tuple[tuple[memoryview, ...] | None, str | None]:
    """Views of the scatter entry ``bufs`` that take ``n`` bytes in order; (None, problem) when they cannot."""
    parts: list[memoryview] = []
    left = n
    for j, buf in enumerate(bufs):
        try:
            view = memoryview(buf).cast("B")
        except TypeError as e:
            return None, f"GET buffer {i} part {j} is not a contiguous buffer: {e}"
        if view.readonly:
            return None, f"GET buffer {i} part {j} is read-only"
        take = min(left, view.nbytes)
        if take:
            parts.append(view[:take])
        left -= take
    if left:
        return None, f"GET buffer {i} holds {n - left} bytes in its parts, the object has {n}"
    return tuple(parts), None
