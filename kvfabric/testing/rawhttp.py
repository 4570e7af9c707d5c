"""Raw-socket HTTP helpers for tests of the bounded HTTP servers (kvfabric/server/httpd.py): the
metrics endpoint and the PD example proxy, driven byte by byte as a hostile client would."""

from __future__ import annotations

import os
import socket


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """(status, bytes read): reads until the server closes or the answer's Content-Length is in;
    AssertionError (with what came) when no HTTP status line came."""
    data = _read(sock)
    assert data.startswith(b"HTTP/1."), f"no HTTP answer: {data[:200]!r}"
    return int(data.split(b" ", 2)[1]), data


def read_answer_or_none(sock: socket.socket) -> tuple[int, bytes] | None:
    """:func:`read_answer`, or None when the connection ended with no byte: a server that refuses a
    connection at its cap answers 503 and closes, and when the client's request is still unread
    there the close is a reset, which may discard the answer before it is read."""
    data = _read(sock)
    if not data:
        return None
    assert data.startswith(b"HTTP/1."), f"no HTTP answer: {data[:200]!r}"
    return int(data.split(b" ", 2)[1]), data


def _read(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lengths = [ln.split(b":", 1)[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
            if lengths and len(body) >= int(lengths[0]):
                break
    return data


def ask(connect, request: bytes, seen: dict[str, int]) -> tuple[int, bytes]:
    """Send ``request`` on a new connection (``connect()``), again until it is answered with another status
    than 503: each 503 is counted in ``seen["503"]``, each connection that ended with no byte in
    ``seen["lost"]`` (refused at the cap with the answer lost to a reset, see :func:`read_answer_or_none`)."""
    while True:
        with connect() as s:
            s.sendall(request)
            got = read_answer_or_none(s)
        if got is None:
            seen["lost"] += 1
        elif got[0] == 503:
            seen["503"] += 1
        else:
            return got


def hold_silent(connect, n: int, seen: dict[str, int]) -> int:
    """Open ``n`` connections that send nothing and read each to its end: one over the server's cap gets
    503 (counted in ``seen["503"]``), one it serves is dropped at its header deadline with no byte;
    returns how many were dropped so."""
    conns = [connect() for _ in range(n)]
    dropped = 0
    for s in conns:
        with s:
            got = read_answer_or_none(s)
        if got is None:
            dropped += 1
        elif got[0] == 503:
            seen["503"] += 1
        else:
            raise AssertionError(f"a connection that sent nothing was answered {got[1][:200]!r}")
    return dropped


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (EOF or reset); never blocks. Discards what it reads."""
    try:
        return sock.recv(65536, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def thread_count(pid: int) -> int:
    """Threads of process ``pid`` now (/proc/PID/task)."""
    return len(os.listdir(f"/proc/{pid}/task"))


__all__ = ["ask", "closed_by_peer", "hold_silent", "read_answer", "read_answer_or_none", "thread_count"]
