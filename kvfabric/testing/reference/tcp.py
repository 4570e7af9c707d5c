"""The pool server's TCP socket loop: one thread per connection, blocking sockets.

Why threads: each connection spends its time in ``recv_into``/``sendmsg``,
which release the GIL, so a thread per connection moves bytes at close to
the kernel's speed with the simplest possible code. The number of
connections is bounded (``max_connections``); a peer over the bound gets one
BUSY error frame and is closed.

Per frame:

1. The 32-byte header is read (waiting as long as it takes while the
   connection is idle; once its first byte arrives the rest of the frame must
   keep coming: the socket's SO_RCVTIMEO/SO_SNDTIMEO are ``stall_timeout_s``,
   so a peer that makes no progress for that long mid-frame, or stops reading
   its reply, is dropped). A frame (and a reply) must also be complete within
   ``stall_timeout_s + its size / min_rate`` (default 1 MiB/s), so a peer
   that trickles a byte now and then cannot hold a connection forever.
2. The header is checked against the limits *before* anything is allocated;
   the metadata buffer (``meta_len`` bytes) is then taken from a process-wide
   budget (``meta_budget_bytes``), so many peers announcing large metadata at
   once cannot grow memory without bound.
3. PUT payloads are received with ``recv_into`` straight into arena slots;
   objects that are not stored are read into a small scratch buffer and
   discarded. GET replies are sent with ``sendmsg`` straight from arena views.

Errors: a frame that violates the protocol gets an error reply with its
stable code (see ``handlers.Handlers.error_reply``). After a fatal code (bad
magic/version, length mismatch, oversize lengths, auth failure) or any error
in the header itself (its lengths cannot be trusted to skip the frame) the
connection is closed, since the byte stream cannot be resynchronised; after
the others (unknown opcode, malformed metadata, too many keys, bad key) the
announced payload is drained and the connection stays usable.
A peer that closes mid-frame, stalls, or sends less payload than announced
is closed; any arena slot it was filling is given back.

Shutdown (:meth:`TcpServer.close`): stop accepting, wake idle connections by
shutting down their read side, let connections in the middle of a frame
finish it, and wait for all connection threads (up to a grace period).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any

from ... import protocol
from ...errors import ErrorCode, ProtocolError
from ...protocol import HEADER, HEADER_SIZE, PutRequest
from .handlers import Handlers, Reply, Session

log = logging.getLogger("kvfabric.testing.reference.tcp")

_IOV_MAX = 512
_SCRATCH = 64 * 1024
_SMALL_META = 64 * 1024
_LINGER_S = 0.25  # how long a closing connection waits for the peer to read an error reply
_LINGER_BYTES = 4 * 1024 * 1024  # metadata up to this size does not draw on the shared budget


class _Stalled(Exception):
    """The peer stopped sending (or reading) in the middle of a frame."""


class _PeerClosed(Exception):
    """The peer closed the connection in the middle of a frame."""


class _MetaBudget:
    """Bytes of metadata buffers that all connections together may hold."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float) -> bool:
        if n <= _SMALL_META:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self.free >= n, timeout) and self._take(n)

    def _take(self, n: int) -> bool:
        self.free -= n
        return True

    def release(self, n: int) -> None:
        if n <= _SMALL_META:
            return
        with self._cond:
            self.free += n
            self._cond.notify_all()


class _Conn:
    __slots__ = ("sock", "peer", "lock", "idle", "thread")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.lock = threading.Lock()
        self.idle = True
        self.thread: threading.Thread | None = None


