"""``kvfabric bench membership``: keys moved by a join or leave, and how fast clients follow etcd.

Movement (pure computation over :mod:`kvfabric.sharding`, no servers): for
each N in ``--sizes`` (4, 8) and ``--trials`` random sets of server ids,
route ``--keys`` random keys over N servers, then over N+1 (a join) and N-1
(one leaves, each of the N in turn), and count the keys whose primary owner
changed. Rendezvous hashing should move about 1/(N+1) of the keys on a join
and 1/N on a leave, and only keys that go to the joining server or come from
the leaving one (``stray`` counts any other move: it must be 0). Target
(issue 12): within 10 % of 1/N.

Timing (``--live``, needs the ``etcd`` binary; skipped with the reason
otherwise): a real etcd, N servers started with ``kvfabric serve --etcd``,
one :class:`kvfabric.Client` following the cluster, its routed members
sampled every ``--poll-ms``:

* ``join``: a running server registers (the same
  :class:`~kvfabric.membership.registry.Registration` that ``serve --etcd``
  uses, started here so the instant is known) until the client routes to it;
* ``serve_join``: from starting a ``kvfabric serve --etcd`` process until the
  client routes to it (process start-up included);
* ``leave``: SIGTERM to a ``serve --etcd`` process until the client no longer
  routes to it (the server revokes its lease first);
* ``crash``: SIGKILL until the client no longer routes to it (bounded by the
  lease TTL, ``--ttl``). Targets: crash <= TTL + 1 s, join <= 1 s.

Partition (``--netns``, needs root, ``ip`` and etcd; skipped with the reason
otherwise): 4 servers, each in its own network namespace
(:mod:`kvfabric.testing.netns`), etcd and the client in the caller's
namespace over a private bridge. The client runs rounds of a read-through
cache workload (GET ``--batch`` keys drawn from ``--working-set`` keys, PUT
the misses); one server is cut off for ``--partition-s`` (10) seconds, then
healed. Reported: client exceptions (target 0), the hit rate over the last
2 s before the partition, the lowest round during it, and the time from the
heal until a round's hit rate is back within 2 points of before (target 5 s).

Trace replay under a partition (``--netns --trace NAME``, e.g.
``mooncake-synthetic``): the same 4 namespaced servers, the trace's requests
paced so that the partition covers 40 % of the replay (``--trace-rate``
overrides the requests/s; LOOKUP the prompt's block keys, PUT the blocks
past the run; the *exists* level, values of ``--value-bytes``), twice on
fresh servers: once as a control, once with one server cut off for
``--partition-s`` seconds starting at ``--cut-at`` (a fraction of the
requests). Hit rates are compared window by window (``--window`` requests)
against the control's same requests; reported: client exceptions, the
difference before the cut (should be ~0), the worst window during the
partition, and the wall time from the heal until a window is back within 2
points of the control (target: 5 s).

Hand-off (``--handoff``; servers on loopback, members set by the benchmark
through :class:`~kvfabric.membership.ManualMembership`, the path etcd's watch
takes): ``--servers`` (4) servers hold ``--handoff-keys`` keys, then one
membership change, then one read-through pass (GET every key, PUT the
misses) whose hit rate is reported, with hand-off (``handoff_s`` 30) and
without (0), each on fresh servers:

* ``join``: a new server joins (its ~1/(N+1) of the keys move to it);
* ``leave``: a server is killed and leaves (its keys are gone: hand-off cannot
  help with replicas=1);
* ``rejoin``: a server leaves the membership (a partition past its lease)
  while new keys are put, then returns: the pass reads the new keys, the
  trace-replay partition case;
* ``replace`` (replicas=2): a server is replaced by an empty one under the
  same id; the pass hits through the other replica either way; reported too:
  how much of what the new server should hold it holds after the pass and
  the background repairs (read-repair refills its primary copies; hand-off's
  "new owner" repair its secondary ones).

Prints tables; writes JSON (``--out``, default bench-results/membership.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from . import write_json
from .. import sharding


def _primary(keys: list[bytes], ids: list[str]) -> list[str]:
    return [ids[row[0]] for row in sharding.owner_table(keys, ids, 1)]


def movement(sizes: list[int], n_keys: int, trials: int, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(n_keys)]
    out = []
    for n in sizes:
        join, leave, stray = [], [], 0
        for _ in range(trials):
            ids = [f"srv-{rng.randbytes(4).hex()}" for _ in range(n + 1)]
            base, extra = ids[:n], ids[n]
            before = _primary(keys, base)
            after = _primary(keys, base + [extra])
            moved = [(b, a) for b, a in zip(before, after) if b != a]
            stray += sum(1 for _, a in moved if a != extra)
            join.append(len(moved) / n_keys)
            for gone in base:
                rest = [s for s in base if s != gone]
                after = _primary(keys, rest)
                moved = [(b, a) for b, a in zip(before, after) if b != a]
                stray += sum(1 for b, _ in moved if b != gone)
                leave.append(len(moved) / n_keys)
        jm, lm = statistics.mean(join), statistics.mean(leave)
        out.append({
            "servers": n, "keys": n_keys, "trials": trials,
            "join_moved": jm, "join_ideal": 1 / (n + 1), "join_ratio": jm * (n + 1),
            "leave_moved": lm, "leave_ideal": 1 / n, "leave_ratio": lm * n,
            "leave_moved_min": min(leave), "leave_moved_max": max(leave), "stray_moves": stray,
            "within_10pct_of_1_over_n": abs(jm * (n + 1) - 1) <= 0.1 and abs(lm * n - 1) <= 0.1,
        })
    return out


def _until(pred, poll_s: float, timeout_s: float = 120.0) -> float:
    """Seconds until ``pred()`` is true (polled every ``poll_s``); raises TimeoutError."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError("the client did not follow the membership change")
        time.sleep(poll_s)
    return time.monotonic() - t0


