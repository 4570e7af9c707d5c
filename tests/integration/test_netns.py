"""Multi-host membership on one machine (kvfabric.testing.netns): 8 pool servers, each in its own network
namespace, two load clients in a namespace of their own (kvfabric.testing.netns_load, not the test's
namespace), etcd on the lab's bridge; a partition shorter than the lease TTL, one longer, a crash and restart,
and a join, all under load. Needs root, ``ip`` and the etcd binary; skipped with the reason otherwise. Every
namespace, veth, bridge and process it starts is removed when it ends, failed or not (NetLab.close; a lab
left by a SIGKILLed run is swept by the next one). No fixed waits and no timed assertion: every change is
awaited with ``wait_for`` and a generous deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfabric.testing.etcd import MISSING_REASON, etcd_binary, start_etcd
from kvfabric.testing.netns import NetLab, missing_reason, start_server_in
from kvfabric.testing.poll import wait_for

WAIT_S = 90.0
SERVERS = 8  # namespaces 0..7; 8: the server that joins; 9: the clients
TTL_S = 3


@pytest.fixture(scope="module")
def lab():
    why = missing_reason()
    if why:
        pytest.skip(why)
    if etcd_binary() is None:
        pytest.skip(MISSING_REASON)
    with NetLab(SERVERS + 2) as lab:
        yield lab


def test_eight_hosts_partitions_crash_restart_and_join_under_load(lab):
    with start_etcd(host=lab.bridge_ip) as etcd:

        def serve(i: int):
            return start_server_in(lab, i, ["--etcd", etcd.url, "--cluster", "ns", "--etcd-ttl", str(TTL_S),
                                            "--server-id", f"host{i}"])

        servers = {i: serve(i) for i in range(SERVERS)}
        loads = [lab.start_load(SERVERS + 1, etcd.url, "ns", seed=s, timeout_s=1.0) for s in (1, 2)]
        everyone = [f"host{i}" for i in range(SERVERS)]

        def routed(pred) -> bool:
            return all(pred(set(load.latest["members"])) for load in loads)

        def healthy() -> bool:
            return all(load.latest["errors"] == 0 and load.latest["wrong"] == 0 for load in loads)

        def progress() -> bool:
            """Both clients complete more rounds (no client is stuck) and none has raised or read wrong bytes."""
            marks = [sum(r["rounds"] for r in load.reports) for load in loads]
            return bool(wait_for(lambda: not healthy() or all(
                sum(r["rounds"] for r in load.reports) >= m + 5 for load, m in zip(loads, marks)), WAIT_S)) \
                and healthy()

        def state() -> str:
            return repr([(load.latest, load.log()[-800:]) for load in loads])

        assert wait_for(lambda: routed(lambda m: m == set(everyone)), WAIT_S), state()
        assert progress(), state()

        # a partition shorter than the lease TTL: calls to host1 time out and count as misses meanwhile;
        # the clients reconnect after the heal (its lease normally survives; the test does not rely on it)
        lab.partition(1)
        assert progress(), state()
        lab.heal(1)
        assert wait_for(lambda: routed(lambda m: "host1" in m), WAIT_S), state()
        assert progress(), state()

        # a partition longer than the TTL: host2's lease expires, clients drop it; healed, it registers again
        lab.partition(2)
        assert wait_for(lambda: routed(lambda m: "host2" not in m), WAIT_S), state()
        assert progress(), state()
        lab.heal(2)
        assert wait_for(lambda: routed(lambda m: "host2" in m), WAIT_S), state()
        assert progress(), state()

        # a crash, then a restart on the same address under the same id
        servers[3].kill()
        assert wait_for(lambda: routed(lambda m: "host3" not in m), WAIT_S), state()
        assert progress(), state()
        servers[3] = serve(3)
        assert wait_for(lambda: routed(lambda m: "host3" in m), WAIT_S), state()
        assert progress(), state()

        # a new host joins under load
        servers[SERVERS] = serve(SERVERS)
        assert wait_for(lambda: routed(lambda m: m == set(everyone) | {f"host{SERVERS}"}), WAIT_S), state()
        assert progress(), state()

        finals = [load.stop() for load in loads]
        for final in finals:
            assert final["errors"] == 0, final["first_error"]
            assert final["wrong"] == 0
            # recovered: after one put pass over the misses, every key of the working set is found again
            assert final["after_put_hit_rate"] == 1.0, final
            assert final["recovered_hit_rate"] > 0, final  # before that pass: most keys still found (not timed)


def test_a_lab_left_by_a_killed_run_is_swept():
    """A test run killed outright (no exit handler) leaves its namespaces, veths, bridge and processes; the
    next NetLab removes them (and never touches a lab whose creator still runs)."""
    why = missing_reason()
    if why:
        pytest.skip(why)
    code = ("import os, subprocess, sys\n"
            "from kvfabric.testing.netns import NetLab\n"
            "lab = NetLab(2)\n"
            "subprocess.Popen(lab.exec_prefix(0) + ['sleep', '600'], stdout=subprocess.DEVNULL,\n"
            "                 stderr=subprocess.DEVNULL, start_new_session=True)\n"
            "print(' '.join(lab.namespaces + [lab.bridge]), flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert len(out) == 3, out
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(ns in left for ns in out[:2])
    sleeper = subprocess.run(["ip", "netns", "pids", out[0]], capture_output=True, text=True).stdout.split()
    assert sleeper
    with NetLab(1) as mine:
        assert mine.namespaces[0] in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert not any(ns in left for ns in out[:2]) and out[2] not in links
        assert not os.path.exists(f"/proc/{sleeper[0]}") or "sleep" not in open(f"/proc/{sleeper[0]}/cmdline").read()
