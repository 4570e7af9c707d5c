"""The native server's timeouts and SIGTERM drain (issue 14), against real server processes.

- A header trickled one byte at a time is a frame in progress: it is dropped
  by the stall / min-rate bound instead of being kept forever.
- With a token, a connection that does not authenticate within the stall
  timeout is closed, so silent sockets cannot fill ``--max-connections`` and
  lock token holders out; ``--idle-timeout`` closes connections idle between
  frames. Each is counted in STATS.
- SIGTERM drains: idle connections are closed at once, a PUT being received
  completes and gets its STORED reply, then the process exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from kvfabric import protocol as p
from kvfabric.errors import RemoteError, TransportError
from kvfabric.testing import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp


def raw(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=30)


def closed_by_peer(sock: socket.socket, timeout: float = 0.0) -> bool:
    """Whether the server closed ``sock`` (EOF or reset), waiting up to ``timeout`` seconds."""
    sock.settimeout(timeout if timeout > 0 else 0.001)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, BlockingIOError, socket.timeout):
        return False


def stats(address: str, token: str | None = None) -> dict:
    with tcp.connect(address, timeout_s=30, auth_token=token) as c:
        return c.request(p.StatsRequest()).msg.stats


def test_a_header_trickled_one_byte_every_2_s_is_dropped():
    # stall timeout 3 s: each byte (every 2 s) is progress, so only the frame's bound
    # (stall timeout + size / min-rate from its first byte) can drop it, as the Python server does
    with start_server(capacity="4MiB", extra_args=["--stall-timeout", "3"]) as srv:
        header = p.encode_request(p.PingRequest(), 1)[: p.HEADER_SIZE]
        socks = [raw(srv.address) for _ in range(5)]
        dropped = [False] * len(socks)
        for k in range(16):  # 16 of the 32 header bytes: 32 s, far past the bound
            for i, s in enumerate(socks):
                if dropped[i]:
                    continue
                try:
                    s.sendall(header[k:k + 1])
                except OSError:
                    dropped[i] = True
                    continue
                dropped[i] = closed_by_peer(s)
            if all(dropped):
                break
            time.sleep(2)
        assert all(dropped), dropped
        st = stats(srv.address)
        assert st["slow_connections"] + st["stalled_connections"] >= len(socks), st
        for s in socks:
            s.close()


def test_silent_unauthenticated_connections_are_closed_and_a_token_holder_gets_in():
    args = ["--auth-token", "sesame", "--max-connections", "4", "--stall-timeout", "2"]
    with start_server(capacity="4MiB", extra_args=args) as srv:
        silent = [raw(srv.address) for _ in range(4)]  # fill --max-connections, say nothing
        for s in silent:
            assert closed_by_peer(s, timeout=60)  # pre-auth timeout (the stall timeout)
        # the slots are free again: a token holder gets in (the server sees closes asynchronously)
        def connect():
            try:
                return tcp.connect(srv.address, timeout_s=30, auth_token="sesame")
            except (RemoteError, TransportError):
                return None

        c = wait_for(connect, timeout_s=30)
        assert c is not None
        with c:
            st = c.request(p.StatsRequest()).msg.stats
        assert st["preauth_timeouts"] >= 4, st
        for s in silent:
            s.close()


def test_idle_connections_are_closed_after_the_idle_timeout():
    with start_server(capacity="4MiB", extra_args=["--idle-timeout", "2"]) as srv:
        idle = tcp.connect(srv.address, timeout_s=30)
        busy = tcp.connect(srv.address, timeout_s=30)
        s = raw(srv.address)  # never says anything
        try:
            # a connection that keeps talking is kept meanwhile
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                assert isinstance(busy.request(p.PingRequest()).msg, p.PingReply)
                time.sleep(0.1)
            assert closed_by_peer(s, timeout=60)
            with pytest.raises(TransportError):
                idle.request(p.PingRequest())
            assert isinstance(busy.request(p.PingRequest()).msg, p.PingReply)
            assert stats(srv.address)["idle_timeouts"] >= 2
        finally:
            for c in (idle, busy):
                c.close()
            s.close()


def test_sigterm_drains_a_put_in_flight_and_closes_idle_connections_at_once():
    with start_server(capacity="64MiB", extra_args=["--drain-timeout", "60"]) as srv:
        data = os.urandom(8 << 20)
        meta = p.encode_meta({"keys": [b"inflight"], "sizes": [len(data)], "checksums": [p.checksum(b"inflight", data)]})
        s = raw(srv.address)
        s.sendall(p.pack_header(p.Op.PUT, 5, len(meta), len(data)) + meta + data[: 1 << 20])
        idle = raw(srv.address)
        # the server is in the middle of the frame: its slot is reserved
        assert wait_for(lambda: stats(srv.address)["reserved_bytes"] > 0, timeout_s=30)
        srv.popen.send_signal(signal.SIGTERM)
        assert closed_by_peer(idle, timeout=30)  # idle: closed at once, while the PUT goes on
        assert srv.alive
        s.sendall(data[1 << 20:])
        s.settimeout(30)
        h = p.unpack_header(s.recv(p.HEADER_SIZE, socket.MSG_WAITALL))
        reply = p.decode_meta(s.recv(h.meta_len, socket.MSG_WAITALL))
        assert not h.flags & p.FLAG_ERROR and reply["status"] == [p.PutStatus.STORED]
        assert closed_by_peer(s, timeout=30)  # then its connection is closed too
        assert srv.popen.wait(120) == 0, srv.stderr_text()[-4000:]   # a hang guard, not a timing check
        s.close()
        idle.close()