def live(n: int, trials: int, ttl: int, poll_s: float) -> dict[str, Any]:
    from ..client import Client
    from ..config import ClientConfig
    from ..membership import Member
    from ..membership.etcd import EtcdClient
    from ..membership.registry import Registration
    from ..testing.etcd import MISSING_REASON, etcd_binary, start_etcd
    from ..testing.servers import start_server

    if etcd_binary() is None:
        return {"skipped": MISSING_REASON}
    cluster = "bench"
    times: dict[str, list[float]] = {"join": [], "serve_join": [], "leave": [], "crash": []}

    def serve(sid: str):
        return start_server(capacity="16MiB", extra_args=["--etcd", etcd.url, "--cluster", cluster,
                                                          "--etcd-ttl", str(ttl), "--server-id", sid])

    with start_etcd() as etcd:
        procs = [serve(f"base-{i}") for i in range(n)]
        client = Client(etcd=etcd.url, cluster=cluster, config=ClientConfig(transport="tcp"))
        try:
            _until(lambda: len(client.members) == n, poll_s)
            for t in range(trials):
                # join: a running server registers now
                spare = start_server(capacity="16MiB", extra_args=["--server-id", f"reg-{t}"])
                member = Member(f"reg-{t}", spare.address, {"tcp": spare.address}, 16 << 20)
                reg = Registration(EtcdClient(etcd.url), cluster, member, ttl_s=ttl)
                t0 = time.monotonic()
                reg.start()
                times["join"].append(time.monotonic() - t0 + _until(lambda: f"reg-{t}" in client.members, poll_s))
                reg.stop()
                _until(lambda: f"reg-{t}" not in client.members, poll_s)
                spare.stop()
                # serve_join: a serve --etcd process from its start
                t0 = time.monotonic()
                p = serve(f"new-{t}")
                times["serve_join"].append(time.monotonic() - t0 + _until(lambda: f"new-{t}" in client.members, poll_s))
                # leave: SIGTERM
                t0 = time.monotonic()
                p.popen.terminate()
                times["leave"].append(_until(lambda: f"new-{t}" not in client.members, poll_s))
                p.stop()
                # crash: SIGKILL, gone at lease expiry
                p = serve(f"crash-{t}")
                _until(lambda: f"crash-{t}" in client.members, poll_s)
                t0 = time.monotonic()
                p.kill()
                times["crash"].append(time.monotonic() - t0 + _until(lambda: f"crash-{t}" not in client.members, poll_s))
        finally:
            client.close()
            for p in procs:
                p.stop()
    summary = {k: {"median_s": statistics.median(v), "max_s": max(v), "all_s": v} for k, v in times.items()}
    return {"servers": n, "ttl_s": ttl, "trials": trials, "poll_ms": poll_s * 1000, "times": summary,
            "targets": {"crash_max_s": ttl + 1, "join_max_s": 1.0},
            "met": summary["crash"]["max_s"] <= ttl + 1 and summary["join"]["max_s"] <= 1.0}


