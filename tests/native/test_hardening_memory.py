"""The native server's memory bound under the red-team cases of issue 14 (real server processes).

The bound (docs/notes/server.md): resident memory <= capacity + 48 MiB
+ 1 KiB per stored object + 16 KiB per open connection + the reply budget
(``--reply-budget``, 32 MiB) + the request budget (``--request-budget``,
32 MiB), during a hostile load and after it. Each case here breaks the old
bound on the code before this change: per-connection buffers that kept their
largest size, replies queued without a byte bound, freed heap kept by glibc,
and a PUT header that made the server evict before any payload byte arrived.

RSS checks are skipped under AddressSanitizer (CI's second pass): its shadow
memory and quarantine make VmRSS meaningless; the cases still run there.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest

from kvfabric import protocol as p
from kvfabric.testing import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp

UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
MiB = 1 << 20


def bound(capacity: int, objects: int = 0, connections: int = 0) -> int:
    """The stated resident-memory bound of a server (see the module docstring)."""
    return capacity + 48 * MiB + 1024 * objects + 16384 * connections + 32 * MiB + 32 * MiB


def check_rss(srv, limit: int, what: str) -> int:
    rss = srv.rss_bytes()
    print(f"{what}: RSS {rss / MiB:.1f} MiB (bound {limit / MiB:.1f} MiB)")
    if not UNDER_ASAN:
        assert rss <= limit, f"{what}: RSS {rss / MiB:.1f} MiB over the bound {limit / MiB:.1f} MiB"
    return rss


def raw(address: str, timeout: float = 30) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[p.Header, bytes]:
    h = p.unpack_header(recv_exact(sock, p.HEADER_SIZE))
    return h, recv_exact(sock, h.meta_len + h.payload_len)


def frame(op: int, rid: int, meta: dict, payload_len: int = 0) -> bytes:
    m = msgpack.packb(meta, use_bin_type=True)
    return p.pack_header(op, rid, len(m), payload_len) + m


def stats(address: str) -> dict:
    with tcp.connect(address, timeout_s=30) as c:
        return c.request(p.StatsRequest()).msg.stats


def put_many(address: str, keys: list[bytes], value: bytes, batch: int = 512) -> None:
    with tcp.connect(address, timeout_s=60) as c:
        for i in range(0, len(keys), batch):
            ks = keys[i:i + batch]
            c.request(p.PutRequest(keys=ks, sizes=[len(value)] * len(ks), checksums=[p.checksum(k, value) for k in ks]),
                      payload_parts=[value] * len(ks))


def test_connections_give_back_their_large_metadata_buffers():
    # each connection sends one ~1 MiB-metadata request, gets its answer and stays open, idle
    n = 40 if UNDER_ASAN else 300
    with start_server(capacity="16MiB") as srv:
        socks = []
        try:
            big = frame(p.Op.PING, 1, {"pad": bytes(1_000_000)})
            for _ in range(n):
                s = raw(srv.address)
                s.sendall(big)
                h, _ = recv_frame(s)
                assert h.opcode == p.Op.PING and not h.flags & p.FLAG_ERROR
                socks.append(s)
            assert stats(srv.address)["connections"] == n + 1
            check_rss(srv, bound(16 * MiB, 0, n), f"{n} idle connections after a 1 MiB-metadata request each")
        finally:
            for s in socks:
                s.close()


def test_queued_unread_replies_stay_within_the_reply_budget_and_memory_comes_back():
    # 4096 small objects; connections pipeline GETs of all 4096 and never read a reply
    nconn, per_conn = (8, 70) if UNDER_ASAN else (30, 70)
    keys = [b"k%05d" % i for i in range(4096)]
    value = b"v" * 16
    with start_server(capacity="32MiB", extra_args=["--stall-timeout", "120"]) as srv:
        put_many(srv.address, keys, value)
        base = stats(srv.address)
        assert base["objects"] == 4096
        get = frame(p.Op.GET, 7, {"keys": keys})
        socks = [raw(srv.address) for _ in range(nconn)]

        def flood(s: socket.socket) -> None:
            try:
                for _ in range(per_conn):
                    s.sendall(get)
            except OSError:
                pass  # closed below while blocked: the kernel buffers are full, as intended

        threads = [threading.Thread(target=flood, args=(s,), daemon=True) for s in socks]
        for t in threads:
            t.start()
        # the server reads until every connection waits for its replies to be read: hits stop moving
        peak, last, still = 0, -1, 0
        deadline = time.monotonic() + 120
        while still < 5 and time.monotonic() < deadline:
            time.sleep(0.3)
            hits = stats(srv.address)["hits"]
            peak = max(peak, srv.rss_bytes())
            still = still + 1 if hits == last else 0
            last = hits
        st = stats(srv.address)
        assert st["hits"] > base["hits"]
        assert st["reply_budget_waits"] > 0  # connections were paused on their reply budget
        limit = bound(32 * MiB, 4096, nconn)
        print(f"peak RSS while flooding {peak / MiB:.1f} MiB")
        if not UNDER_ASAN:
            assert peak <= limit
        check_rss(srv, limit, f"{nconn} connections x {per_conn} unread GETs of 4096 hits")
        for s in socks:
            s.close()
        for t in threads:
            t.join(30)
        assert wait_for(lambda: stats(srv.address)["connections"] == 1, timeout_s=60)
        time.sleep(1.0)  # the sweep trims the heap at most every 500 ms
        after = check_rss(srv, limit, "after the clients left")
        st = stats(srv.address)  # the budgets' gauges are back to nothing (but this STATS reply)
        assert st["request_bytes"] == 0 and st["reserved_bytes"] == 0 and st["reply_bytes"] < 16384, st
        print(f"after/peak {after / MiB:.1f}/{peak / MiB:.1f} MiB")


def test_a_bare_put_header_evicts_nothing_and_the_stalled_connection_is_dropped():
    with start_server(capacity="64MiB", extra_args=["--stall-timeout", "2"]) as srv:
        keys = [b"keep%d" % i for i in range(8)]
        value = os.urandom(MiB)
        put_many(srv.address, keys, value)
        # a header declaring 16 x 64 MiB (1 GiB, within the limits) and a few payload bytes, then silence
        hostile = [b"big%02d" % i for i in range(16)]
        s = raw(srv.address)
        s.sendall(frame(p.Op.PUT, 1, {"keys": hostile, "sizes": [64 * MiB] * 16, "checksums": [0] * 16},
                        payload_len=16 * 64 * MiB) + b"x" * 100)
        try:
            # dropped by the stall timeout (2 s + the 500 ms sweep; generous wait)
            s.settimeout(60)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        finally:
            s.close()
        st = stats(srv.address)
        assert st["evictions"] == 0 and st["objects"] == 8, st
        assert st["stalled_connections"] == 1
        with tcp.connect(srv.address, timeout_s=30) as c:
            got = c.request(p.GetRequest(keys=keys))
            assert list(got.msg.sizes) == [MiB] * 8
