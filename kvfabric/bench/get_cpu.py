"""``kvfabric bench get_cpu``: large GETs through ``kvfabric.Client``, throughput and each side's CPU against the C socket.

::

    kvfabric bench get_cpu [--size 32MiB] [--objects 8] [--rounds 20] [--repeat 5]
    python benchmarks/get_cpu.py ...      # the same

One ``kvfabric serve`` process on loopback (``native`` transport) holds
``--objects`` objects of ``--size`` bytes; each cell GETs all of them with one
``Client.get_into`` per round, ``--rounds`` rounds, and reports GB/s (median
round) and the CPU time (user + system) of the server process (``/proc``) and
of this client process (``getrusage``) per GiB moved. Rows:

* ``client verifies``: the default ``Client`` (``verify_checksums``): each
  object is hashed while it lands and the GET says ``client_verifies``, so the
  server sends without its own checksum pass;
* ``server verifies``: ``verify_checksums=False``: the client checks nothing,
  so the server verifies every object as it sends it;
* ceiling ``c-socket``: a C client and a C server process moving the same
  bytes per request over loopback TCP with blocking send/recv
  (``_native.socket_ceiling``; CPU columns not measured).

Cells are interleaved ``--repeat`` times (medians reported) so machine noise
spreads over every row. Prints a table; writes JSON (``--out``, default
bench-results/get_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
import uuid

import numpy as np

from .. import Client, ClientConfig, _native
from ..config import parse_size
from ..testing.servers import start_server
from . import proc_cpu_s, write_json

GiB = 1 << 30


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _get_cell(client: Client, pid: int, keys: list[bytes], bufs: list[np.ndarray], rounds: int) -> dict:
    total = sum(b.nbytes for b in bufs)
    walls = []
    s0, c0 = proc_cpu_s(pid), _self_cpu_s()
    for _ in range(rounds):
        t = time.perf_counter()
        got = client.get_into(keys, bufs)
        walls.append(time.perf_counter() - t)
        if any(g is None for g in got):
            raise RuntimeError("a GET missed")
    s1, c1 = proc_cpu_s(pid), _self_cpu_s()
    gib = rounds * total / GiB
    return {"gbps": total / statistics.median(walls) / 1e9, "server_cpu_ms_per_gib": 1e3 * (s1 - s0) / gib,
            "client_cpu_ms_per_gib": 1e3 * (c1 - c0) / gib}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=32 << 20, help="object size (default 32MiB)")
    p.add_argument("--objects", type=int, default=8, help="objects per GET (default 8)")
    p.add_argument("--rounds", type=int, default=20, help="GETs per cell (default 20)")
    p.add_argument("--repeat", type=int, default=5, help="interleaved repetitions; medians reported")
    p.add_argument("--out", default="bench-results/get_cpu.json")
    args = p.parse_args(argv)
    total = args.size * args.objects
    rng = np.random.default_rng(3)
    values = [rng.integers(0, 256, args.size, dtype=np.uint8) for _ in range(args.objects)]
    keys = [uuid.uuid4().bytes for _ in values]
    bufs = [np.empty(args.size, dtype=np.uint8) for _ in values]
    cells: dict[str, list[dict]] = {"client verifies": [], "server verifies": [], "ceiling: c-socket": []}
    capacity = max(2 * total, 64 << 20)
    with start_server(capacity=str(capacity)) as srv:
        clients = {"client verifies": Client([srv.address], config=ClientConfig(timeout_s=60)),
                   "server verifies": Client([srv.address], config=ClientConfig(timeout_s=60, verify_checksums=False))}
        try:
            if clients["client verifies"].put(keys, values).stored != len(keys):
                raise RuntimeError("the objects were not all stored")
            for c in clients.values():
                _get_cell(c, srv.pid, keys, bufs, 1)  # connect, warm the buffers
            for _ in range(args.repeat):
                for name, c in clients.items():
                    cells[name].append(_get_cell(c, srv.pid, keys, bufs, args.rounds))
                secs = _native.socket_ceiling(total, args.rounds, False)
                cells["ceiling: c-socket"].append({"gbps": total * args.rounds / secs / 1e9})
            if any(clients["client verifies"].get_into(keys, bufs)[i] != args.size for i in range(len(keys))) or \
                    any(bytes(b) != bytes(v) for b, v in zip(bufs, values)):
                raise RuntimeError("the objects did not come back intact")
        finally:
            for c in clients.values():
                c.close()
    rows = []
    for name, xs in cells.items():
        row = {"row": name, "samples": xs}
        for k in ("gbps", "server_cpu_ms_per_gib", "client_cpu_ms_per_gib"):
            if k in xs[0]:
                row[k] = statistics.median(x[k] for x in xs)
        rows.append(row)
    ceiling = rows[-1]["gbps"]
    print(f"\nGET of {args.objects} x {args.size / 2**20:.0f} MiB through kvfabric.Client, one native server on "
          f"loopback; medians of {args.repeat} interleaved cells of {args.rounds} GETs")
    hdr = f"{'row':<20} {'GB/s':>7} {'/ c-socket':>11} {'server CPU ms/GiB':>18} {'client CPU ms/GiB':>18}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sc = f"{r['server_cpu_ms_per_gib']:.0f}" if "server_cpu_ms_per_gib" in r else "-"
        cc = f"{r['client_cpu_ms_per_gib']:.0f}" if "client_cpu_ms_per_gib" in r else "-"
        print(f"{r['row']:<20} {r['gbps']:>7.2f} {r['gbps'] / ceiling:>11.2f} {sc:>18} {cc:>18}")
    meta = {"size": args.size, "objects": args.objects, "rounds": args.rounds, "repeat": args.repeat,
            "python": platform.python_version(), "cpus": os.cpu_count(), "argv": sys.argv[1:] if argv is None else argv}
    print()
    write_json(args.out, {"meta": meta, "rows": rows})
    return 0