def partition(partition_s: float, ttl: int, batch: int, working_set: int, handoff_s: float = 30.0) -> dict[str, Any]:
    from ..client import Client
    from ..config import ClientConfig
    from ..testing.etcd import MISSING_REASON, etcd_binary, start_etcd
    from ..testing.netns import NetLab, missing_reason, start_server_in

    why = missing_reason() or (MISSING_REASON if etcd_binary() is None else None)
    if why:
        return {"skipped": why}
    rng = random.Random(5)
    keys = [rng.randbytes(16) for _ in range(working_set)]
    rounds: list[tuple[float, float]] = []  # (monotonic time, hit rate of the round)
    errors: list[str] = []
    with NetLab(4) as lab, start_etcd(host=lab.bridge_ip) as etcd:
        procs = [start_server_in(lab, i, ["--etcd", etcd.url, "--cluster", "part", "--etcd-ttl", str(ttl),
                                          "--server-id", f"host{i}"]) for i in range(4)]
        client = Client(etcd=etcd.url, cluster="part",
                        config=ClientConfig(transport="tcp", timeout_s=1.0, connect_timeout_s=0.3,
                                            handoff_s=handoff_s))
        try:
            _until(lambda: len(client.members) == 4, 0.01)

            def run_until(t_end: float) -> None:
                while time.monotonic() < t_end:
                    b = rng.sample(keys, batch)
                    try:
                        got = client.get(b)
                        miss = [k for k, v in zip(b, got) if v is None]
                        if miss:
                            client.put(miss, [k * 64 for k in miss])
                    except Exception as e:  # counted: the target is none
                        errors.append(f"{type(e).__name__}: {e}")
                        continue
                    rounds.append((time.monotonic(), 1 - len(miss) / batch))

            run_until(time.monotonic() + 8.0)  # warm up to a steady hit rate
            t_cut = time.monotonic()
            lab.partition(1)
            run_until(t_cut + partition_s)
            t_heal = time.monotonic()
            lab.heal(1)
            run_until(t_heal + 10.0)
        finally:
            client.close()
            for p in procs:
                p.kill()
    before = [h for t, h in rounds if t_cut - 2.0 <= t < t_cut]
    during = [h for t, h in rounds if t_cut <= t < t_heal]
    base = statistics.mean(before) if before else 0.0
    back = next((t - t_heal for t, h in rounds if t >= t_heal and h >= base - 0.02), None)
    # the cut-off server's keys are re-put on the others once clients stop routing to it (lease expiry),
    # so the hit rate recovers during the partition too; and again when it returns with its data
    failover = next((t - t_cut for t, h in rounds if t_cut + 0.5 <= t < t_heal and h >= base - 0.02), None)
    after = [h for t, h in rounds if t >= t_heal]
    return {"servers": 4, "ttl_s": ttl, "handoff_s": handoff_s, "partition_s": partition_s, "batch": batch,
            "working_set": working_set,
            "rounds": len(rounds), "exceptions": len(errors), "first_errors": errors[:3],
            "hit_rate_before": base, "hit_rate_min_during": min(during) if during else None,
            "recovered_after_heal_s": back, "recovered_during_partition_s": failover,
            "hit_rate_min_after_heal": min(after) if after else None,
            "met": not errors and back is not None and back <= 5.0}


