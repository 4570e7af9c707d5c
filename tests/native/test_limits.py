"""The native server's connection limits, as the Python server has them.

- ``--max-connections``: a peer over the bound gets one BUSY error frame
  (request id 0, byte for byte what protocol.encode_error makes) and is
  closed; the held connections are untouched and a freed slot is reused.
- ``--min-rate``: a frame of S bytes must arrive within ``stall_timeout +
  S / min_rate`` of its header, even when every single receive completes well
  inside the stall timeout (a slowloris trickle): the peer is dropped, its
  reserved slots freed, and STATS counts it in ``slow_connections``.
"""

import time

import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, RemoteError
from kvfabric.transport import tcp
from kvfabric.testing import wait_for


def _try_connect(address):
    try:
        return tcp.connect(address, timeout_s=5.0)
    except RemoteError:
        return None


def test_a_connection_over_the_bound_gets_busy_then_a_freed_slot_is_reused(make_server, open_raw):
    srv = make_server(max_connections=2)
    held = [tcp.connect(srv.address, timeout_s=5.0) for _ in range(2)]  # HELLO answered: both counted
    try:
        # raw socket: exactly the Python server's BUSY frame, then EOF
        r = open_raw(srv.address)
        frame = r.recv_frame()
        assert frame == p.encode_error(0, 0, ErrorCode.BUSY, "too many connections (max 2)")
        assert r.closed_by_peer()
        # through a transport: RemoteError(BUSY), every time, none counted against the bound
        for _ in range(2):
            with pytest.raises(RemoteError) as info:
                tcp.connect(srv.address, timeout_s=5.0)
            assert info.value.code == ErrorCode.BUSY
            assert "too many connections" in str(info.value)
        st = held[0].request(p.StatsRequest()).msg.stats  # STATS on the wire
        assert st["connections"] == 2
        assert st["connections_refused"] >= 3
        assert st["errors"].get("BUSY", 0) >= 3
        assert srv.stats()["connections_refused"] == st["connections_refused"]  # in-process view agrees
        # the held connections still work
        for c in held:
            assert isinstance(c.request(p.PingRequest()).msg, p.PingReply)
        # free one slot: a new connection is accepted (the server sees the close asynchronously)
        held.pop().close()
        fresh = []
        assert wait_for(lambda: bool(fresh) or fresh.extend(filter(None, [_try_connect(srv.address)])) or bool(fresh))
        held += fresh
        assert isinstance(held[-1].request(p.PingRequest()).msg, p.PingReply)
    finally:
        for c in held:
            c.close()


def test_a_trickling_put_is_dropped_at_the_min_rate_bound_while_a_normal_put_works(make_server, open_raw):
    # 256 objects of 2 KiB = 512 KiB at >= 512 KiB/s: the rate bound is 5 s (the stall
    # timeout) + 1 s from the header. One object every 100 ms completes each receive far
    # inside the 5 s stall timeout, so only the rate bound can drop it; the whole trickle
    # would take >= 25.6 s, so it cannot finish first. Nothing here depends on how fast
    # the machine is: a loaded machine only sleeps longer between objects (slower still),
    # and only a single gap of 5 s between two objects could turn this into a stall.
    srv = make_server(stall_timeout_s=5.0, min_rate=512 * 1024)
    free = srv.stats()["free_bytes"]
    n, size = 256, 2048
    keys = [b"slow%03d" % i for i in range(n)]
    values = [bytes([i % 251]) * size for i in range(n)]
    msg = p.PutRequest(keys=keys, sizes=[size] * n, checksums=[p.checksum(k, v) for k, v in zip(keys, values)])
    r = open_raw(srv.address)
    r.send(p.encode_request(msg, 1))
    start = time.monotonic()
    sent, gaps = 0, []
    dropped = False
    for v in values:
        t = time.monotonic()
        try:
            r.send(v)
        except OSError:  # reset by the server
            dropped = True
            break
        sent += 1
        time.sleep(0.1)
        gaps.append(time.monotonic() - t)
    trickle = (f"sent {sent} of {n} objects in {time.monotonic() - start:.1f} s, "
               f"longest gap {max(gaps, default=0):.2f} s")
    assert dropped or r.closed_by_peer(), f"the server never dropped the trickling PUT: {trickle}"
    c = tcp.connect(srv.address, timeout_s=5.0)
    try:
        st = c.request(p.StatsRequest()).msg.stats
        assert (st["slow_connections"], st["stalled_connections"]) == (1, 0), (
            f"slow_connections={st['slow_connections']} stalled_connections={st['stalled_connections']} "
            f"(want 1, 0); {trickle}; stats: {st}")
        assert (srv.stats()["slow_connections"], srv.stats()["stalled_connections"]) == (1, 0), srv.stats()
        # objects that landed before the drop are stored; the half-received one is not
        assert st["objects"] < n and st["pinned"] == 0, f"objects={st['objects']} pinned={st['pinned']}; {st}"
        # one page each, nothing left reserved
        assert srv.stats()["free_bytes"] == free - st["objects"] * 4096, (free, st["objects"], srv.stats())
        # a normal PUT (1 MiB, well above the rate) and GET on the same server
        val = b"n" * (1 << 20)
        assert c.request(p.PutRequest([b"normal"], [len(val)], [p.checksum(b"normal", val)]), [val]).msg.status == [0]
        buf = bytearray(len(val))
        assert c.request(p.GetRequest([b"normal"]), recv_buffers=[buf]).msg.sizes == [len(val)]
        assert bytes(buf) == val
    finally:
        c.close()


def test_min_rate_must_be_positive(make_server, capsys):
    from kvfabric.errors import ConfigError
    from kvfabric.server import main

    with pytest.raises(ConfigError):
        make_server(min_rate=0)
    # the CLI flag: `kvfabric serve` says why and exits 2 before opening anything
    assert main.main(["serve", "--port", "0", "--capacity", "1MiB", "--min-rate", "0"]) == 2
    assert "--min-rate" in capsys.readouterr().err