class TcpServer:
    """Listen on ``host:port`` (0 = any free port) and serve ``handlers`` over TCP.

    ``start()`` binds and listens (``OSError`` if it cannot) and returns the
    real ``(host, port)``; ``serve_forever()`` accepts until ``close()``.
    """

    def __init__(
        self,
        handlers: Handlers,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 1024,
        stall_timeout_s: float = 10.0,
        min_rate: float = 1024 * 1024,
        meta_budget_bytes: int = 64 * 1024 * 1024,
        backlog: int = 512,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be > 0")
        if min_rate <= 0:
            raise ValueError("min_rate must be > 0")
        self.min_rate = float(min_rate)
        self.handlers = handlers
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.stall_timeout_s = stall_timeout_s
        self.backlog = backlog
        self._meta_budget = _MetaBudget(max(meta_budget_bytes, protocol.MAX_META_BYTES))
        self._listener: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        self._stop_requested = False  # set by stop(), possibly from a signal handler
        self._stopping = threading.Event()  # seen by connection threads
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._accept_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(self.backlog)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self.port = sock.getsockname()[1]
        return self.host, self.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serve_forever(self) -> None:
        """Accept connections until :meth:`close`; each gets its own thread."""
        if self._listener is None:
            self.start()
        assert self._listener is not None
        self._accept_thread = threading.current_thread()
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop_requested:
                for key, _ in sel.select():
                    if key.fileobj is self._listener and not self._stop_requested:
                        self._accept()
                    elif key.fileobj is self._wake_r and not self._stop_requested:
                        os.read(self._wake_r, 512)   # a signal's byte (its handler has run by now): not a stop
        finally:
            self._stopping.set()
            sel.close()
            self._listener.close()
            self._stopped.set()

    def signal_wakeup_fd(self) -> int:
        """The write end of the selector's wake pipe, made non-blocking, for ``signal.set_wakeup_fd``: a
        process-directed signal may be taken by any thread, and Python runs its handler only in the main
        thread when that thread next runs bytecode; if a connection thread took it, the main thread would
        sleep on in ``select()`` with the handler pending. With this fd the C-level handler wakes the
        selector whichever thread took the signal."""
        os.set_blocking(self._wake_w, False)
        return self._wake_w

    def stop(self) -> None:
        """Make ``serve_forever`` return. Safe to call from a signal handler (takes no lock)."""
        self._stop_requested = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def close(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight frames finish, wait for connection threads.

        Idle connections are woken by shutting down their read side. Threads
        still busy after ``grace_s`` (default: the stall timeout + 1 s) are
        abandoned to the process exit (they are daemon threads).
        """
        self.stop()
        self._stopping.set()
        if self._accept_thread is not None and threading.current_thread() is not self._accept_thread:
            self._stopped.wait(5.0)  # the accept loop has closed the listener
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with c.lock:
                if c.idle:
                    _shutdown_read(c.sock)
        grace = self.stall_timeout_s + 1.0 if grace_s is None else grace_s
        deadline = time.monotonic() + grace  # one grace period for all threads together
        for c in conns:
            if c.thread is not None:
                c.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(1 for c in conns if c.thread is not None and c.thread.is_alive())
        if stuck:
            log.warning("%d connection(s) still busy after %.3gs; leaving them to the process exit", stuck, grace)

    # ------------------------------------------------------------------ accept

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # e.g. EMFILE: keep the listener alive, but do not spin on it
            log.warning("accept failed: %s", e)
            time.sleep(0.1)
            return
        peer = f"{addr[0]}:{addr[1]}"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._conns_lock:
            full = len(self._conns) >= self.max_connections
            if not full:
                conn = _Conn(sock, peer)
                self._conns.add(conn)
        if full:
            self.handlers.counters.refused()
            self._refuse(sock, peer)
            return
        self.handlers.counters.connection_opened()
        conn.thread = threading.Thread(target=self._serve_conn, args=(conn,), name=f"kvf-conn-{peer}", daemon=True)
        try:
            conn.thread.start()
        except RuntimeError as e:  # the OS refused another thread
            log.warning("cannot start a thread for %s: %s", peer, e)
            with self._conns_lock:
                self._conns.discard(conn)
            self.handlers.counters.connection_closed()
            self._refuse(sock, peer)

    def _refuse(self, sock: socket.socket, peer: str) -> None:
        log.warning("refusing %s: %d connections open (max %d)", peer, len(self._conns), self.max_connections)
        reply = self.handlers.busy_reply(f"too many connections (max {self.max_connections})")
        try:
            sock.settimeout(0.5)
            sock.sendall(reply.head)
        except OSError:
            pass
        finally:
            sock.close()

    # ------------------------------------------------------------------ per connection

    def _serve_conn(self, conn: _Conn) -> None:
        sock = conn.sock
        session = self.handlers.new_session(conn.peer, "tcp")
        header_buf = bytearray(HEADER_SIZE)
        header_view = memoryview(header_buf)
        scratch: list[bytearray] = []
        try:
            # Blocking socket with kernel-side timeouts: a recv/send that makes
            # no progress for stall_timeout_s fails with EAGAIN. One syscall
            # can then move a whole object (MSG_WAITALL, a full sendmsg).
            sock.settimeout(None)
            tv = _timeval(self.stall_timeout_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            while True:
                with conn.lock:
                    conn.idle = True
                    if self._stopping.is_set():
                        break
                try:
                    n = sock.recv_into(header_view, HEADER_SIZE)
                except BlockingIOError:
                    continue  # idle for stall_timeout_s: fine between frames; look at the stop flag
                if n == 0:
                    break  # clean close between frames
                with conn.lock:
                    conn.idle = False
                if n < HEADER_SIZE:
                    _recv_exact(sock, header_view[n:], time.monotonic() + self.stall_timeout_s)
                if not self._frame(sock, session, header_buf, scratch):
                    _lingering_close(sock, scratch)
                    break
        except _Stalled:
            self.handlers.counters.dropped("stalled")
            log.info("dropping %s: stalled mid-frame (no progress for %.3gs or under the minimum rate)", conn.peer, self.stall_timeout_s)
        except _PeerClosed:
            self.handlers.counters.dropped("peer_closed")
            log.info("%s closed the connection mid-frame", conn.peer)
        except OSError as e:
            self.handlers.counters.dropped("io_error")
            log.info("connection %s failed: %s", conn.peer, e)
        except Exception:
            self.handlers.counters.dropped("internal")
            log.exception("connection %s: unexpected error", conn.peer)
        finally:
            try:
                sock.close()
            except OSError:
                pass
            with self._conns_lock:
                self._conns.discard(conn)
            self.handlers.counters.connection_closed()

    def _frame(self, sock: socket.socket, session: Session, header_buf: bytearray, scratch: list[bytearray]) -> bool:
        """Serve one frame whose header is in ``header_buf``; False when the connection must close."""
        h = self.handlers
        _, _, opcode, _, request_id, _, _, _ = HEADER.unpack_from(header_buf)
        try:
            header = h.parse_header(session, header_buf)
        except ProtocolError as e:
            # Any header error closes: the lengths of a header that failed a
            # check cannot be trusted to skip the rest of the frame. After a bad
            # magic nothing in the header is a request id (request id 0, as the C server).
            reply = h.error_reply(session, opcode, 0 if e.code == ErrorCode.BAD_MAGIC else request_id, e)
            reply.close = True
            return self._send_reply(sock, reply, HEADER_SIZE)

        bytes_in = HEADER_SIZE + header.meta_len + header.payload_len
        # The whole frame must arrive within the stall timeout plus its size
        # at the minimum rate: bounds a peer that trickles bytes just fast
        # enough to dodge the per-call no-progress timeout.
        deadline = time.monotonic() + self.stall_timeout_s + bytes_in / self.min_rate
        if not self._meta_budget.acquire(header.meta_len, self.stall_timeout_s):
            exc = ProtocolError(ErrorCode.BUSY, "server metadata buffers exhausted; retry")
            reply = h.error_reply(session, opcode, request_id, exc)
            reply.close = True  # the metadata was not read, so the stream is out of step
            return self._send_reply(sock, reply, HEADER_SIZE)
        meta = None
        try:
            meta = bytearray(header.meta_len)
            _recv_exact(sock, memoryview(meta), deadline)
            try:
                msg = h.decode(session, header, meta)
            except ProtocolError as e:
                reply = h.error_reply(session, opcode, request_id, e)
                if not reply.close:
                    _drain(sock, header.payload_len, scratch, deadline)
                return self._send_reply(sock, reply, bytes_in)
        finally:
            del meta
            self._meta_budget.release(header.meta_len)

        if isinstance(msg, PutRequest):
            reply = self._receive_put(sock, session, header, msg, scratch, deadline)
        else:
            try:
                reply = h.handle(session, header, msg)
            except ProtocolError as e:
                reply = h.error_reply(session, opcode, request_id, e)
            except Exception as e:  # a bug: answer INTERNAL, keep the server up
                log.exception("handler for opcode %d failed", opcode)
                reply = h.error_reply(session, opcode, request_id, ProtocolError(ErrorCode.INTERNAL, f"internal error: {e}"))
        return self._send_reply(sock, reply, bytes_in)

    def _receive_put(
        self, sock: socket.socket, session: Session, header: Any, msg: PutRequest, scratch: list[bytearray], deadline: float
    ) -> Reply:
        ingest = self.handlers.begin_put(session, header, msg)
        try:
            for i, size in enumerate(msg.sizes):
                view = ingest.reserve(i)
                if view is None:
                    _drain(sock, size, scratch, deadline)
                else:
                    _recv_exact(sock, view, deadline)
                    ingest.complete(i)
            return ingest.reply()
        except BaseException:
            ingest.abort()
            raise

    def _send_reply(self, sock: socket.socket, reply: Reply, bytes_in: int) -> bool:
        try:
            views = [memoryview(reply.head), *reply.payload]
            nbytes = sum(v.nbytes for v in views)
            sent = _send_all(sock, views, time.monotonic() + self.stall_timeout_s + nbytes / self.min_rate)
        finally:
            reply.release()
        self.handlers.counters.traffic(bytes_in, sent)
        return not reply.close


# ---------------------------------------------------------------------- socket helpers


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock``; raises _PeerClosed on EOF, _Stalled on a timeout or past ``deadline``."""
    got = 0
    want = view.nbytes
    while got < want:
        if got and time.monotonic() > deadline:
            raise _Stalled()
        try:
            n = sock.recv_into(view[got:] if got else view, 0, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError):
            raise _Stalled() from None
        if n == 0:
            raise _PeerClosed()
        got += n


def _drain(sock: socket.socket, nbytes: int, scratch: list[bytearray], deadline: float) -> None:
    """Read and discard ``nbytes`` (a payload that is not being stored)."""
    if not nbytes:
        return
    if not scratch:
        scratch.append(bytearray(_SCRATCH))
    view = memoryview(scratch[0])
    while nbytes:
        n = min(nbytes, _SCRATCH)
        _recv_exact(sock, view[:n], deadline)
        nbytes -= n
        if nbytes and time.monotonic() > deadline:
            raise _Stalled()


def _send_all(sock: socket.socket, views: list[memoryview], deadline: float) -> int:
    """``sendmsg`` all of ``views`` (resuming partial sends); returns bytes sent.

    Raises _Stalled when a send makes no progress for the socket's timeout or
    the whole reply is not out by ``deadline``.
    """
    views = [v for v in views if v.nbytes]
    total = 0
    i = 0
    while i < len(views):
        if total and time.monotonic() > deadline:
            raise _Stalled()
        try:
            n = sock.sendmsg(views[i : i + _IOV_MAX])
        except (BlockingIOError, TimeoutError):
            raise _Stalled() from None
        total += n
        while n:
            first = views[i]
            if n >= first.nbytes:
                n -= first.nbytes
                i += 1
            else:
                views[i] = first[n:]
                n = 0
    return total


def _lingering_close(sock: socket.socket, scratch: list[bytearray]) -> None:
    """After an error reply: send FIN, then discard what the peer still sends (briefly, boundedly).

    Closing a socket with unread input makes the kernel send RST, which can
    destroy the error reply before the peer reads it.
    """
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(_LINGER_S)
        if not scratch:
            scratch.append(bytearray(_SCRATCH))
        budget = _LINGER_BYTES
        while budget > 0:
            n = sock.recv_into(scratch[0])
            if n == 0:
                break
            budget -= n
    except OSError:
        pass


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


def _shutdown_read(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
