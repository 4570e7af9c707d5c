"""Membership that cannot be forged (issue 22, part 2), against a real etcd and real ``kvfabric serve --etcd``.

* With a pool token, a forged member entry (pool-a's key overwritten with an attacker's address, unsigned or
  signed with another token; a new fake member id; a real record moved under another id's key) gets no
  connection and no byte: the attacker is a socket server here that records everything it receives. The real
  servers' keys stay readable and new PUTs land on them; the refused entries are counted and logged once.
* A server whose key is overwritten (no lease) or deleted puts its record back and logs an ERROR naming what
  it found; a client without a token, which follows the forged entry meanwhile, routes back to the real server.
* A server whose HELLO id differs from its verified record's id takes no keys (counted, logged).
* Two servers started with one ``--server-id`` take turns at the key under the guard's doubling back-off:
  their etcd writes over a run are counted and held against the most that back-off allows in the time
  the run took (a bound a slower machine only makes looser), never a hot loop.

Nothing waits a fixed time: every change is awaited with ``wait_for`` and a generous deadline.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.membership import Member
from kvfabric.membership.etcd import EtcdClient
from kvfabric.membership.registry import Registration, encode_member, member_key, read_member
from kvfabric.testing.etcd import etcd  # noqa: F401  (the fixture)
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import ServerPool, start_server

WAIT_S = 60.0  # generous: a loaded machine must pass
TOKEN = "pool-secret-7f3a"


class Recorder:
    """An attacker's server: accepts every connection and records every byte it receives."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.connections = 0
        self.data = bytearray()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            with self._lock:
                self.data += chunk

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for c in self._conns:
                c.close()
        self._thread.join(5)

    def __repr__(self) -> str:
        return f"<Recorder {self.address}: {self.connections} connections, {len(self.data)} bytes: {bytes(self.data[:80])!r}>"


def _serve(etcd_url: str, cluster: str, server_id: str, token: str | None = TOKEN, ttl: int = 10):
    args = ["--etcd", etcd_url, "--cluster", cluster, "--etcd-ttl", str(ttl), "--server-id", server_id]
    if token:
        args += ["--auth-token", token]
    return start_server(capacity="16MiB", extra_args=args)


def _forged(server_id: str, address: str, token: str | None = None, lease: int = 0, **info) -> bytes:
    return encode_member(Member(server_id, address, {"tcp": address, "native": address}, 16 << 20,
                                dict({"pid": 1, "lease": lease}, **info)), token)


def _record(admin: EtcdClient, cluster: str, server_id: str):
    kvs, _ = admin.range(member_key(cluster, server_id))
    return kvs[0] if kvs else None


def _values(keys):
    return [k * 4 + b"|real" for k in keys]


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


@pytest.fixture
def servers():
    with ServerPool() as pool:  # stopped after the test, pass or fail
        yield pool


def test_forged_member_entries_get_no_byte_and_real_keys_stay_readable(etcd, servers, recorder, caplog):
    cluster = "forge"
    servers += [_serve(etcd.url, cluster, "pool-a"), _serve(etcd.url, cluster, "pool-b")]
    admin = EtcdClient(etcd.url)
    cfg = ClientConfig(auth_token=TOKEN, timeout_s=10.0, connect_timeout_s=5.0)
    caplog.set_level(logging.WARNING, logger="kvfabric")
    with Client(etcd=etcd.url, cluster=cluster, config=cfg) as client:
        assert wait_for(lambda: sorted(client.members) == ["pool-a", "pool-b"], WAIT_S), client.members
        keys = [b"k%05d" % i + bytes(10) for i in range(400)]
        assert client.put(keys, _values(keys)).stored == len(keys)
        real_a = _record(admin, cluster, "pool-a")

        # the attacks: every one a write anyone who reaches this etcd can make
        admin.put(member_key(cluster, "pool-a"), _forged("pool-a", recorder.address))  # unsigned, no lease
        admin.put(member_key(cluster, "pool-x"), _forged("pool-x", recorder.address))  # a new fake member
        admin.put(member_key(cluster, "pool-y"), _forged("pool-y", recorder.address, token="guessed-token"))
        # a real, signed record copied under another id's key: still refused (the id must be the key's)
        admin.put(member_key(cluster, "pool-z"), real_a.value, lease=real_a.lease)
        refused = lambda: client.stats()["client"]["member_records_refused"]  # noqa: E731
        assert wait_for(lambda: refused() >= 4, WAIT_S), (refused(), caplog.text[-3000:])

        # the real server takes its key back (signed, under its lease): the client never left it
        assert wait_for(lambda: read_member(member_key(cluster, "pool-a"), _record(admin, cluster, "pool-a").value,
                                            TOKEN, _record(admin, cluster, "pool-a").lease)[0], WAIT_S), \
            _record(admin, cluster, "pool-a")
        assert "our member key" in servers[0].stderr_text() and recorder.address in servers[0].stderr_text(), \
            servers[0].stderr_text()[-3000:]

        # reads and writes after the attacks: all on the real servers
        assert client.get(keys) == _values(keys)
        more = [b"m%05d" % i + bytes(10) for i in range(400)]
        put = client.put(more, _values(more))
        assert (put.stored, put.dropped) == (len(more), 0), put
        assert client.get(more) == _values(more)
        st = client.stats()["client"]
        assert sorted(client.members) == ["pool-a", "pool-b"], client.members
        assert set(st["shards"]) == {s.address for s in servers}, st["shards"]
        assert st["hits"] == len(keys) + len(more) and st["misses"] == 0, st

    # the attacker saw nothing: no connection, no byte, so not the token either
    assert (recorder.connections, bytes(recorder.data)) == (0, b""), recorder
    assert TOKEN.encode() not in bytes(recorder.data)
    # each refused record logged once, with its key
    for sid in ("pool-x", "pool-y", "pool-z"):
        lines = [r.getMessage() for r in caplog.records if f"/members/{sid} " in r.getMessage()]
        assert len(lines) == 1, (sid, lines)
    assert st["member_records_refused"] >= 4  # the overwrite of pool-a (>= 1) + x, y, z
    # a client that starts now reads the forged entries in its first range read: refused the same way
    with Client(etcd=etcd.url, cluster=cluster, config=cfg) as late:
        assert late.stats()["client"]["member_records_refused"] >= 3  # x, y, z (pool-a is real again)
        assert sorted(late.members) == ["pool-a", "pool-b"], late.members
        assert late.get(keys) == _values(keys)
    assert (recorder.connections, bytes(recorder.data)) == (0, b""), recorder


