"""Many clients at once against a real server: 64 concurrent connections, the connection bound."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvfabric import protocol as P
from kvfabric.errors import ErrorCode
from kvfabric.testing import start_server
from kvfabric.transport.tcp import connect


def test_64_concurrent_connections_mixed_ops_verified():
    n_clients, rounds = 64, 20
    with start_server(capacity="32MiB") as srv:
        conns = [connect(srv.address, timeout_s=30) for _ in range(n_clients)]  # all open at once
        errors: list[BaseException] = []
        barrier = threading.Barrier(n_clients)

        def worker(idx: int) -> None:
            try:
                c = conns[idx]
                barrier.wait()
                for r in range(rounds):
                    vals = [os.urandom(1000 + (idx * 37 + r * 11 + j) % 9000) for j in range(4)]
                    keys = [b"c%03d-r%03d-%d" % (idx, r, j) for j in range(4)]
                    msg = P.PutRequest(keys, [len(v) for v in vals], [P.checksum(k, v) for k, v in zip(keys, vals)])
                    assert c.request(msg, vals).msg.status == [0, 0, 0, 0]
                    bufs = [bytearray(10_000) for _ in keys]
                    got = c.request(P.GetRequest(keys), recv_buffers=bufs).msg
                    assert got.sizes == [len(v) for v in vals]
                    for b, v in zip(bufs, vals):
                        assert bytes(b[: len(v)]) == v
                    assert c.request(P.LookupRequest(keys)).msg.count == 4
                    assert c.request(P.DeleteRequest(keys[:1])).msg.deleted == 1
            except BaseException as e:  # collected and re-raised in the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        st = conns[0].request(P.StatsRequest()).msg.stats
        assert st["connections"] == n_clients
        assert st["puts"] == n_clients * rounds * 4
        assert st["objects"] == n_clients * rounds * 3
        assert st["errors"] == {}
        for c in conns:
            c.close()


@pytest.mark.parametrize("module", ["kvfabric.testing.reference", "kvfabric"])
def test_connections_over_the_bound_get_busy_then_room_frees(module):
    if module == "kvfabric":
        pytest.importorskip("kvfabric._native", reason="the C extension is not built")
    with start_server(capacity="1MiB", module=module, extra_args=["--max-connections", "4"]) as srv:
        conns = [connect(srv.address, timeout_s=10) for _ in range(4)]
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            head = s.recv(P.HEADER_SIZE, socket.MSG_WAITALL)
            h = P.unpack_header(head)
            meta = P.decode_meta(s.recv(h.meta_len, socket.MSG_WAITALL))
            assert h.is_error and meta["code"] == ErrorCode.BUSY
            assert s.recv(1) == b""
        conns.pop().close()
        # the server notices the close asynchronously; a new connection succeeds soon after
        for _ in range(200):
            try:
                c = connect(srv.address, timeout_s=10)
                break
            except Exception:
                threading.Event().wait(0.05)
        else:
            raise AssertionError("no room after a connection closed")
        st = c.request(P.StatsRequest()).msg.stats
        assert st["connections_refused"] >= 1 and st["errors"]["BUSY"] >= 1
        c.close()
        for c in conns:
            c.close()
