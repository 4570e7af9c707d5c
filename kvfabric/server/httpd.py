"""A bounded HTTP/1.1 server on the standard library: the metrics endpoint's and the PD example proxy's.

``http.server.ThreadingHTTPServer`` starts a thread per accepted connection and waits for its
bytes forever: every idle or half-sent connection holds a thread (and its buffers) for good, and a
request header may be ~6 MiB (100 lines of 64 KiB). :class:`BoundedHTTPServer` keeps the stdlib's
parsing and handlers and bounds what a client can hold (:class:`Limits`):

* **connections**: at most ``max_connections`` are served at once, each by one thread. The one
  after is answered ``503`` and closed by the accepting thread itself (a canned reply sent without
  blocking), so refused connections cost no thread; the listen backlog is ``backlog``;
* **request head**: request line and headers together at most ``max_header_bytes`` (then ``431``
  and close), all of it within ``header_timeout_s`` of the connection's accept or of the previous
  answer (so an idle keep-alive connection is closed after that long too);
* **request body** (:meth:`BoundedHandler.read_body`): ``Content-Length`` must be one decimal
  number (repeated only with the same value), else ``400``; over ``max_body_bytes`` ``413``; both
  before a byte of the body is read, and the connection is then closed (its unread body must not be
  parsed as the next request). ``Transfer-Encoding`` (chunked bodies) is refused with ``501``; a
  body-carrying request without a length with ``411``. The body must arrive within
  ``body_timeout_s``, and it is read as it arrives (nothing is allocated from the length alone);
  a subclass's :meth:`BoundedHandler.admit_body` can refuse a length with ``503`` (a memory
  budget over all connections);
* **writes**: every socket operation times out after ``io_timeout_s`` (the longer of the two
  timeouts) without progress, so a client that stops reading the answer is dropped too.

Every refusal closes the connection after a short lingering read (at most 64 KiB, 1 s) of what the
client already sent, so that the close does not reset the connection before the answer is read.

The timeouts are deadlines for the whole head or body, not per ``recv``: a client trickling a
byte a second is dropped like one that sends nothing. They are kept by the serving loop
(:meth:`BoundedHTTPServer.service_actions`, every ``poll_interval`` = 0.25 s): a connection past
its deadline is shut down, which ends its handler's blocked read at once.
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("kvfabric.server.httpd")

_POLL_S = 0.25          # how often deadlines are checked (and how late a drop may come)
_CHUNK = 64 << 10       # body bytes read per recv
_LINGER_BYTES = 64 << 10  # after an error answer: unread request bytes read and dropped before closing ...
_LINGER_S = 1.0           # ... for at most this long
_LENGTH = re.compile(r"[0-9]{1,19}")


@dataclass(frozen=True)
class Limits:
    """What one client may hold (see the module docstring); every field must be > 0."""

    max_connections: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 << 10
    max_body_bytes: int = 64 << 20
    backlog: int = 128

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in vars(self).items() if not (isinstance(v, (int, float)) and v > 0)]
        if bad:
            raise ValueError(f"HTTP limits must be > 0: {', '.join(bad)}")

    @property
    def io_timeout_s(self) -> float:
        return max(self.header_timeout_s, self.body_timeout_s)


def _canned(status: int, reason: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


_BUSY = _canned(503, "Service Unavailable", "too many connections\n")


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with :class:`Limits`. :meth:`limit_counts` says what was refused or dropped
    since start: ``connections_refused`` (over the cap, answered 503 by the accepting thread),
    ``timeouts`` (dropped at a header or body deadline, or when a socket operation waited
    ``io_timeout_s``: a read or a write to a client that stopped reading), ``error_answers`` (answers with a status of 400
    or more sent by a handler, :meth:`BoundedHandler.reply`, by status: the refusals 400 / 411 / 413 /
    431 / 501 / 503 and a handler's own, such as 404 or the proxy's 502); and ``connections``, those
    served now. :mod:`kvfabric.server.metrics` exports them (``kvfabric_http_*``, declared in
    :data:`kvfabric.metrics.HTTP`)."""

    daemon_threads = True

    def __init__(self, addr: tuple[str, int], handler: type[BoundedHandler], limits: Limits) -> None:
        self.limits = limits
        self.request_queue_size = limits.backlog
        self._conns: dict[socket.socket, float | None] = {}   # served connection -> read deadline
        self._conns_lock = threading.Lock()
        self._counts = {"connections_refused": 0, "timeouts": 0}
        self._error_answers: dict[int, int] = {}   # status -> answers sent with it
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)

    def process_request(self, request: socket.socket, client_address) -> None:  # the accepting thread
        with self._conns_lock:
            full = len(self._conns) >= self.limits.max_connections
            if full:
                self._counts["connections_refused"] += 1
            else:
                self._conns[request] = time.monotonic() + self.limits.header_timeout_s
        if full:
            try:
                request.send(_BUSY, socket.MSG_DONTWAIT)   # ~100 bytes into an empty send buffer
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except RuntimeError:             # no thread could be started: refuse like over the cap
            self._forget(request)
            self.shutdown_request(request)

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self._conns_lock:
            self._conns.pop(request, None)

    def set_deadline(self, request: socket.socket, seconds: float | None) -> None:
        """Drop ``request`` unless its current read is done within ``seconds`` (None: no deadline)."""
        with self._conns_lock:
            if request in self._conns:
                self._conns[request] = None if seconds is None else time.monotonic() + seconds

    def service_actions(self) -> None:   # the serving loop, every poll interval
        now = time.monotonic()
        with self._conns_lock:
            late = [c for c, d in self._conns.items() if d is not None and d < now]
            for c in late:
                self._conns[c] = None
            self._counts["timeouts"] += len(late)
        for c in late:
            try:
                c.shutdown(socket.SHUT_RDWR)   # the handler's blocked read returns at once
            except OSError:
                pass

    def serve_forever(self, poll_interval: float = _POLL_S) -> None:
        super().serve_forever(poll_interval)

    def handle_error(self, request, client_address) -> None:
        log.debug("HTTP connection from %s ended with an error", client_address, exc_info=True)

    @property
    def open_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def count_timeout(self) -> None:
        with self._conns_lock:
            self._counts["timeouts"] += 1

    def count_answer(self, status: int) -> None:
        """Count an answer of ``status`` (only those of 400 or more are kept)."""
        if status >= 400:
            with self._conns_lock:
                self._error_answers[status] = self._error_answers.get(status, 0) + 1

    def limit_counts(self) -> dict:
        """A snapshot: ``connections_refused``, ``timeouts`` (ints since start), ``error_answers``
        ({status: answers since start}) and ``connections`` (served now)."""
        with self._conns_lock:
            return {**self._counts, "error_answers": dict(self._error_answers), "connections": len(self._conns)}


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler whose head is read within the server's limits; ``do_*`` methods call
    :meth:`read_body` for a body and :meth:`reply` / :meth:`refuse` to answer."""

    protocol_version = "HTTP/1.1"
    server: BoundedHTTPServer
    error_content_type = "application/json"

    def setup(self) -> None:
        self.timeout = self.server.limits.io_timeout_s   # per socket operation: writes to a non-reader
        super().setup()

    def handle_one_request(self) -> None:
        """The stdlib's, with the head read by :meth:`_read_head` (bounded) and parsed from memory."""
        self.server.set_deadline(self.request, self.server.limits.header_timeout_s)
        try:
            head = self._read_head()
            if head is None:
                self.close_connection = True
                return
            self.raw_requestline, _, rest = head.partition(b"\n")
            self.raw_requestline += b"\n"
            sock_file, self.rfile = self.rfile, io.BytesIO(rest)
            try:
                ok = self.parse_request()
            finally:
                self.rfile = sock_file
            if not ok:
                return
            self.server.set_deadline(self.request, None)
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.refuse(501, f"unsupported method {self.command!r}")
                return
            method()
            self.wfile.flush()
        except OSError as e:             # timed out, shut down at a deadline, or reset by the peer
            log.debug("HTTP connection %s dropped: %s", self.client_address, e)
            if isinstance(e, TimeoutError):   # the socket's own timeout came before the loop's deadline
                self.server.count_timeout()
            self.close_connection = True

    def _read_head(self) -> bytes | None:
        """Request line and headers up to the blank line; None (nothing to answer) at EOF, or after
        answering 431 when they exceed ``max_header_bytes``."""
        cap = self.server.limits.max_header_bytes
        lines: list[bytes] = []
        size = 0
        while True:
            line = self.rfile.readline(cap - size + 1)
            if not line:
                return None
            size += len(line)
            if size > cap:
                self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
                self.refuse(431, f"request line and headers over {cap} bytes")
                return None
            if line in (b"\r\n", b"\n"):
                if lines:
                    return b"".join(lines) + line
                continue                 # blank lines before a request line are ignored (RFC 9112 2.2)
            lines.append(line)

    def read_body(self, max_bytes: int | None = None) -> bytearray | None:
        """The request body (``max_bytes``: lower than the server's ``max_body_bytes``), or None after
        answering 400 / 411 / 413 / 501 or when the client did not send it within ``body_timeout_s``
        (then the connection is closed)."""
        limits = self.server.limits
        cap = limits.max_body_bytes if max_bytes is None else min(max_bytes, limits.max_body_bytes)
        if self.headers.get_all("Transfer-Encoding"):
            self.refuse(501, "Transfer-Encoding (chunked request bodies) is not supported: send Content-Length")
            return None
        values = [v.strip() for h in self.headers.get_all("Content-Length") or () for v in h.split(",")]
        if not values:
            self.refuse(411, "Content-Length required")
            return None
        if not all(_LENGTH.fullmatch(v) for v in values) or len({int(v) for v in values}) != 1:
            self.refuse(400, f"bad Content-Length {', '.join(values)!r}: one decimal number of bytes")
            return None
        n = int(values[0])
        if n > cap:
            self.refuse(413, f"request body of {n} bytes over the {cap}-byte limit")
            return None
        if not self.admit_body(n):
            self.refuse(503, f"too many request bodies in progress to take {n} more bytes")
            return None
        self.server.set_deadline(self.request, limits.body_timeout_s)
        body = bytearray()
        while len(body) < n:
            chunk = self.rfile.read1(min(_CHUNK, n - len(body)))
            if not chunk:                # EOF, or shut down at the deadline
                self.close_connection = True
                return None
            body += chunk
        self.server.set_deadline(self.request, None)
        return body

    def admit_body(self, n: int) -> bool:
        """Whether an ``n``-byte body may be read now (a subclass's memory budget); True here."""
        return True

    def reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.server.count_answer(status)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's error answer (a malformed request line, an unsupported HTTP version), counted."""
        self.server.count_answer(code)
        super().send_error(code, message, explain)

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``{"error": message}`` and close the connection (its unread
        bytes must not be taken for the next request)."""
        self.close_connection = True
        self.reply(status, json.dumps({"error": message}).encode())
        self._linger()

    def _linger(self) -> None:
        """Half-close, then read and drop what the client already sent (at most ``_LINGER_BYTES``, for
        at most ``_LINGER_S``): closing a socket with unread bytes resets the connection, and a reset
        can discard the answer before the client reads it."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            left = _LINGER_BYTES
            while left > 0:
                chunk = self.connection.recv(min(left, _CHUNK))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def log_message(self, fmt: str, *args) -> None:   # access log at debug level only
        log.debug("%s " + fmt, self.address_string(), *args)


__all__ = ["BoundedHTTPServer", "BoundedHandler", "Limits"]
