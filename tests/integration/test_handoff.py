"""Hand-off and read-repair (kvfabric/membership/handoff.py) with real servers on loopback.

The members are set by the test (``ManualMembership``): the same path as etcd's
watch delivering a join, a leave or a replacement, without etcd. No timed
assertion: background repairs are awaited with ``wait_for`` and a generous deadline.
"""

from __future__ import annotations

import random
import signal

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.membership import ManualMembership, Member
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

WAIT_S = 60.0


def _value(key: bytes) -> bytes:
    return key * 8 + key[::-1]


def _member(sid: str, srv) -> Member:
    return Member(sid, srv.address)


@pytest.fixture()
def servers():
    procs = {}

    def start(sid: str):
        procs[sid] = start_server(capacity="16MiB", extra_args=["--server-id", sid])
        return procs[sid]

    start.procs = procs
    yield start
    for p in procs.values():
        p.popen.send_signal(signal.SIGCONT)
        p.kill()


def _holds(address: str, keys: list[bytes]) -> list[bool]:
    with Client([address], config=ClientConfig(transport="tcp", handoff_s=0)) as c:
        return c.exists(keys)


@pytest.mark.parametrize("handoff_s", [30.0, 0.0], ids=["handoff", "no-handoff"])
def test_join_keys_moved_to_the_new_server_are_found_and_repaired(servers, handoff_s):
    base = [_member(f"s{i}", servers(f"s{i}")) for i in range(3)]
    joiner = _member("s3", servers("s3"))
    members = ManualMembership(base)
    keys = [random.Random(i).randbytes(16) for i in range(1200)]
    cfg = ClientConfig(transport="tcp", handoff_s=handoff_s, timeout_s=5.0)
    with Client(membership=members, config=cfg) as client:
        assert client.put(keys, [_value(k) for k in keys]).dropped == 0
        members.set(base + [joiner])
        moved = [k for k, owners in zip(keys, client.route(keys)) if owners == ["s3"]]
        assert 200 <= len(moved) <= 400  # ~1/4 of the keys move to the new server
        got = client.get(keys)
        assert all(v is None or v == _value(k) for k, v in zip(keys, got))  # never wrong bytes
        found = sum(v is not None for v in got)
        stats = client.stats()["client"]
        if handoff_s:
            assert found == len(keys)  # the moved keys came from their previous owner
            assert stats["handoff_hits"] == len(moved)
            # ...and were re-put to the new owner in the background
            assert wait_for(lambda: all(_holds(joiner.address, moved)), WAIT_S)
            assert wait_for(lambda: client.stats()["client"]["handoff_repairs"] == len(moved), WAIT_S)
        else:
            assert found == len(keys) - len(moved)  # the cost without hand-off
            assert stats["handoff_hits"] == 0 and not any(_holds(joiner.address, moved))


def test_lookup_extends_over_previous_owners_and_copies_to_the_new_one(servers):
    base = [_member(f"s{i}", servers(f"s{i}")) for i in range(3)]
    joiner = _member("s3", servers("s3"))
    members = ManualMembership(base)
    prompt = [random.Random(50_000 + i).randbytes(16) for i in range(64)]
    with Client(membership=members, config=ClientConfig(transport="tcp", timeout_s=5.0)) as client:
        client.put(prompt, [_value(k) for k in prompt])
        members.set(base + [joiner])
        moved = [k for k, owners in zip(prompt, client.route(prompt)) if owners == ["s3"]]
        assert moved
        assert client.lookup(prompt) == len(prompt)
        assert client.stats()["client"]["handoff_hits"] == len(moved)
        assert wait_for(lambda: all(_holds(joiner.address, moved)), WAIT_S)
        # the new owner holds them now: a lookup needs no previous owner any more
        assert client.lookup(prompt) == len(prompt)
        assert client.stats()["client"]["handoff_hits"] == len(moved)
        assert client.get(prompt) == [_value(k) for k in prompt]


