"""A loopback TCP proxy that sees kvfabric frames, for tests that need a lying or broken network.

``FrameProxy(target)`` listens on a free loopback port (``.address``) and
connects each accepted client to ``target``. Bytes pass through untouched
unless a subclass overrides one of the two hooks:

* :meth:`FrameProxy.request_frame` sees each request's header and metadata
  (the payload is streamed through after it) and returns what to send on;
* :meth:`FrameProxy.reply_frame` sees each whole reply frame and returns the
  bytes to send on, or ``None`` to stop forwarding on that connection (the
  client then waits on a reply that never ends).

:class:`SlowReplyProxy` holds each reply of the chosen opcodes (default GET) for
``delay_s`` before sending it on: a pool that answers lookups at once but serves
its bytes slowly (a throttled SSD tier, a congested link), for tests of what
engines do when loading is slower than recomputing.

``close()`` stops listening and closes every connection. Frames are parsed
with :mod:`kvfabric.protocol` (``unpack_header``), so the proxy follows the
protocol version the code under test speaks.
"""

from __future__ import annotations

import socket
import threading

from .. import protocol


def recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """Exactly ``n`` bytes from ``sock``, or None when the peer closed first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


class FrameProxy:
    """A loopback proxy to ``target`` ("host:port"); see the module docstring."""

    #: which directions are parsed into frames (the others are piped as bytes)
    parse_requests = False
    parse_replies = False

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self._ls = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._ls.getsockname()[1]}"
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    # ------------------------------------------------------------------ hooks

    def request_frame(self, h: protocol.Header, head: bytes, meta: bytes) -> tuple[bytes, bytes]:
        """(header, metadata) to send on for a request; its payload follows unchanged."""
        return head, meta

    def reply_frame(self, h: protocol.Header, head: bytes, rest: bytearray) -> bytes | None:
        """The bytes to send on for a reply (``rest``: metadata + payload), or None to stop."""
        return bytes(head) + bytes(rest)

    # ------------------------------------------------------------------ plumbing

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                c, _ = self._ls.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            self._socks += [c, s]
            up = self._requests if self.parse_requests else self._pipe
            down = self._replies if self.parse_replies else self._pipe
            threading.Thread(target=up, args=(c, s), daemon=True).start()
            threading.Thread(target=down, args=(s, c), daemon=True).start()

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._shut(src, dst)

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while (head := recv_exact(src, protocol.HEADER_SIZE)) is not None:
                h = protocol.unpack_header(head)
                meta = recv_exact(src, h.meta_len)
                if meta is None:
                    return
                head, meta = self.request_frame(h, bytes(head), bytes(meta))
                dst.sendall(head + meta)
                left = h.payload_len
                while left:
                    chunk = src.recv(min(left, 1 << 16))
                    if not chunk:
                        return
                    dst.sendall(chunk)
                    left -= len(chunk)
        except OSError:
            pass
        finally:
            self._shut(src, dst)

    def _replies(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while (head := recv_exact(src, protocol.HEADER_SIZE)) is not None:
                h = protocol.unpack_header(head)
                rest = recv_exact(src, h.meta_len + h.payload_len)
                if rest is None:
                    break
                out = self.reply_frame(h, bytes(head), rest)
                if out is None:  # hold the connection open with the reply unfinished
                    self._closed.wait()
                    return
                dst.sendall(out)
        except OSError:
            pass
        self._shut(src, dst)

    def close(self) -> None:
        self._closed.set()
        self._ls.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


class SlowReplyProxy(FrameProxy):
    """Replies of ``ops`` (default GET) are held ``delay_s`` each before they go on; everything else
    passes at once. ``delay_s`` may be changed while it runs; ``delayed`` counts the held replies.
    Replies on one connection stay in order (a reply behind a held one waits for it)."""

    parse_replies = True

    def __init__(self, target: str, delay_s: float, ops: tuple[int, ...] = (protocol.Op.GET,)) -> None:
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        self.delay_s = delay_s
        self.ops = frozenset(int(o) for o in ops)
        self.delayed = 0
        self._count_lock = threading.Lock()
        super().__init__(target)

    def reply_frame(self, h: protocol.Header, head: bytes, rest: bytearray) -> bytes | None:
        if h.opcode in self.ops and self.delay_s > 0:
            with self._count_lock:
                self.delayed += 1
            if self._closed.wait(self.delay_s):   # closing: stop forwarding
                return None
        return bytes(head) + bytes(rest)


__all__ = ["FrameProxy", "SlowReplyProxy", "recv_exact"]