def trace_partition(trace_name: str, partition_s: float, ttl: int, cut_at: float, window: int,
                    value_bytes: int, limit: int | None, rate: float | None = None,
                    handoff_s: float = 30.0) -> dict[str, Any]:
    from ..client import Client
    from ..config import ClientConfig
    from ..testing.etcd import MISSING_REASON, etcd_binary, start_etcd
    from ..testing.netns import NetLab, missing_reason, start_server_in
    from .traces import block_keys, load_trace

    why = missing_reason() or (MISSING_REASON if etcd_binary() is None else None)
    if why:
        return {"skipped": why}
    trace = load_trace(trace_name, limit=limit)
    reqs = [block_keys(r.hash_ids) for r in trace.requests]
    n_cut = int(len(reqs) * cut_at)
    rate = rate or len(reqs) * 0.4 / partition_s  # requests/s: the partition spans 40 % of the replay
    unique = len({k for ks in reqs for k in ks})
    # every block fits with room to spare (no eviction): the server allocates at least a 4 KiB page per object
    capacity = f"{max(16, 2 * unique * max(4096, value_bytes + 256) // 4 >> 20)}MiB"

    def replay(lab: NetLab, etcd_url: str, cluster: str, cut: bool) -> dict[str, Any]:
        procs = [start_server_in(lab, i, ["--etcd", etcd_url, "--cluster", cluster, "--etcd-ttl", str(ttl),
                                          "--server-id", f"{cluster}-{i}"], capacity=capacity) for i in range(4)]
        hits: list[int] = []
        times: list[float] = []
        errors: list[str] = []
        t_cut = t_heal = None
        i_heal = None
        client = Client(etcd=etcd_url, cluster=cluster,
                        config=ClientConfig(transport="tcp", timeout_s=1.0, connect_timeout_s=0.3,
                                            handoff_s=handoff_s))
        try:
            _until(lambda: len(client.members) == 4, 0.01)
            t0 = time.monotonic()
            for i, keys in enumerate(reqs):
                ahead = t0 + i / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
                if cut and i == n_cut:
                    lab.partition(1)
                    t_cut = time.monotonic()
                if t_cut is not None and t_heal is None and time.monotonic() - t_cut >= partition_s:
                    lab.heal(1)
                    t_heal, i_heal = time.monotonic(), i
                try:
                    run = client.lookup(keys)
                    if run < len(keys):
                        client.put(keys[run:], [k * (value_bytes // 16) for k in keys[run:]])
                except Exception as e:  # counted: the target is none
                    errors.append(f"{type(e).__name__}: {e}")
                    run = 0
                hits.append(run)
                times.append(time.monotonic())
            if cut and t_heal is None:
                lab.heal(1)
            full = client.stats()
            st = full["client"]
            counts = {k: st[k] for k in ("handoff_hits", "handoff_repairs", "read_repairs", "repairs_dropped",
                                         "membership_changes", "dropped_puts")}
            counts["server_evictions"] = sum(v.get("evictions", 0) for v in full["servers"].values())
        finally:
            client.close()
            for p in procs:
                p.kill()
        return {"hits": hits, "times": times, "errors": errors, "t_cut": t_cut, "t_heal": t_heal, "i_heal": i_heal,
                "client": counts}

    with NetLab(4) as lab, start_etcd(host=lab.bridge_ip) as etcd:
        control = replay(lab, etcd.url, "control", False)
        part = replay(lab, etcd.url, "part", True)
    sizes = [len(k) for k in reqs]

    def window_rate(run: dict[str, Any], a: int, b: int) -> float:
        return sum(run["hits"][a:b]) / max(1, sum(sizes[a:b]))

    starts = range(0, len(reqs) - window + 1, window)
    diff = {a: window_rate(part, a, a + window) - window_rate(control, a, a + window) for a in starts}
    before = [d for a, d in diff.items() if a + window <= n_cut]
    i_heal = part["i_heal"]
    during = [d for a, d in diff.items() if a >= n_cut and (i_heal is None or a + window <= i_heal)]
    back_s = None
    if i_heal is not None:
        for a, d in diff.items():
            if a >= i_heal and d >= -0.02:
                back_s = part["times"][a + window - 1] - part["t_heal"]
                break
    errors = control["errors"] + part["errors"]
    return {
        "trace": trace_name, "requests": len(reqs), "unique_blocks": unique, "servers": 4, "ttl_s": ttl,
        "handoff_s": handoff_s,
        "partition_s": partition_s, "requests_per_s": rate, "cut_at_request": n_cut, "healed_at_request": i_heal, "window": window,
        "exceptions": len(errors), "first_errors": errors[:3],
        "control_hit_rate": window_rate(control, 0, len(reqs)),
        "partition_run_hit_rate": window_rate(part, 0, len(reqs)),
        "diff_before_cut_points": 100 * statistics.mean(before) if before else None,
        "worst_window_during_points": 100 * min(during) if during else None,
        "back_within_2_points_after_heal_s": back_s,
        "after_heal_windows": [{"s": part["times"][a + window - 1] - part["t_heal"], "points": 100 * d}
                               for a, d in diff.items() if i_heal is not None and a >= i_heal][:20],
        "client_counters": part["client"],
        "control_server_evictions": control["client"]["server_evictions"],
        "replay_wall_s": control["times"][-1] - control["times"][0] if control["times"] else None,
        "met": not errors and back_s is not None and back_s <= 5.0,
    }


def handoff(n: int, n_keys: int, value_bytes: int) -> dict[str, Any]:
    from ..client import Client
    from ..config import ClientConfig
    from ..membership import ManualMembership, Member
    from ..testing.servers import start_server

    rng = random.Random(7)
    keys = [rng.randbytes(16) for _ in range(n_keys)]
    extra = [rng.randbytes(16) for _ in range(n_keys)]

    def value(k: bytes) -> bytes:
        return (k * (value_bytes // 16 + 1))[:value_bytes]

    def one(case: str, handoff_s: float) -> dict[str, Any]:
        procs: dict[str, Any] = {}

        def serve(sid: str) -> Member:
            procs[sid] = start_server(capacity="64MiB", extra_args=["--server-id", sid])
            return Member(sid, procs[sid].address)

        replicas = 2 if case == "replace" else 1
        members = [serve(f"s{i}") for i in range(n)]
        ms = ManualMembership(members)
        cfg = ClientConfig(transport="tcp", handoff_s=handoff_s, replicas=replicas, timeout_s=10.0)
        out: dict[str, Any] = {"case": case, "handoff_s": handoff_s, "replicas": replicas}
        try:
            with Client(membership=ms, config=cfg) as client:
                client.put(keys, [value(k) for k in keys])
                read = keys
                if case == "join":
                    ms.set(members + [serve(f"s{n}")])
                elif case == "leave":
                    procs["s0"].kill()
                    ms.set(members[1:])
                elif case == "rejoin":
                    ms.set(members[1:])
                    client.put(extra, [value(k) for k in extra])
                    ms.set(members)
                    read = extra
                elif case == "replace":
                    procs["s0"].kill()
                    new = serve("s0")
                    ms.set([new] + members[1:])
                t0 = time.monotonic()
                got = client.get(read)
                out["pass_s"] = time.monotonic() - t0
                miss = [k for k, v in zip(read, got) if v is None]
                out["wrong"] = sum(1 for k, v in zip(read, got) if v is not None and v != value(k))
                out["hit_rate"] = 1 - len(miss) / len(read)
                client.put(miss, [value(k) for k in miss])
                if case == "replace":
                    due = [k for k, o in zip(keys, client.route(keys)) if "s0" in o]
                    with Client([procs["s0"].address], config=ClientConfig(transport="tcp", handoff_s=0)) as d:
                        def held() -> float:
                            return sum(d.exists(due)) / len(due)
                        t1 = time.monotonic()
                        while held() < 1.0 and time.monotonic() - t1 < 10.0:
                            time.sleep(0.2)
                        out["new_server_holds"] = held()
                st, t1 = client.stats()["client"], time.monotonic()
                # let the background repairs finish before reading their counters
                while (time.monotonic() - t1 < 10.0
                       and st["handoff_repairs"] + st["repairs_dropped"] < st["handoff_hits"]):
                    time.sleep(0.1)
                    st = client.stats()["client"]
                out.update({k: st[k] for k in ("handoff_hits", "handoff_repairs", "read_repairs", "repairs_dropped")})
        finally:
            for p in procs.values():
                p.kill()
        return out

    rows = [one(case, h) for case in ("join", "leave", "rejoin", "replace") for h in (30.0, 0.0)]
    return {"servers": n, "keys": n_keys, "value_bytes": value_bytes, "rows": rows}


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def print_tables(report: dict[str, Any]) -> None:
    print("key movement (primary owner changed), rendezvous over server ids")
    print(f"{'N':>3} {'join moved':>11} {'1/(N+1)':>8} {'ratio':>6} {'leave moved':>12} {'1/N':>7} {'ratio':>6} "
          f"{'stray':>6} within 10%")
    for r in report["movement"]:
        print(f"{r['servers']:>3} {r['join_moved']:>11.4f} {r['join_ideal']:>8.4f} {r['join_ratio']:>6.3f} "
              f"{r['leave_moved']:>12.4f} {r['leave_ideal']:>7.4f} {r['leave_ratio']:>6.3f} {r['stray_moves']:>6} "
              f"{'yes' if r['within_10pct_of_1_over_n'] else 'NO'}")
    pt = report.get("partition")
    if pt is not None:
        if "skipped" in pt:
            print(f"partition: skipped ({pt['skipped']})")
        else:
            back = pt["recovered_after_heal_s"]
            print(f"\npartition of 1 of 4 namespaced servers for {pt['partition_s']} s (TTL {pt['ttl_s']} s, "
                  f"client handoff_s {pt['handoff_s']:g}): "
                  f"{pt['rounds']} rounds, {pt['exceptions']} client exceptions, hit rate before "
                  f"{100 * pt['hit_rate_before']:.1f}%, lowest during {100 * (pt['hit_rate_min_during'] or 0):.1f}%, "
                  f"back within 2 points {'%.2f s' % back if back is not None else 'never'} after healing "
                  f"(lowest after healing {100 * (pt['hit_rate_min_after_heal'] or 0):.1f}%; already back "
                  f"{_secs(pt['recovered_during_partition_s'])} into the partition, once its keys were re-put on the "
                  f"others): {'met' if pt['met'] else 'NOT met'}")
    tp = report.get("trace_partition")
    if tp is not None:
        if "skipped" in tp:
            print(f"trace partition: skipped ({tp['skipped']})")
        else:
            print(f"\ntrace replay {tp['trace']} ({tp['requests']} requests, client handoff_s "
                  f"{tp['handoff_s']:g}) over 4 namespaced servers, one cut off "
                  f"for {tp['partition_s']} s from request {tp['cut_at_request']} at {tp['requests_per_s']:.0f} "
                  f"requests/s (healed at request "
                  f"{tp['healed_at_request']}), windows of {tp['window']} requests vs a control run:")
            print(f"  exceptions {tp['exceptions']}; hit rate control {100 * tp['control_hit_rate']:.1f}%, with the "
                  f"partition {100 * tp['partition_run_hit_rate']:.1f}%; before the cut "
                  f"{tp['diff_before_cut_points']:+.2f} points; worst window during "
                  f"{tp['worst_window_during_points']:+.1f} points; back within 2 points "
                  f"{_secs(tp['back_within_2_points_after_heal_s'])} after healing: "
                  f"{'met' if tp['met'] else 'NOT met'}")
    ho = report.get("handoff")
    if ho is not None:
        print(f"\nhand-off: {ho['servers']} servers, {ho['keys']} keys of {ho['value_bytes']} B; hit rate of one "
              f"read-through pass right after the change")
        print(f"{'case':<8} {'replicas':>8} {'hand-off':>8} {'hit rate':>9} {'handoff hits':>12} {'repairs':>8} "
              f"{'read-repairs':>12} {'new server holds':>16} {'wrong':>5}")
        for r in ho["rows"]:
            holds = f"{100 * r['new_server_holds']:.1f}%" if "new_server_holds" in r else "-"
            print(f"{r['case']:<8} {r['replicas']:>8} {'on' if r['handoff_s'] else 'off':>8} "
                  f"{100 * r['hit_rate']:>8.1f}% {r['handoff_hits']:>12} {r['handoff_repairs']:>8} "
                  f"{r['read_repairs']:>12} {holds:>16} {r['wrong']:>5}")
    lv = report.get("live")
    if lv is None:
        return
    if "skipped" in lv:
        print(f"live: skipped ({lv['skipped']})")
        return
    print(f"\nclient following etcd: {lv['servers']} servers, lease TTL {lv['ttl_s']} s, {lv['trials']} trials, "
          f"polled every {lv['poll_ms']:.0f} ms")
    print(f"{'event':<11} {'median s':>9} {'max s':>7}")
    for k, v in lv["times"].items():
        print(f"{k:<11} {v['median_s']:>9.3f} {v['max_s']:>7.3f}")
    print(f"targets: crash <= TTL + 1 = {lv['targets']['crash_max_s']} s, join <= 1 s: "
          f"{'met' if lv['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench membership", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8],
                    help="server counts N (default 4,8)")
    ap.add_argument("--keys", type=int, default=50_000, help="keys routed per trial (default 50000)")
    ap.add_argument("--trials", type=int, default=3, help="random id sets / live trials (default 3)")
    ap.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                    help="also time a real etcd + servers + client (default on; --no-live skips it)")
    ap.add_argument("--live-servers", type=int, default=4, help="servers in the live run (default 4)")
    ap.add_argument("--ttl", type=int, default=2, help="etcd lease TTL of the live servers, s (default 2)")
    ap.add_argument("--poll-ms", type=float, default=1.0, help="how often the client's members are sampled")
    ap.add_argument("--netns", action="store_true",
                    help="also partition one of 4 servers in network namespaces (root, ip, etcd)")
    ap.add_argument("--partition-s", type=float, default=10.0, help="how long the partition lasts (default 10)")
    ap.add_argument("--batch", type=int, default=64, help="keys per round in the partition run (default 64)")
    ap.add_argument("--working-set", type=int, default=2000, help="distinct keys in the partition run (default 2000)")
    ap.add_argument("--trace", default=None, metavar="NAME",
                    help="with --netns: also replay this trace (e.g. mooncake-synthetic) with a partition vs a control")
    ap.add_argument("--trace-limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--trace-rate", type=float, default=None,
                    help="requests/s of the replay (default: the partition spans 40%% of it)")
    ap.add_argument("--cut-at", type=float, default=0.3, help="partition starts at this fraction of the requests")
    ap.add_argument("--window", type=int, default=100, help="requests per hit-rate window (default 100)")
    ap.add_argument("--value-bytes", type=int, default=256, help="bytes per block in the trace replay (default 256)")
    ap.add_argument("--handoff", action="store_true",
                    help="also measure hit rates after a join/leave/rejoin/replace with and without hand-off")
    ap.add_argument("--servers", type=int, default=4, help="servers in the hand-off run (default 4)")
    ap.add_argument("--handoff-keys", type=int, default=4000, help="keys in the hand-off run (default 4000)")
    ap.add_argument("--partition-handoff-s", type=float, default=30.0,
                    help="ClientConfig.handoff_s of the partition runs' clients (0: no hand-off; default 30)")
    ap.add_argument("--out", default="bench-results/membership.json")
    args = ap.parse_args(argv)
    if min(args.sizes) < 2 or args.keys < 1 or args.trials < 1 or args.ttl < 1 or args.live_servers < 1:
        ap.error("bad arguments")
    report: dict[str, Any] = {"movement": movement(args.sizes, args.keys, args.trials)}
    if args.live:
        report["live"] = live(args.live_servers, args.trials, args.ttl, args.poll_ms / 1000)
    if args.handoff:
        report["handoff"] = handoff(args.servers, args.handoff_keys, args.value_bytes)
    if args.netns:
        report["partition"] = partition(args.partition_s, args.ttl, args.batch, args.working_set,
                                        args.partition_handoff_s)
        if args.trace:
            report["trace_partition"] = trace_partition(args.trace, args.partition_s, args.ttl, args.cut_at,
                                                        args.window, args.value_bytes, args.trace_limit,
                                                        args.trace_rate, args.partition_handoff_s)
    print_tables(report)
    write_json(args.out, report)
    return 0
