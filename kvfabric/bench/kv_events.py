"""``kvfabric bench kv_events``: what publishing KV events costs a pool server's PUTs (issue 26 part 1).

Three real ``kvfabric serve`` processes on loopback with the same DRAM arena (``--dram-mib``), started
by this run:

* ``off``: no ``--kv-events`` (the ceiling: the same server, nothing published);
* ``on``: ``--kv-events ipc://...`` with a subscriber in this process reading every batch;
* ``stuck``: ``--kv-events`` with a subscriber that connects and never reads (ZMQ drops for it once its
  256-batch queue is full).

``--puts`` PUTs of ``--object-kib`` objects (one key each: the most events per byte) go to the three in
turn, PUT by PUT, so the machine's load falls on all alike; the working set is ``--fill`` times the
arena, so most PUTs also evict (one INSERT and one REMOVE event each). Per server: PUTs/s over its own
PUT time, client-side p50/p99 latency, and from the server's STATS the events it published, lost and
reset; for ``on`` the events the subscriber received. Ratios are to ``off``. Prints a table, writes JSON
(``--out``, default bench-results/kv_events.json). Nothing is asserted about speed here: the figures
are the point.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import write_json
from ._servers import percentile

CONFIGS = ("off", "on", "stuck")


def _events(server: Any) -> dict[str, float]:
    """The server's kvfabric_kv_events_total{kind} from its metrics port (the URL is in its log)."""
    from prometheus_client.parser import text_string_to_metric_families

    marker = "kvfabric serve: metrics on "
    url = next(line.split(marker, 1)[1].strip() for line in server.stderr_text().splitlines() if marker in line)
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {s.labels["kind"]: int(s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvfabric_kv_events_total"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import zmq

    from ..client import Client
    from ..config import ClientConfig
    from ..testing.kv_events import EventLog
    from ..testing.servers import start_server

    tmp = Path(tempfile.mkdtemp(prefix="kvf-bench-events-"))
    endpoints = {c: f"ipc://{tmp}/{c}.sock" for c in CONFIGS if c != "off"}
    servers, clients, socks = {}, {}, []
    log = None
    try:
        for c in CONFIGS:
            extra = (["--kv-events", endpoints[c], "--metrics-port", "0"]) if c in endpoints else []
            servers[c] = start_server(f"{args.dram_mib}MiB", extra_args=extra)
            clients[c] = Client([servers[c].address], config=ClientConfig(transport=args.transport))
        log = EventLog(endpoints["on"])
        stuck = zmq.Context.instance().socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(endpoints["stuck"])
        socks.append(stuck)
        # both subscribers connected: a probe object per server until the reading one has seen a batch
        deadline = time.monotonic() + 60
        n = 0
        while not log.snapshot()[0]:
            clients["on"].put([b"probe-%d" % n], [b"p"])
            n += 1
            time.sleep(0.05)
            if time.monotonic() > deadline:
                raise RuntimeError("the subscriber saw no batch within 60 s")
        value = bytes(args.object_kib << 10)
        n_keys = max(1, args.fill * (args.dram_mib << 10) // args.object_kib)
        lat: dict[str, list[float]] = {c: [] for c in CONFIGS}
        errors = dict.fromkeys(CONFIGS, 0)
        for i in range(args.puts):
            key = b"obj-%09d" % (i % n_keys if args.puts > n_keys else i)
            for c in CONFIGS:
                t0 = time.perf_counter()
                r = clients[c].put([key + c.encode()], [value])
                lat[c].append(time.perf_counter() - t0)
                errors[c] += r.dropped
        stats = {c: clients[c].stats()["servers"][servers[c].address] for c in CONFIGS}
        # the reading subscriber has everything the server published (bounded wait, then as it is)
        # (every PUT is answered, so the servers' streams go quiet within a control round or two)
        deadline = time.monotonic() + 60
        events: dict[str, dict[str, float]] = {}
        while True:
            before, events = events, {c: _events(servers[c]) for c in endpoints}
            seqs = log.snapshot()[0]
            caught_up = bool(seqs) and seqs[-1] == events["on"].get("batches", 0) - 1
            if (caught_up and events == before) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        received = sum(len(e) for _, e in log.batches)
        rows = []
        base = sum(lat["off"])
        for c in CONFIGS:
            ev = events.get(c, {})
            rows.append({
                "config": c, "puts": len(lat[c]), "dropped": errors[c],
                "puts_per_s": len(lat[c]) / sum(lat[c]), "vs_off": base / sum(lat[c]),
                "p50_us": percentile(sorted(lat[c]), 0.5) * 1e6, "p99_us": percentile(sorted(lat[c]), 0.99) * 1e6,
                "evictions": stats[c].get("evictions", 0),
                "events": ev.get("events"), "batches": ev.get("batches"), "lost": ev.get("lost"),
                "resets": ev.get("resets"), "received": received if c == "on" else None,
            })
        return {"benchmark": "kv_events", "object_kib": args.object_kib, "dram_mib": args.dram_mib,
                "puts_per_server": args.puts, "working_set_objects": n_keys, "transport": args.transport,
                "load_avg": list(os.getloadavg()), "rows": rows}
    finally:
        for s in socks:
            s.close(0)
        if log is not None:
            log.close()
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()


def _print(rep: dict[str, Any]) -> None:
    print(f"KV events cost on PUTs: {rep['puts_per_server']} PUTs of {rep['object_kib']} KiB per server, "
          f"{rep['dram_mib']} MiB arenas, working set {rep['working_set_objects']} objects, transport "
          f"{rep['transport']}; load average {rep['load_avg'][0]:.1f}")
    print(f"{'config':8} {'PUT/s':>9} {'vs off':>7} {'p50 us':>8} {'p99 us':>8} {'evictions':>10} "
          f"{'events':>8} {'lost':>6} {'resets':>6} {'received':>9}")
    for r in rep["rows"]:
        def f(v: Any) -> str:
            return "-" if v is None else str(v)
        print(f"{r['config']:8} {r['puts_per_s']:9.0f} {r['vs_off']:6.2f}x {r['p50_us']:8.0f} {r['p99_us']:8.0f} "
              f"{r['evictions']:10} {f(r['events']):>8} {f(r['lost']):>6} {f(r['resets']):>6} {f(r['received']):>9}")
    print("off: no --kv-events (the ceiling); on: a subscriber reads every batch; stuck: a subscriber that "
          "never reads. vs off: PUT time of off / PUT time of this server, same run, PUTs interleaved")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench kv_events", description=__doc__.split("\n\n")[0])
    p.add_argument("--puts", type=int, default=20000, help="PUTs per server (default 20000)")
    p.add_argument("--object-kib", type=int, default=4, help="object size in KiB (default 4)")
    p.add_argument("--dram-mib", type=int, default=16, help="each server's arena in MiB (default 16)")
    p.add_argument("--fill", type=int, default=4, help="working set / arena (default 4: most PUTs evict)")
    p.add_argument("--transport", default="native", help="client transport (default native)")
    p.add_argument("--out", default="bench-results/kv_events.json")
    args = p.parse_args(argv)
    if min(args.puts, args.object_kib, args.dram_mib, args.fill) < 1:
        p.error("--puts, --object-kib, --dram-mib and --fill must be >= 1")
    rep = run(args)
    _print(rep)
    write_json(args.out, rep)
    return 0


__all__ = ["main", "run"]