def test_a_server_that_left_is_not_asked_and_nothing_raises(servers):
    base = [_member(f"s{i}", servers(f"s{i}")) for i in range(3)]
    members = ManualMembership(base)
    keys = [random.Random(70_000 + i).randbytes(16) for i in range(600)]
    with Client(membership=members, config=ClientConfig(transport="tcp", timeout_s=5.0)) as client:
        client.put(keys, [_value(k) for k in keys])
        gone = [k for k, owners in zip(keys, client.route(keys)) if owners == ["s2"]]
        members.set(base[:2])  # s2 leaves (its shard is retired): its keys are misses, not errors
        got = client.get(keys)
        assert sum(v is None for v in got) == len(gone)
        assert all(v is None or v == _value(k) for k, v in zip(keys, got))
        assert client.lookup(keys) <= len(keys)
        assert client.stats()["client"]["handoff_hits"] == 0


def test_replicas_2_a_replacing_server_is_refilled_by_read_repair(servers):
    base = [_member(f"r{i}", servers(f"r{i}")) for i in range(3)]
    members = ManualMembership(base)
    keys = [random.Random(90_000 + i).randbytes(16) for i in range(900)]
    cfg = ClientConfig(transport="tcp", replicas=2, timeout_s=5.0)
    with Client(membership=members, config=cfg) as client:
        assert client.put(keys, [_value(k) for k in keys]).dropped == 0
        on_r1 = [k for k, owners in zip(keys, client.route(keys)) if "r1" in owners]
        # r1's machine is replaced: a new, empty server with the same id at another address
        servers_r1 = servers("r1")
        members.set([base[0], Member("r1", servers_r1.address), base[2]])
        assert wait_for(lambda: client.stats()["client"]["shards"][servers_r1.address]["server_id"] == "r1", WAIT_S)
        assert not any(_holds(servers_r1.address, on_r1))
        assert client.get(keys) == [_value(k) for k in keys]  # the other replica answers: no hit lost
        assert wait_for(lambda: all(_holds(servers_r1.address, on_r1)), WAIT_S)  # read-repair refilled it
        assert wait_for(lambda: client.stats()["client"]["read_repairs"] == len(on_r1), WAIT_S)


def test_a_hung_server_is_routed_around_and_its_keys_handed_back(servers):
    """SIGSTOP (a server that stops answering, like a partition shorter than a lease): a dynamic
    membership's client routes around it once a call fails there; what it puts meanwhile goes to the
    next server, and after SIGCONT those keys are found through hand-off and re-put to it."""
    base = [_member(f"s{i}", servers(f"s{i}")) for i in range(3)]
    hung = servers.procs["s2"]
    members = ManualMembership(base)
    cfg = ClientConfig(transport="tcp", timeout_s=1.0, connect_timeout_s=0.5)
    with Client(membership=members, config=cfg) as client:
        probe = [random.Random(110_000 + i).randbytes(16) for i in range(200)]
        client.put(probe, [_value(k) for k in probe])
        with hung.paused():
            assert wait_for(lambda: client.get(probe) is not None and "s2" not in client.members, WAIT_S)
            fresh = [random.Random(120_000 + i).randbytes(16) for i in range(600)]
            assert client.put(fresh, [_value(k) for k in fresh]).dropped == 0  # all stored on s0 / s1
            assert client.get(fresh) == [_value(k) for k in fresh]
        assert wait_for(lambda: "s2" in client.members, WAIT_S), client.members
        back = [k for k, owners in zip(fresh, client.route(fresh)) if owners == ["s2"]]
        assert back
        assert client.get(fresh) == [_value(k) for k in fresh]  # s2's share came from where it was put
        assert client.stats()["client"]["handoff_hits"] >= len(back)
        assert wait_for(lambda: all(_holds(base[2].address, back)), WAIT_S)


def test_exists_asks_the_previous_owner_and_copies(servers):
    base = [_member(f"s{i}", servers(f"s{i}")) for i in range(3)]
    joiner = _member("s3", servers("s3"))
    members = ManualMembership(base)
    keys = [random.Random(130_000 + i).randbytes(16) for i in range(400)]
    absent = [random.Random(140_000 + i).randbytes(16) for i in range(50)]
    with Client(membership=members, config=ClientConfig(transport="tcp", timeout_s=5.0)) as client:
        client.put(keys, [_value(k) for k in keys])
        members.set(base + [joiner])
        moved = [k for k, owners in zip(keys, client.route(keys)) if owners == ["s3"]]
        assert moved
        assert client.exists(keys + absent) == [True] * len(keys) + [False] * len(absent)
        assert client.stats()["client"]["handoff_hits"] == len(moved)
        assert wait_for(lambda: all(_holds(joiner.address, moved)), WAIT_S)