def test_a_hijacked_key_is_put_back_and_a_client_routes_back(etcd, servers, recorder, caplog):
    cluster = "hijack"
    servers += [_serve(etcd.url, cluster, "pool-a", token=None), _serve(etcd.url, cluster, "pool-b", token=None)]
    admin = EtcdClient(etcd.url)
    real = {s.address for s in servers}
    caplog.set_level(logging.WARNING, logger="kvfabric")
    with Client(etcd=etcd.url, cluster=cluster, config=ClientConfig(timeout_s=10.0, connect_timeout_s=5.0)) as client:
        assert "any entry is trusted" in caplog.text, caplog.text[-2000:]  # no token: said once, at start
        routed = lambda: {a for a, s in client.stats()["client"]["shards"].items() if s["routed"]}  # noqa: E731
        assert wait_for(lambda: sorted(client.members) == ["pool-a", "pool-b"] and routed() == real, WAIT_S), \
            client.stats()["client"]["shards"]
        keys = [b"h%05d" % i + bytes(10) for i in range(200)]
        assert client.put(keys, _values(keys)).stored == len(keys)
        key = member_key(cluster, "pool-a")
        original = _record(admin, cluster, "pool-a")

        for attack in ("overwrite", "delete"):
            if attack == "overwrite":
                admin.put(key, _forged("pool-a", recorder.address))  # no lease, attacker's address
            else:
                admin.delete(key)

            def restored():
                kv = _record(admin, cluster, "pool-a")
                return kv is not None and kv.lease == original.lease and json.loads(kv.value)["addresses"]["tcp"] \
                    == servers[0].address and kv.mod_revision > original.mod_revision and kv

            kv = wait_for(restored, WAIT_S)
            assert kv, (attack, _record(admin, cluster, "pool-a"), servers[0].stderr_text()[-2000:])
            original = kv
            assert wait_for(lambda: routed() == real and sorted(client.members) == ["pool-a", "pool-b"], WAIT_S), \
                (attack, client.stats()["client"]["shards"])
            assert client.get(keys) == _values(keys), attack
        log = servers[0].stderr_text()
        assert "ERROR" in log and "overwritten with" in log and recorder.address in log and "mod_revision" in log, log
        assert "was deleted at mod_revision" in log, log[-3000:]
    assert "ERROR" not in servers[1].stderr_text()


