"""Cluster membership end to end: a real etcd (kvfabric.testing.etcd), real ``kvfabric serve --etcd`` processes,
real clients following the cluster; and ownership by server id with static lists.

Nothing here waits a fixed time: every change is awaited with ``wait_for`` and a generous deadline. Tests that
need etcd skip with the reason where the binary is missing (the static-list tests run anyway).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading

import pytest

from kvfabric import Client, ClientConfig, ConfigError
from kvfabric.membership.etcd import EtcdClient
from kvfabric.tools.cluster import read_members
from kvfabric.testing.etcd import etcd  # noqa: F401  (the fixture)
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

WAIT_S = 60.0  # generous: a loaded machine must pass


def _serve(etcd_url: str, cluster: str, server_id: str, ttl: int = 10, **kw):
    return start_server(capacity="16MiB", extra_args=["--etcd", etcd_url, "--cluster", cluster,
                                                      "--etcd-ttl", str(ttl), "--server-id", server_id], **kw)


def _ids(etcd_url: str, cluster: str) -> list[str]:
    return [m.server_id for m, _ in read_members(EtcdClient(etcd_url), cluster)]


def _value(key: bytes) -> bytes:
    return key * 7 + b"|" + key[::-1]


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.kill()


def test_register_list_and_cluster_ls(etcd, servers):
    servers += [_serve(etcd.url, "ls", "alpha"), _serve(etcd.url, "ls", "beta")]
    assert wait_for(lambda: _ids(etcd.url, "ls") == ["alpha", "beta"], WAIT_S), _ids(etcd.url, "ls")
    members = dict((m.server_id, (m, ttl)) for m, ttl in read_members(EtcdClient(etcd.url), "ls"))
    for srv, sid in zip(servers, ("alpha", "beta")):
        m, ttl = members[sid]
        assert m.address == srv.address
        assert m.addresses == {"tcp": srv.address, "native": srv.address}
        assert m.capacity == 16 << 20
        assert m.info["pid"] == srv.pid
        assert 0 < ttl <= 10
    assert _ids(etcd.url, "other-cluster") == []

    out = subprocess.run([sys.executable, "-m", "kvfabric", "cluster", "ls", "--etcd", etcd.url, "--cluster", "ls"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("cluster ls: 2 member(s)")
    assert lines[1].split()[:3] == ["server_id", "address", "state"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["alpha"][1:3] == [servers[0].address, "up"]
    assert rows["beta"][1:3] == [servers[1].address, "up"]

    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "kvfabric", "cluster", "ls", "--etcd", etcd.url, "--cluster", "ls", "--json"],
        capture_output=True, text=True, timeout=120, check=True).stdout)
    assert [m["server_id"] for m in doc["members"]] == ["alpha", "beta"]
    assert all(m["stats"]["server_id"] == m["server_id"] for m in doc["members"])

    bad = subprocess.run([sys.executable, "-m", "kvfabric", "cluster", "ls", "--etcd", "http://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "etcd unreachable" in bad.stderr


def test_sigterm_leaves_before_exit_and_sigkill_leaves_at_lease_expiry(etcd, servers):
    servers += [_serve(etcd.url, "leave", "term", ttl=30), _serve(etcd.url, "leave", "crash", ttl=2)]
    assert wait_for(lambda: _ids(etcd.url, "leave") == ["crash", "term"], WAIT_S)
    assert servers[0].stop() == 0
    # the server revokes its lease before it exits: gone by the time stop() returned, long before 30 s
    assert _ids(etcd.url, "leave") == ["crash"]
    servers[1].kill()
    assert wait_for(lambda: _ids(etcd.url, "leave") == [], WAIT_S), "a SIGKILLed server stays registered"


def test_client_follows_joins_and_leaves_with_no_error_and_no_wrong_bytes(etcd, servers):
    cluster = "churn"
    servers += [_serve(etcd.url, cluster, "s1"), _serve(etcd.url, cluster, "s2")]
    cfg = ClientConfig(timeout_s=10.0, connect_timeout_s=2.0)
    client = Client(etcd=etcd.url, cluster=cluster, config=cfg)
    try:
        assert wait_for(lambda: client.members and sorted(client.members) == ["s1", "s2"], WAIT_S), client.members
        keys = [random.Random(i).randbytes(16) for i in range(300)]
        stop = threading.Event()
        errors: list[BaseException] = []
        wrong: list[bytes] = []
        rounds = [0, 0]  # rounds, hits

        def load() -> None:
            rng = random.Random(7)
            while not stop.is_set():
                try:
                    batch = rng.sample(keys, 40)
                    client.put(batch, [_value(k) for k in batch])
                    got = client.get(batch)
                    for k, v in zip(batch, got):
                        if v is not None and v != _value(k):
                            wrong.append(k)
                    rounds[1] += sum(v is not None for v in got)
                    client.lookup(batch)
                    client.exists(batch)
                    rounds[0] += 1
                except BaseException as e:  # any exception out of the client is a failure of this test
                    errors.append(e)
                    return

        t = threading.Thread(target=load, daemon=True)
        t.start()
        assert wait_for(lambda: rounds[0] >= 3, WAIT_S)

        servers.append(_serve(etcd.url, cluster, "s3"))  # join
        assert wait_for(lambda: sorted(client.members) == ["s1", "s2", "s3"], WAIT_S), client.members
        mark = rounds[0]
        assert wait_for(lambda: rounds[0] >= mark + 3, WAIT_S)

        assert servers[0].stop() == 0  # leave (SIGTERM)
        assert wait_for(lambda: sorted(client.members) == ["s2", "s3"], WAIT_S), client.members
        mark = rounds[0]
        assert wait_for(lambda: rounds[0] >= mark + 3, WAIT_S)

        servers[1].kill()  # crash: routed around once a call fails on it, leaves when its (10 s) lease expires
        mark = rounds[0]
        assert wait_for(lambda: rounds[0] >= mark + 3, WAIT_S)
        assert wait_for(lambda: client.members == ("s3",), WAIT_S), client.members

        servers.append(_serve(etcd.url, cluster, "s4"))  # join under load again
        assert wait_for(lambda: sorted(client.members) == ["s3", "s4"], WAIT_S), client.members
        mark = rounds[0]
        assert wait_for(lambda: rounds[0] >= mark + 3, WAIT_S)
        stop.set()
        t.join(WAIT_S)
        assert not errors, errors
        assert not wrong, f"{len(wrong)} wrong values"
        assert rounds[1] > 0

        # settled: every key put now is found, on the owner the client routes it to
        client.put(keys, [_value(k) for k in keys])
        assert client.get(keys) == [_value(k) for k in keys]
        routes = client.route(keys)
        by_id = {"s3": servers[2].address, "s4": servers[3].address}
        for sid, addr in by_id.items():
            mine = [k for k, r in zip(keys, routes) if r == [sid]]
            assert mine, f"{sid} owns no key"
            with Client([addr], config=ClientConfig(transport="tcp")) as direct:
                assert all(direct.exists(mine))
        # s2's lease expiry may come after s4's join: the client routed around s2 once it failed
        assert wait_for(lambda: client.stats()["client"]["membership_changes"] >= 4, WAIT_S)
        assert sorted(client.stats()["client"]["members"]) == ["s3", "s4"]
    finally:
        client.close()


def test_server_moving_address_keeps_its_keys(etcd, servers):
    servers += [_serve(etcd.url, "move", "a"), _serve(etcd.url, "move", "b")]
    with Client(etcd=etcd.url, cluster="move", config=ClientConfig(transport="tcp")) as client:
        assert wait_for(lambda: sorted(client.members) == ["a", "b"], WAIT_S)
        keys = [bytes([i, j]) * 8 for i in range(20) for j in range(20)]
        before = client.route(keys)
        old = servers[0].address
        assert servers[0].stop() == 0
        assert wait_for(lambda: client.members == ("b",), WAIT_S)
        servers.append(_serve(etcd.url, "move", "a"))  # same id, new port
        assert servers[-1].address != old
        assert wait_for(lambda: sorted(client.members) == ["a", "b"], WAIT_S)
        assert client.route(keys) == before
        assert client.stats()["client"]["shards"][servers[-1].address]["route_id"] == "a"
        client.put(keys, [_value(k) for k in keys])
        assert client.get(keys) == [_value(k) for k in keys]


def test_client_from_env_and_bad_configs(etcd, servers):
    servers.append(_serve(etcd.url, "env", "only"))
    assert wait_for(lambda: _ids(etcd.url, "env") == ["only"], WAIT_S)
    cfg = ClientConfig.from_env({"KVFABRIC_ETCD": etcd.url, "KVFABRIC_CLUSTER": "env"}, transport="tcp")
    assert (cfg.etcd, cfg.cluster) == (etcd.url, "env")
    with Client(config=cfg) as client:
        assert wait_for(lambda: client.members == ("only",), WAIT_S)
        assert client.put([b"k" * 16], [b"v"]).stored == 1
        assert client.get([b"k" * 16]) == [b"v"]
    with pytest.raises(ConfigError):
        Client([servers[0].address], etcd=etcd.url, cluster="env")
    with pytest.raises(ConfigError):
        ClientConfig(etcd=etcd.url, cluster="no/slash")
    with pytest.raises(ConfigError):
        ClientConfig.from_env({"KVFABRIC_CLUSTER": ""})


def test_client_with_unreachable_etcd_misses_without_raising():
    # no etcd binary needed: nothing listens on port 1
    with Client(etcd="http://127.0.0.1:1", cluster="x", config=ClientConfig(timeout_s=1.0)) as client:
        assert client.members == ()
        keys = [b"a" * 16, b"b" * 16]
        assert client.get(keys) == [None, None]
        assert client.lookup(keys) == 0
        assert client.exists(keys) == [False, False]
        assert client.put(keys, [b"1", b"2"]).dropped == 2
        assert client.delete(keys) == 0


@pytest.mark.parametrize("explicit_ids", [False, True], ids=["default-ids", "server-ids"])
def test_order_and_spelling_do_not_change_ownership(explicit_ids, servers):
    names = ["alpha", "beta", "gamma"]
    for n in names:
        servers.append(start_server(capacity="16MiB", extra_args=["--server-id", n] if explicit_ids else []))
    spelled_a = [s.address for s in servers]
    spelled_b = [f"localhost:{s.port}" for s in reversed(servers)]
    cfg = ClientConfig(transport="tcp", timeout_s=10.0, connect_timeout_s=5.0)
    keys = [random.Random(i).randbytes(16) for i in range(2000)]
    with Client(spelled_a, config=cfg) as a, Client(spelled_b, config=cfg) as b:
        want = sorted(names) if explicit_ids else sorted(spelled_a)
        assert wait_for(lambda: sorted(a.members) == want and sorted(b.members) == want, WAIT_S), (a.members, b.members)
        assert a.route(keys) == b.route(keys)
        a.put(keys, [_value(k) for k in keys])
        assert b.get(keys) == [_value(k) for k in keys]  # every key where b looks for it
        assert b.stats()["client"]["shards"][spelled_b[0]]["route_id"] == (names[-1] if explicit_ids else spelled_a[-1])


def test_two_entries_for_one_server_are_one_shard(servers):
    servers.append(start_server(capacity="16MiB", extra_args=["--server-id", "solo"]))
    cfg = ClientConfig(transport="tcp", timeout_s=10.0)
    with Client([servers[0].address, f"localhost:{servers[0].port}"], config=cfg) as c:
        assert wait_for(lambda: c.members == ("solo",), WAIT_S), c.members
        keys = [bytes([i]) * 16 for i in range(1, 100)]
        assert c.put(keys, [_value(k) for k in keys]).stored == len(keys)
        assert c.get(keys) == [_value(k) for k in keys]
        assert c.delete(keys) == len(keys)  # each object removed once: one shard, not two


def test_replicas_2_lose_no_hit_when_a_server_dies(etcd, servers):
    servers += [_serve(etcd.url, "rep", f"r{i}", ttl=2) for i in range(3)]
    cfg = ClientConfig(transport="tcp", replicas=2, timeout_s=10.0, connect_timeout_s=2.0)
    with Client(etcd=etcd.url, cluster="rep", config=cfg) as client:
        assert wait_for(lambda: sorted(client.members) == ["r0", "r1", "r2"], WAIT_S)
        keys = [random.Random(50 + i).randbytes(16) for i in range(300)]
        res = client.put(keys, [_value(k) for k in keys])
        assert res.stored == len(keys) and client.stats()["client"]["replica_puts_dropped"] == 0
        servers[0].kill()
        # whether its lease has expired yet or not: a dead owner fails (or is gone) and the other replica answers
        assert client.get(keys) == [_value(k) for k in keys]
        assert wait_for(lambda: "r0" not in client.members, WAIT_S)
        # re-routed over the two left: every key has one copy among them, found at rank 1 or 2
        assert client.get(keys) == [_value(k) for k in keys]
        assert client.lookup(keys) == len(keys)


def test_etcd_outage_keeps_the_last_members_and_changes_arrive_after_it(servers):
    from kvfabric.testing.etcd import MISSING_REASON, etcd_binary, start_etcd

    if etcd_binary() is None:
        pytest.skip(MISSING_REASON)
    with start_etcd() as own:  # its own etcd: this test stops it
        servers += [_serve(own.url, "outage", "o1", ttl=5), _serve(own.url, "outage", "o2", ttl=5)]
        with Client(etcd=own.url, cluster="outage", config=ClientConfig(transport="tcp", timeout_s=10.0)) as client:
            assert wait_for(lambda: sorted(client.members) == ["o1", "o2"], WAIT_S)
            keys = [bytes([i]) * 16 for i in range(1, 120)]
            client.put(keys, [_value(k) for k in keys])
            own.outage()
            # etcd down: the client keeps routing over the last members it saw; the servers keep serving
            assert sorted(client.members) == ["o1", "o2"]
            assert client.get(keys) == [_value(k) for k in keys]
            own.resume()
            # back: the servers' leases are refreshed (or re-registered), and a join is seen again
            servers.append(_serve(own.url, "outage", "o3", ttl=5))
            assert wait_for(lambda: sorted(client.members) == ["o1", "o2", "o3"], WAIT_S), client.members
            assert wait_for(lambda: _ids(own.url, "outage") == ["o1", "o2", "o3"], WAIT_S)
            client.put(keys, [_value(k) for k in keys])
            assert client.get(keys) == [_value(k) for k in keys]


def test_serve_membership_options(servers):
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvfabric", "serve", "--port", "0", "--capacity", "16MiB", *args],
                              capture_output=True, text=True, timeout=120)

    bad = serve("--etcd", "http://127.0.0.1:1", "--cluster", "a/b")
    assert bad.returncode == 2 and "cluster name" in bad.stderr
    bad = serve("--host", "0.0.0.0", "--etcd", "http://127.0.0.1:1")
    assert bad.returncode == 2 and "--advertise" in bad.stderr
    bad = serve("--etcd", "ftp://root:s3cr@127.0.0.1:1")
    assert bad.returncode == 2 and "https://" in bad.stderr and "root:***@" in bad.stderr, bad.stderr
    assert "s3cr" not in bad.stderr + bad.stdout
    bad = serve("--etcd", "https://127.0.0.1:1", "--etcd-ca", "/nonexistent/ca.pem")
    assert bad.returncode == 2 and "CA file" in bad.stderr, bad.stderr
    bad = serve("--etcd-ca", "/nonexistent/ca.pem")
    assert bad.returncode == 2 and "need --etcd" in bad.stderr, bad.stderr
    bad = serve("--etcd", "http://127.0.0.1:1", "--etcd-ttl", "0")
    assert bad.returncode == 2 and "--etcd-ttl" in bad.stderr
    # an unreachable etcd does not stop a server: it serves and keeps trying to register
    srv = start_server(capacity="16MiB", extra_args=["--etcd", "http://127.0.0.1:1", "--log-level", "warning"])
    servers.append(srv)
    with Client([srv.address], config=ClientConfig(transport="tcp")) as c:
        assert c.put([b"k" * 16], [b"v"]).stored == 1
    assert "cannot register" in srv.stderr_text()
    assert srv.stop() == 0
