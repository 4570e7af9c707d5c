"""The ``tcp`` transport: pure Python, blocking sockets, the reference path.

Sending: one ``sendmsg`` of ``[header+metadata, payload part, ...]``; payload
parts are never joined (a PUT of many blocks goes out as one gathered write,
resumed where the kernel stopped on a partial send).

Receiving: the 32-byte header into a reused buffer, the metadata into a buffer
of exactly ``meta_len`` bytes (bounded by the limits before allocating), then
the GET payload with ``recv_into`` straight into the caller's buffers, one
object after another: payload bytes are copied once, by the kernel.

Deadlines: every ``send``/``recv`` is given the time left until the call's
deadline as its socket timeout, so a call never blocks past it; when it runs
out the connection is closed (the stream is then out of step) and
:class:`~kvfabric.errors.DeadlineExceeded` is raised.

Failures follow ``transport.base``: a broken, timed-out or confused connection
closes itself and raises a :class:`~kvfabric.errors.TransportError` (or
``ProtocolError`` for a malformed reply); an error reply raises ``RemoteError``.
An error frame with request id 0 (a server over its connection bound answers
a new connection with BUSY that way, then closes it) raises ``RemoteError``
too, and closes the connection.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

from .. import protocol
from ..errors import (
    FATAL_CODES,
    ConnectionClosed,
    DeadlineExceeded,
    KVFabricError,
    ProtocolError,
    RemoteError,
    TransportError,
)
from ..protocol import GetReply, GetRequest, Message, PutRequest
from .base import Reply, SocketConnection, dial, get_sinks, hello

__all__ = ["TcpConnection", "connect", "probe"]

_IOV_MAX = 512  # stay well under the kernel's 1024 iovecs per sendmsg
_DRAIN_CHUNK = 256 * 1024


def probe() -> str | None:
    """``None``: tcp is always available (the reason string otherwise)."""
    return None


def connect(
    address: str,
    *,
    timeout_s: float,
    auth_token: str | None = None,
    client_name: str = "kvfabric",
    hello_timeout_s: float | None = None,
) -> TcpConnection:
    """Connect to ``address`` ("host:port") and run HELLO.

    ``timeout_s`` bounds reaching the server (the TCP handshake, which the kernel answers even when
    the server is loaded); ``hello_timeout_s`` (default: ``timeout_s``) bounds its HELLO reply
    from then on: a server that accepted the connection is alive, and a slow reply means load.

    Raises ``ConfigError`` for a malformed address, ``TransportError`` when the
    server cannot be reached or does not answer in time, ``RemoteError`` when
    it refuses the HELLO or AUTH (``AUTH_FAILED``, ``BAD_VERSION``) or the connection
    (``BUSY``: over its connection bound), :class:`~kvfabric.errors.AuthError` when it
    does not prove it holds our token (:func:`.base.hello`), ``ProtocolError`` when its
    reply is not a valid HELLO reply.
    """
    deadline = time.monotonic() + timeout_s
    conn = TcpConnection(dial(address, deadline), address)
    if hello_timeout_s is not None:
        deadline = time.monotonic() + hello_timeout_s
    try:
        conn.hello = hello(lambda m: conn.request(m, deadline=deadline).msg, address, client_name, ("tcp",),
                           auth_token)
    except BaseException:
        conn.close()
        raise
    return conn


class TcpConnection(SocketConnection):
    """A blocking-socket connection to one server. Not thread-safe."""

    name = "tcp"

    def __init__(self, sock: socket.socket, address: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock: socket.socket | None = sock
        self.address = address
        self._next_id = 1
        self._header = bytearray(protocol.HEADER_SIZE)
        self._scratch: bytearray | None = None
        # Replies are decoded against our own defaults; the server's limits are
        # what the client batches against.
        self._limits = protocol.DEFAULT_LIMITS

    # ------------------------------------------------------------------ public

    def request(
        self,
        msg: Message,
        payload_parts: Sequence[Any] = (),
        recv_buffers: Sequence[Any] | None = None,
        *,
        deadline: float | None = None,
        checksums: bool = False,  # not computed here: Reply.checksums stays None
    ) -> Reply:
        if self._sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        parts = [memoryview(p).cast("B") for p in payload_parts]
        sent_len = sum(p.nbytes for p in parts)
        if sent_len != msg.payload_len():
            raise ValueError(f"payload parts hold {sent_len} bytes, the message announces {msg.payload_len()}")
        if recv_buffers is not None and not isinstance(msg, GetRequest):
            raise ValueError("recv_buffers only apply to GET")
        rid = self._next_id
        self._next_id += 1
        head = protocol.encode_request(msg, rid)

        def exchange() -> tuple[Reply, str | None]:
            self._send([memoryview(head), *parts], deadline)
            return self._read_reply(msg, rid, recv_buffers, deadline)

        reply, problem = self._guarded(msg, exchange)
        if problem is not None:
            # A caller's buffer could not take an object; the frame was consumed
            # in full, so the connection stays usable.
            raise ValueError(problem)
        return reply

    def send_request(self, msg: Message, *, deadline: float | None = None) -> int:
        if self._sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        if isinstance(msg, (GetRequest, PutRequest)):
            raise ValueError("send_request is for requests without payload (not GET/PUT)")
        rid = self._next_id
        self._next_id += 1
        self._guarded(msg, self._send, [memoryview(protocol.encode_request(msg, rid))], deadline)
        return rid

    def recv_reply(self, msg: Message, request_id: int, *, deadline: float | None = None) -> Reply:
        return self._guarded(msg, self._read_reply, msg, request_id, None, deadline)[0]

    # ------------------------------------------------------------------ internals

    def _guarded(self, msg: Message, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with :meth:`request`'s failure mapping: a broken or timed-out stream
        closes the connection and raises a TransportError; fatal error replies close it too."""
        try:
            return fn(*args)
        except RemoteError as e:
            if e.code in FATAL_CODES:
                self.close()
            raise
        except KVFabricError:
            self.close()
            raise
        except TimeoutError as e:
            self.close()
            raise DeadlineExceeded(f"{msg.op.name} to {self.address} ran past its deadline") from e
        except OSError as e:
            self.close()
            raise TransportError(f"{msg.op.name} to {self.address} failed: {e}") from e
        except BaseException:
            # KeyboardInterrupt, or any surprise mid-frame: the stream is out of step.
            self.close()
            raise

    def _timeout(self, deadline: float | None) -> socket.socket:
        sock = self._sock
        if sock is None:
            raise ConnectionClosed(f"connection to {self.address} is closed")
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"deadline passed talking to {self.address}")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        return sock

    def _send(self, views: list[memoryview], deadline: float | None) -> None:
        views = [v for v in views if v.nbytes]
        i = 0
        while i < len(views):
            sock = self._timeout(deadline)
            n = sock.sendmsg(views[i : i + _IOV_MAX])
            while n:
                first = views[i]
                if n >= first.nbytes:
                    n -= first.nbytes
                    i += 1
                else:
                    views[i] = first[n:]
                    n = 0

    def _recv_into(self, view: memoryview, deadline: float | None) -> None:
        got = 0
        want = view.nbytes
        while got < want:
            sock = self._timeout(deadline)
            n = sock.recv_into(view[got:] if got else view)
            if n == 0:
                raise ConnectionClosed(f"{self.address} closed the connection mid-reply")
            got += n

    def _drain(self, nbytes: int, deadline: float | None) -> None:
        if self._scratch is None:
            self._scratch = bytearray(_DRAIN_CHUNK)
        view = memoryview(self._scratch)
        while nbytes:
            n = min(nbytes, _DRAIN_CHUNK)
            self._recv_into(view[:n], deadline)
            nbytes -= n

    def _read_reply(
        self, msg: Message, rid: int, recv_buffers: Sequence[Any] | None, deadline: float | None
    ) -> tuple[Reply, str | None]:
        self._recv_into(memoryview(self._header), deadline)
        header = protocol.unpack_header(self._header, self._limits)
        refused = header.request_id == 0 and header.is_reply and header.is_error
        if header.request_id != rid and not refused:
            raise ProtocolError(
                protocol.ErrorCode.MALFORMED, f"reply for request {header.request_id}, expected {rid}"
            )
        meta = bytearray(header.meta_len)
        self._recv_into(memoryview(meta), deadline)
        if header.is_error and header.payload_len:
            raise ProtocolError(protocol.ErrorCode.MALFORMED, "error reply with a payload")
        if refused:
            # An error frame with request id 0 answers no request: the server
            # refused the connection as a whole (BUSY over its connection
            # bound) and closes it. Raise it as the RemoteError it is.
            err = protocol.ErrorReply.from_meta(protocol.decode_meta(meta, self._limits))
            self.close()
            raise RemoteError(err.code, err.message)
        reply = protocol.decode_reply(header, meta, msg.op, self._limits)
        if not isinstance(reply, GetReply) or header.payload_len == 0:
            return Reply(reply), None
        if recv_buffers is None:
            payload = bytearray(header.payload_len)
            self._recv_into(memoryview(payload), deadline)
            return Reply(reply, payload), None
        sinks, problem = get_sinks(reply.sizes, recv_buffers, header.payload_len)
        for nbytes, view in sinks:
            if view is None:
                self._drain(nbytes, deadline)
            elif isinstance(view, tuple):  # scatter entry
                for part in view:
                    self._recv_into(part, deadline)
            elif nbytes:
                self._recv_into(view, deadline)
        return Reply(reply), problem
