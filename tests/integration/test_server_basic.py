"""A real ``kvfabric serve`` process: every operation, eviction order, auth, STATS, CLI, shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvfabric import protocol as P
from kvfabric.errors import AuthError, ErrorCode, TransportError
from kvfabric.testing import start_pool, start_server
from kvfabric.transport.tcp import connect

KiB = 1024


def exit_status(srv, bound_s: float = 120.0) -> int:
    """The server's exit status once it exits after a signal; a hang guard, not a timing check (CI at load 20
    saw a 1-s shutdown take over 15 s): past ``bound_s`` the test fails with the server's log."""
    try:
        return srv.popen.wait(bound_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {bound_s} s of the signal; its log:\n{srv.stderr_text()[-4000:]}")


def put(conn, keys, values, parents=None):
    msg = P.PutRequest(keys, [len(v) for v in values], [P.checksum(k, v) for k, v in zip(keys, values)], parents)
    return conn.request(msg, values).msg.status


def get(conn, keys):
    r = conn.request(P.GetRequest(keys))
    out, pos = [], 0
    for size in r.msg.sizes:
        if size < 0:
            out.append(None)
        else:
            out.append(bytes(r.payload[pos : pos + size]))
            pos += size
    return out


def stats(conn):
    return conn.request(P.StatsRequest()).msg.stats


def test_all_operations_roundtrip():
    with start_server(capacity="16MiB") as srv:
        c = connect(srv.address, timeout_s=10)
        assert c.hello.server_id == srv.address
        assert c.hello.capacity == 16 << 20
        assert "tcp" in c.hello.transports
        values = [os.urandom(n) for n in (1, 4095, 4096, 4097, 300_000, 0)]
        keys = [os.urandom(16) for _ in values]
        assert put(c, keys, values) == [P.PutStatus.STORED] * len(values)
        assert put(c, keys[:1], values[:1]) == [P.PutStatus.EXISTS]
        assert get(c, keys + [b"nope"]) == values + [None]
        assert c.request(P.ExistsRequest([keys[0], b"nope", keys[1]])).msg.present == [True, False, True]
        assert c.request(P.LookupRequest(keys[:3] + [b"nope"] + keys[3:])).msg.count == 3
        assert c.request(P.DeleteRequest([keys[0], b"nope"])).msg.deleted == 1
        assert get(c, keys[:2]) == [None, values[1]]
        c.request(P.PingRequest())
        st = stats(c)
        for name in ("objects", "bytes_used", "capacity", "hits", "misses", "puts", "evictions",
                     "checksum_failures", "bytes_in", "bytes_out", "connections", "connections_total",
                     "errors", "policy", "transports", "server_id", "uptime_s"):
            assert name in st, name
        assert st["objects"] == len(values) - 1
        assert st["bytes_used"] == sum(map(len, values)) - len(values[0])
        assert (st["hits"], st["misses"], st["puts"]) == (len(values) + 1, 2, len(values))
        assert st["connections"] == 1 and st["policy"] == "lru" and st["server_id"] == srv.address
        assert st["bytes_in"] > 300_000 and st["bytes_out"] > 300_000
        c.close()


def test_eviction_at_capacity_in_exact_lru_order():
    # evict only when a PUT finds no room (the default keeps some headroom free ahead of demand)
    with start_server(capacity="256KiB", extra_args=["--evict-watermarks", "0,0"]) as srv:
        c = connect(srv.address, timeout_s=10)
        keys = [b"block-%d" % i for i in range(8)]
        vals = [bytes([i]) * (64 * KiB) for i in range(8)]
        put(c, keys[:4], vals[:4])  # arena full: 0 1 2 3
        get(c, [keys[0]])  # 0 is now most recent: 1 2 3 0
        c.request(P.LookupRequest([keys[2]]))  # a LOOKUP hit counts too: 1 3 0 2
        put(c, [keys[4]], [vals[4]])  # evicts 1
        put(c, [keys[5]], [vals[5]])  # evicts 3
        present = c.request(P.ExistsRequest(keys[:6])).msg.present
        assert present == [True, False, True, False, True, True]
        assert stats(c)["evictions"] == 2
        assert get(c, [keys[0], keys[2], keys[4], keys[5]]) == [vals[0], vals[2], vals[4], vals[5]]


@pytest.mark.parametrize("module", ["kvfabric", "kvfabric.testing.reference"])
def test_lease_protects_from_eviction_and_full_pins_give_no_space(module):
    with start_server(capacity="128KiB", module=module, extra_args=["--evict-watermarks", "0,0"]
                      if module == "kvfabric" else []) as srv:
        c = connect(srv.address, timeout_s=10)
        a, b = b"a" * 16, b"b" * 16
        put(c, [a, b], [b"1" * 64 * KiB, b"2" * 64 * KiB])
        assert c.request(P.LookupRequest([a, b], lease_ms=60_000)).msg.count == 2
        assert put(c, [b"c"], [b"3" * 64 * KiB]) == [P.PutStatus.NO_SPACE]
        assert put(c, [b"d"], [b"4" * 200 * KiB]) == [P.PutStatus.TOO_LARGE]
        assert c.request(P.DeleteRequest([a])).msg.deleted == 1  # a lease does not block DELETE
        assert put(c, [b"c"], [b"3" * 64 * KiB]) == [P.PutStatus.STORED]
        st = stats(c)
        assert st["objects"] == 2 and st["puts"] == 3  # a, b, then c once a was deleted
        if module == "kvfabric.testing.reference":  # the reference's own extra counters
            assert (st["put_no_space"], st["put_too_large"], st["leased"]) == (1, 1, 1)


def test_parents_are_accepted():
    with start_server(capacity="1MiB") as srv:
        c = connect(srv.address, timeout_s=10)
        assert put(c, [b"k1", b"k2"], [b"x", b"y"], parents=[None, b"k1"]) == [0, 0]


def test_auth_token_required():
    with start_server(capacity="1MiB", extra_args=["--auth-token", "s3cret"]) as srv:
        # protocol 3: the client checks the server's proof first, so a wrong token (or none) is refused on
        # the client's side (AuthError, an AUTH_FAILED RemoteError) before it proves anything or sends a key
        with pytest.raises(AuthError, match="did not prove it holds the pool token") as e:
            connect(srv.address, timeout_s=10, auth_token="wrong")
        assert e.value.code == ErrorCode.AUTH_FAILED and srv.address in str(e.value)
        with pytest.raises(AuthError, match="requires a pool token") as e:
            connect(srv.address, timeout_s=10)
        assert e.value.code == ErrorCode.AUTH_FAILED
        c = connect(srv.address, timeout_s=10, auth_token="s3cret")
        assert put(c, [b"k"], [b"v"]) == [0]
        assert stats(c)["errors"].get("AUTH_FAILED", 0) == 0  # neither refused peer sent the server an AUTH


def test_auth_token_file_and_pre_auth_limits(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("from-file\n")
    with start_server(capacity="1MiB", extra_args=["--auth-token-file", str(tok)]) as srv:
        c = connect(srv.address, timeout_s=10, auth_token="from-file")
        c.request(P.PingRequest())
        c.close()
        # before authenticating, a request of any size but a tiny HELLO is refused and closed
        import socket

        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            meta = P.encode_meta({"keys": [b"k" * 16] * 400})
            s.sendall(P.pack_header(P.Op.EXISTS, 1, len(meta), 0) + meta)
            head = s.recv(P.HEADER_SIZE, socket.MSG_WAITALL)
            h = P.unpack_header(head)
            reply = P.decode_meta(s.recv(h.meta_len, socket.MSG_WAITALL))
            assert h.is_error and reply["code"] == ErrorCode.META_TOO_LARGE


def test_pool_of_three_and_kill():
    with start_pool(3, capacity="4MiB") as pool:
        assert len(set(pool.addresses)) == 3
        conns = [connect(a, timeout_s=10) for a in pool.addresses]
        for i, c in enumerate(conns):
            assert put(c, [b"k"], [b"server-%d" % i]) == [0]
        pool[1].kill()
        assert not pool[1].alive
        with pytest.raises(TransportError):
            conns[1].request(P.PingRequest())
        assert get(conns[0], [b"k"]) == [b"server-0"]
        assert get(conns[2], [b"k"]) == [b"server-2"]


@pytest.mark.parametrize("module", ["kvfabric", "kvfabric.testing.reference"])
def test_sigterm_finishes_in_flight_put_then_exits_zero(module):
    import socket

    srv = start_server(capacity="8MiB", module=module)
    try:
        data = os.urandom(1 << 20)
        meta = P.encode_meta({"keys": [b"inflight"], "sizes": [len(data)], "checksums": [P.checksum(b"inflight", data)]})
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        # the C server reserves a slot once an object's first 16 KiB are in (never on a bare header)
        s.sendall(P.pack_header(P.Op.PUT, 5, len(meta), len(data)) + meta + data[:32768])
        # wait until the server has reserved the slot (it is in the middle of the frame)
        probe = connect(srv.address, timeout_s=10)
        deadline = time.monotonic() + 10
        while stats(probe)["bytes_allocated"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stats(probe)["bytes_allocated"] > 0
        srv.popen.send_signal(signal.SIGTERM)
        s.sendall(data[32768:])
        head = s.recv(P.HEADER_SIZE, socket.MSG_WAITALL)
        h = P.unpack_header(head)
        reply = P.decode_meta(s.recv(h.meta_len, socket.MSG_WAITALL))
        assert not h.is_error and reply["status"] == [P.PutStatus.STORED]
        assert exit_status(srv) == 0, srv.stderr_text()[-4000:]
        s.close()
        probe.close()
    finally:
        srv.kill()


def test_sigint_idle_server_exits_zero():
    srv = start_server(capacity="1MiB")
    c = connect(srv.address, timeout_s=10)  # an idle connection does not block shutdown
    assert c.request(P.PutRequest([b"k"], [3], [P.checksum(b"k", b"abc")]), [b"abc"]).msg.status == [0]
    srv.popen.send_signal(signal.SIGINT)
    assert exit_status(srv) == 0, srv.stderr_text()[-4000:]
    c.close()
    # the shutdown line says what the server held and did
    assert "kvfabric serve: stopped; 1 objects, 3 bytes held; 1 puts" in srv.stderr_text()


def run_cli(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "kvfabric", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--capacity", "banana"], "--capacity banana: not a size"),
        (["--capacity", "100"], "at least 4KiB"),
        (["--policy", "nope"], "unknown --policy"),
        (["--port", "70000"], "--port"),
        (["--transports", "native-nope,tcp"], "unknown --transports"),
        (["--auth-token-file", "/nonexistent/token"], "cannot read"),
    ],
)
def test_serve_rejects_bad_options(args, needle):
    r = run_cli("serve", "--port", "0", "--capacity", "1MiB", *args)
    assert r.returncode != 0
    assert needle in r.stderr


def test_cli_dispatcher_errors():
    r = run_cli("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
    r = run_cli("bench", "no-such-bench")
    assert r.returncode == 2 and "unknown benchmark 'no-such-bench'" in r.stderr and "available:" in r.stderr
    r = run_cli("--help")
    assert r.returncode == 0 and "serve" in r.stdout
