"""Raw-socket HTTP helpers for tests of the bounded HTTP servers (kvfabric/server/httpd.py): the
metrics endpoint and the PD example proxy, driven byte by byte as a hostile client would."""

from __future__ import annotations

import os
import socket


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """(status, bytes read): reads until the server closes or the answer's Content-Length is in;
    AssertionError (with what came) when no HTTP status line came."""
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
    assert data.startswith(b"HTTP/1."), f"no HTTP answer: {data[:200]!r}"
    return int(data.split(b" ", 2)[1]), data


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


__all__ = ["closed_by_peer", "read_answer", "thread_count"]
