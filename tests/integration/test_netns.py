"""Multi-host membership on one machine: pool servers in their own network namespaces (kvfabric.testing.netns),
etcd and the client in the caller's namespace, reached over a private bridge; partitions, crashes, restarts and
joins under load. Needs root, ``ip`` and the etcd binary; skipped with the reason otherwise. No fixed waits:
every change is awaited with ``wait_for`` and a generous deadline.
"""

from __future__ import annotations

import random
import threading

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.testing.etcd import MISSING_REASON, etcd_binary, start_etcd
from kvfabric.testing.netns import NetLab, missing_reason, start_server_in
from kvfabric.testing.poll import wait_for

WAIT_S = 90.0


@pytest.fixture(scope="module")
def lab():
    why = missing_reason()
    if why:
        pytest.skip(why)
    if etcd_binary() is None:
        pytest.skip(MISSING_REASON)
    with NetLab(5) as lab:
        yield lab


def _value(key: bytes) -> bytes:
    return key[::-1] * 5 + key


def test_partition_crash_restart_and_join_under_load(lab):
    with start_etcd(host=lab.bridge_ip) as etcd:
        servers: dict[int, object] = {}

        def serve(i: int):
            servers[i] = start_server_in(lab, i, ["--etcd", etcd.url, "--cluster", "ns", "--etcd-ttl", "2",
                                                  "--server-id", f"host{i}"])

        try:
            for i in range(4):
                serve(i)
            cfg = ClientConfig(transport="tcp", timeout_s=2.0, connect_timeout_s=0.5)
            client = Client(etcd=etcd.url, cluster="ns", config=cfg)
            try:
                assert wait_for(lambda: sorted(client.members) == [f"host{i}" for i in range(4)], WAIT_S)
                assert {s["server_id"] for s in client.stats()["servers"].values()} == {f"host{i}" for i in range(4)}
                keys = [random.Random(i).randbytes(16) for i in range(400)]
                stop = threading.Event()
                errors: list[BaseException] = []
                wrong: list[bytes] = []
                rounds = [0]

                def load() -> None:
                    rng = random.Random(3)
                    while not stop.is_set():
                        try:
                            batch = rng.sample(keys, 50)
                            client.put(batch, [_value(k) for k in batch])
                            for k, v in zip(batch, client.get(batch)):
                                if v is not None and v != _value(k):
                                    wrong.append(k)
                            client.lookup(batch)
                            rounds[0] += 1
                        except BaseException as e:  # any exception out of the client fails the test
                            errors.append(e)
                            return

                def progress() -> bool:
                    mark = rounds[0]
                    return bool(wait_for(lambda: rounds[0] >= mark + 3 or errors, WAIT_S)) and not errors

                t = threading.Thread(target=load, daemon=True)
                t.start()
                assert progress()

                lab.partition(1)  # host1 cut off: calls to it time out, its lease expires, clients drop it
                assert wait_for(lambda: "host1" not in client.members, WAIT_S), client.members
                assert progress()
                lab.heal(1)  # it re-registers (its lease was lost) and clients route to it again
                assert wait_for(lambda: "host1" in client.members, WAIT_S), client.members
                assert progress()

                servers[2].kill()  # crash, then restart on the same address under the same id
                assert wait_for(lambda: "host2" not in client.members, WAIT_S), client.members
                serve(2)
                assert wait_for(lambda: "host2" in client.members, WAIT_S), client.members
                assert progress()

                serve(4)  # a new host joins under load
                assert wait_for(lambda: "host4" in client.members, WAIT_S), client.members
                assert progress()
                stop.set()
                t.join(WAIT_S)
                assert not errors, errors
                assert not wrong, f"{len(wrong)} wrong values"

                # recovered: with every host back, what is put now is all found again
                assert wait_for(lambda: sorted(client.members) == [f"host{i}" for i in range(5)], WAIT_S)
                fresh = [random.Random(10_000 + i).randbytes(16) for i in range(400)]

                def all_hits() -> bool:
                    client.put(fresh, [_value(k) for k in fresh])
                    return client.get(fresh) == [_value(k) for k in fresh]

                assert wait_for(all_hits, WAIT_S, interval_s=0.5)
                assert set(client.stats()["servers"]) == {f"{ip}:7070" for ip in lab.ips}
            finally:
                client.close()
        finally:
            for s in servers.values():
                s.kill()