def test_a_server_whose_hello_id_differs_from_its_verified_record_takes_no_keys(etcd, servers, caplog):
    cluster = "impostor"
    servers += [_serve(etcd.url, cluster, "pool-a"), _serve(etcd.url, cluster, "pool-b")]
    # a server that holds the token but is not pool-c: a record signed for pool-c names its address
    other = start_server(capacity="16MiB", extra_args=["--auth-token", TOKEN, "--server-id", "pool-q"])
    servers.append(other)
    admin = EtcdClient(etcd.url)
    lease = admin.lease_grant(60)
    admin.put(member_key(cluster, "pool-c"), _forged("pool-c", other.address, token=TOKEN, lease=lease), lease=lease)
    caplog.set_level(logging.ERROR, logger="kvfabric")
    cfg = ClientConfig(auth_token=TOKEN, timeout_s=10.0, connect_timeout_s=5.0)
    with Client(etcd=etcd.url, cluster=cluster, config=cfg) as client:
        mismatches = lambda: client.stats()["client"]["member_id_mismatches"]  # noqa: E731
        assert wait_for(lambda: mismatches() >= 1 and sorted(client.members) == ["pool-a", "pool-b"], WAIT_S), \
            (mismatches(), client.members, client.stats()["client"]["shards"])
        keys = [b"q%05d" % i + bytes(10) for i in range(300)]
        assert "pool-c" not in {o for row in client.route(keys) for o in row}
        assert "pool-q" not in {o for row in client.route(keys) for o in row}
        assert client.put(keys, _values(keys)).stored == len(keys)
        assert client.get(keys) == _values(keys)
    assert "answered HELLO as server 'pool-q'" in caplog.text and other.address in caplog.text, caplog.text
    with Client([other.address], config=ClientConfig(auth_token=TOKEN, timeout_s=10.0, connect_timeout_s=5.0)) as c:
        st = c.stats()["servers"][other.address]
    assert (st["puts"], st["hits"] + st["misses"], st["objects"]) == (0, 0, 0), st
    admin.lease_revoke(lease)


def _put_backs_at_most(seconds: float) -> int:
    """The most put-backs one server's key guard makes in ``seconds`` (kvfabric/membership/registry.py
    ``Registration``): the guard puts back one at a time, and the k-th of a run of hijacks each within
    REPEAT_S of the last waits ``min(0.05 * 2 ** (k - 2), MAX_DELAY_S)`` first (the first none); a run
    starts afresh only after REPEAT_S without a hijack, so at most ``1 + seconds // REPEAT_S`` runs fit."""
    delays, waited = [0.0], 0.0
    while True:
        nxt = min(max(delays[-1] * 2, 0.05), Registration.MAX_DELAY_S)
        if waited + nxt > seconds:
            break
        waited += nxt
        delays.append(nxt)
    return len(delays) * (1 + int(seconds // Registration.REPEAT_S))


def test_two_servers_with_one_id_take_turns_under_the_back_off_not_a_hot_loop(etcd, servers):
    """Two servers claim one id (an operator error): each sees the other's record as a hijack and puts its
    own back. The guard's back-off doubles the wait each time, so 16 writes take seconds; without it the
    two rewrite etcd as fast as it answers (hundreds a second). Counted from etcd's own history: every
    write to the key after the first server registered, up to the revision read when the 16th was seen,
    against what the back-off allows in the wall time that took. No timing is asserted: a slower
    machine takes longer and so is allowed more, while a hot loop exceeds the bound at any speed."""
    cluster, sid = "twins", "pool-twin"
    admin = EtcdClient(etcd.url)
    key = member_key(cluster, sid)
    servers.append(_serve(etcd.url, cluster, sid, ttl=30))   # a long lease: no re-registration in the run
    assert wait_for(lambda: _record(admin, cluster, sid), WAIT_S)
    rev0 = admin.range(key)[1]
    t0 = time.monotonic()
    servers.append(_serve(etcd.url, cluster, sid, ttl=30))
    target = 16
    assert wait_for(lambda: admin.range(key)[1] - rev0 >= target, 300, 0.05), \
        (admin.range(key)[1] - rev0, servers[0].stderr_text()[-2000:], servers[1].stderr_text()[-2000:])
    rev_end = admin.range(key)[1]
    elapsed = time.monotonic() - t0
    history: list = []
    stop = threading.Event()
    for events in admin.watch(key, None, rev0 + 1, stop, idle_timeout_s=30.0):
        history += events
        if history[-1].mod_revision >= rev_end:
            break
    stop.set()
    writes = [e for e in history if e.kind == "PUT" and e.mod_revision <= rev_end]
    by = {s.address: 0 for s in servers}
    for e in writes:
        by[json.loads(e.value)["addresses"]["tcp"]] += 1
    # per server: its put-backs + its registration + one re-registration (a lease lost to a stall)
    bound = 2 * (_put_backs_at_most(elapsed) + 2)
    assert len(writes) == rev_end - rev0 >= target, (len(writes), rev_end - rev0)
    assert len(writes) <= bound, (f"{len(writes)} writes of {key!r} in {elapsed:.2f} s: the back-off allows at "
                                  f"most {bound}", by)
    assert all(n >= 4 for n in by.values()), f"both servers take turns: {by}"
    # turns, not a tie: no server writes twice in a row (each put-back answers the other's write)
    owners = [json.loads(e.value)["addresses"]["tcp"] for e in writes]
    assert all(a != b for a, b in zip(owners, owners[1:])), owners
    for srv in servers:
        assert "our member key" in srv.stderr_text(), srv.stderr_text()[-2000:]
