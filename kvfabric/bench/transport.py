"""``kvfabric bench transport``: PUT/GET throughput and latency of each transport, against the loopback ceiling.

For every available client transport (``kvfabric.transport.available()``),
1 and 2 real pool-server processes, 1 and 4 client threads and block sizes of
64 KiB, 256 KiB, 1 MiB and 4 MiB it measures:

* PUT: each thread stores fresh keys (one block per call) for ``--duration``
  seconds (servers evict as they fill; that is part of the path);
* GET: each thread reads back a resident working set, one block per call,
  received with ``get_into`` into a preallocated numpy buffer, and checks that
  every call was a hit.

In the same run it measures the ceilings of the same shape (same sizes,
threads and server-process counts), in separate processes on loopback:

* ``python-socket``: a plain Python server process that answers a 16-byte
  request by ``sendall`` of the block (GET) or ``recv_into`` of it plus a
  1-byte ack (PUT); the client thread does ``sendall``/``recv_into`` of the
  same bytes. This is the bar for the pure-Python ``tcp`` transport;
  the target is GET 1 MiB, one thread, >= 0.5x.

Ceilings and transports are measured interleaved, cell by cell, ``--repeat``
times each, and the median is reported, so a figure and the ceiling it is
divided by were taken seconds apart under the same machine load.

Other ceilings (a C socket loop, memcpy) subclass :class:`Ceiling` and
register with :func:`register_ceiling`; every figure is printed as a ratio to
``python-socket`` and, in the JSON, to every ceiling measured.

Prints a table; writes JSON (``--out``, default bench-results/transport.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from . import write_json

KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
REFERENCE_CEILING = "python-socket"


@dataclass
class Cell:
    """One measured configuration."""

    kind: str  # "ceiling" or "transport"
    name: str  # ceiling or transport name
    op: str  # "put" | "get"
    size: int
    threads: int
    servers: int
    ops: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    misses: int = 0
    ratio: dict[str, float] = field(default_factory=dict)


class Ceiling:
    """A loopback ceiling: what moving the same bytes costs without kvfabric.

    ``open(servers)`` starts whatever it needs to mirror ``servers`` pool
    server processes; ``measure`` runs one cell shape; ``close`` reaps
    everything (also after a failure). Subclass and :func:`register_ceiling`
    to add one (a C socket loop, memcpy, ...).
    """

    name: str = ""

    def open(self, servers: int) -> None:
        """Start helpers for ``servers`` server processes."""

    def measure(self, op: str, size: int, threads: int, duration: float) -> Cell:
        raise NotImplementedError

    def close(self) -> None:
        """Stop helpers; idempotent."""


CEILINGS: dict[str, type[Ceiling]] = {}


def register_ceiling(cls: type[Ceiling]) -> type[Ceiling]:
    """Register a :class:`Ceiling` subclass by its ``name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError("a ceiling needs a name")
    CEILINGS[cls.name] = cls
    return cls


def _timed_threads(threads: int, duration: float, make_op: Callable[[int], Callable[[], int]]) -> tuple[int, float, int, list[float]]:
    """Run ``threads`` threads, each calling its op until ``duration`` passes (at least 3 times).

    ``make_op(t)`` is called once per thread before the clock starts and
    returns the op; the op returns the bytes it moved. Returns (ops, seconds,
    bytes, latencies in seconds).
    """
    ops = [make_op(t) for t in range(threads)]
    lat: list[list[float]] = [[] for _ in range(threads)]
    moved = [0] * threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def worker(t: int) -> None:
        op, mine = ops[t], lat[t]
        try:
            barrier.wait()
            n = 0
            clock = time.perf_counter
            while True:
                t0 = clock()
                moved[t] += op()
                t1 = clock()
                mine.append(t1 - t0)
                n += 1
                if t1 >= stop_at[0] and n >= 3:
                    break
        except BaseException as e:  # reported after join
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for t in ts:
        t.start()
    start = time.perf_counter()
    stop_at[0] = start + duration
    barrier.wait()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    flat = [x for l in lat for x in l]
    return len(flat), elapsed, sum(moved), flat


def _fill(cell: Cell, ops: int, seconds: float, nbytes: int, lat: list[float]) -> Cell:
    cell.ops, cell.seconds = ops, seconds
    cell.gbps = nbytes / seconds / 1e9
    arr = np.asarray(lat) * 1e6
    cell.p50_us = float(np.percentile(arr, 50))
    cell.p99_us = float(np.percentile(arr, 99))
    return cell


# ----------------------------------------------------------------------------- python-socket ceiling

_RAW_REQ = struct.Struct("<BxxxxxxxQ")  # op (1 get, 2 put), size
_RAW_MAX = 64 * MiB


def _raw_serve_conn(conn: socket.socket) -> None:
    view = memoryview(bytearray(0))  # grown to the largest block asked for
    req = bytearray(_RAW_REQ.size)
    try:
        while True:
            if not _recv_exact(conn, memoryview(req)):
                return
            op, size = _RAW_REQ.unpack(req)
            if size > _RAW_MAX or op not in (1, 2):
                return
            if size > view.nbytes:
                view = memoryview(bytearray(size))
            if op == 1:
                conn.sendall(view[:size])
            else:
                if not _recv_exact(conn, view[:size]):
                    return
                conn.sendall(b"k")
    except OSError:
        return
    finally:
        conn.close()


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _raw_server_main() -> None:
    """Entry point of the ceiling server process: prints its port, serves until stdin closes."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    print(ls.getsockname()[1], flush=True)

    def accept_loop() -> None:
        while True:
            c, _ = ls.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_raw_serve_conn, args=(c,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    sys.stdin.read()  # parent closes stdin (or dies) -> exit


class _RawServers:
    """``n`` ceiling server processes; a context manager that always reaps them."""

    def __init__(self, n: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        code = "from kvfabric.bench.transport import _raw_server_main; _raw_server_main()"
        try:
            for _ in range(n):
                p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                self.procs.append(p)
                line = p.stdout.readline()
                if not line.strip().isdigit():
                    raise RuntimeError(f"ceiling server did not start (said {line!r})")
                self.ports.append(int(line))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> _RawServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@register_ceiling
class PythonSocketCeiling(Ceiling):
    """Plain Python sockets, request/response of ``size`` bytes, thread ``t`` on server ``t % servers``."""

    name = REFERENCE_CEILING

    def open(self, servers: int) -> None:
        self.servers = servers
        self.raw = _RawServers(servers)

    def close(self) -> None:
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()
            self.raw = None

    def measure(self, op: str, size: int, threads: int, duration: float) -> Cell:
        cell = Cell("ceiling", self.name, op, size, threads, self.servers)
        socks: list[socket.socket] = []

        def make_op(t: int) -> Callable[[], int]:
            s = socket.create_connection(("127.0.0.1", self.raw.ports[t % self.servers]))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
            buf = memoryview(np.random.default_rng(t).integers(0, 256, size, dtype=np.uint8))
            ack = memoryview(bytearray(1))
            req = _RAW_REQ.pack(1 if op == "get" else 2, size)

            def once() -> int:
                s.sendall(req)
                if op == "get":
                    if not _recv_exact(s, buf):
                        raise ConnectionError("ceiling server closed")
                else:
                    s.sendall(buf)
                    if not _recv_exact(s, ack):
                        raise ConnectionError("ceiling server closed")
                return size

            return once

        try:
            return _fill(cell, *_timed_threads(threads, duration, make_op))
        finally:
            for s in socks:
                s.close()


# ----------------------------------------------------------------------------- kvfabric transports


def _server_kind_for(transport_name: str) -> str:
    """The server a transport is measured against: its own kind when one exists
    (``native`` client -> native server), else the first conformance pair that
    uses it (``tcp`` -> the Python reference server, ``shm`` -> native)."""
    from ..testing.conformance import TRANSPORT_PAIRS

    kinds = [server_kind for server_kind, client_transport in TRANSPORT_PAIRS if client_transport == transport_name]
    if transport_name in kinds:
        return transport_name
    return kinds[0] if kinds else "reference"


class _TransportBench:
    """One transport against ``servers`` fresh server processes, through one Client."""

    def __init__(self, name: str, servers: int, threads: int, capacity: str) -> None:
        from ..client import Client
        from ..config import ClientConfig
        from ..testing.conformance import start_pool_of

        self.name, self.servers, self.capacity = name, servers, capacity
        self.pool = start_pool_of(_server_kind_for(name), servers, capacity=capacity)
        try:
            cfg = ClientConfig(transport=name, timeout_s=30.0, connect_timeout_s=5.0, connections_per_server=threads)
            self.client = Client(self.pool.addresses, config=cfg)
        except BaseException:
            self.pool.stop()
            raise
        self.get_keys: list[list[bytes]] = []

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.pool.stop()

    def check_up(self) -> None:
        down = [a for a, st in self.client.stats()["client"]["shards"].items() if not st["up"]]
        if down:
            raise RuntimeError(f"{self.name}: servers went down during the benchmark: {down}")

    def prepare_get(self, size: int, threads: int) -> None:
        """Store a per-thread working set that stays resident (at most a quarter of the pool)."""
        from ..config import parse_size

        per_thread = max(2, min(16, parse_size(self.capacity) * self.servers // 4 // (size * threads)))
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        self.get_keys = []
        for _ in range(threads):
            keys = [rng.bytes(16) for _ in range(per_thread)]
            for k in keys:
                res = self.client.put([k], [rng.integers(0, 256, size, dtype=np.uint8)])
                if res.dropped:
                    raise RuntimeError(f"{self.name}: could not store the GET working set")
            self.get_keys.append(keys)

    def measure(self, op: str, size: int, threads: int, duration: float) -> Cell:
        cell = Cell("transport", self.name, op, size, threads, self.servers)
        misses = [0] * threads
        client = self.client

        def make_put(t: int) -> Callable[[], int]:
            value = np.random.default_rng(1000 + t).integers(0, 256, size, dtype=np.uint8)
            rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

            def once() -> int:
                misses[t] += client.put([rng.bytes(16)], [value]).dropped
                return size

            return once

        def make_get(t: int) -> Callable[[], int]:
            keys = self.get_keys[t]
            dest = np.empty(size, dtype=np.uint8)
            it = [0]

            def once() -> int:
                k = keys[it[0] % len(keys)]
                it[0] += 1
                (n,) = client.get_into([k], [dest])
                if n is None:
                    misses[t] += 1
                    return 0
                return n

            return once

        _fill(cell, *_timed_threads(threads, duration, make_put if op == "put" else make_get))
        cell.misses = sum(misses)  # GET: misses; PUT: dropped blocks
        return cell


def _median_cell(cells: list[Cell]) -> Cell:
    """The repetition with the median throughput (its latencies come with it)."""
    ranked = sorted(cells, key=lambda c: c.gbps)
    pick = ranked[(len(ranked) - 1) // 2]
    pick.misses = sum(c.misses for c in cells)
    return pick


def run(args: argparse.Namespace) -> dict:
    """Measure every shape; ceilings and transports interleaved, ``args.repeat`` times each.

    Interleaving matters on a shared machine: a ceiling and the transport cell
    it is compared with are measured seconds apart, under the same load.
    """
    from .. import transport as transport_mod

    names = args.transports or transport_mod.available()
    ceiling_names = args.ceilings or list(CEILINGS)
    ceilings: list[Cell] = []
    results: list[Cell] = []
    max_threads = max(args.threads)
    for servers in args.servers:
        opened: list = []
        try:
            ceils = []
            for cname in ceiling_names:
                c = CEILINGS[cname]()
                opened.append(c)
                c.open(servers)
                ceils.append(c)
            benches = []
            for name in names:
                b = _TransportBench(name, servers, max_threads, args.capacity)
                opened.append(b)
                benches.append(b)
            for threads in args.threads:
                for size in args.sizes:
                    for op in ("put", "get"):
                        if op == "get":  # after the PUTs, which evict as the pool fills
                            for b in benches:
                                b.prepare_get(size, threads)
                        reps: dict[str, list[Cell]] = {}
                        for _ in range(args.repeat):
                            for m in [*ceils, *benches]:
                                reps.setdefault(m.name, []).append(m.measure(op, size, threads, args.duration))
                        for c in ceils:
                            ceilings.append(_median_cell(reps[c.name]))
                        for b in benches:
                            results.append(_median_cell(reps[b.name]))
                    if args.verbose:
                        print(f"  done: {servers} server(s), {threads} thread(s), {_size_label(size)}", file=sys.stderr)
            for b in benches:
                b.check_up()
        finally:
            for m in reversed(opened):
                m.close()
    index = {(c.name, c.op, c.size, c.threads, c.servers): c for c in ceilings}
    for r in results:
        for cname in ceiling_names:
            ceil = index.get((cname, r.op, r.size, r.threads, r.servers))
            if ceil is not None and ceil.gbps > 0:
                r.ratio[cname] = r.gbps / ceil.gbps
    target = None
    for r in results:
        if (r.name, r.op, r.size, r.threads, r.servers) == ("tcp", "get", MiB, 1, 1):
            ratio = r.ratio.get(REFERENCE_CEILING)
            target = {"cell": "tcp GET 1 MiB, 1 thread, 1 server", "ratio": ratio, "goal": 0.5,
                      "met": ratio is not None and ratio >= 0.5}
    return {
        "benchmark": "transport",
        "meta": {
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "duration_s": args.duration, "repeat": args.repeat, "statistic": "median of repeats",
            "capacity_per_server": args.capacity, "quick": args.quick, "transports": names,
            "ceilings": ceiling_names, "blocks_per_call": 1, "argv": sys.argv[1:],
        },
        "ceilings": [asdict(c) for c in ceilings],
        "results": [asdict(r) for r in results],
        "target": target,
    }


def _size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def print_table(report: dict) -> None:
    ceil = {(c["op"], c["size"], c["threads"], c["servers"]): c for c in report["ceilings"] if c["name"] == REFERENCE_CEILING}
    hdr = (f"{'transport':<10} {'srv':>3} {'thr':>3} {'op':<4} {'block':>7} {'GB/s':>7} {'p50 us':>8} {'p99 us':>8} "
           f"{'ceil GB/s':>9} {'ceil p50':>8} {'ratio':>6} {'miss':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in report["results"]:
        c = ceil.get((r["op"], r["size"], r["threads"], r["servers"]), {})
        print(f"{r['name']:<10} {r['servers']:>3} {r['threads']:>3} {r['op']:<4} {_size_label(r['size']):>7} "
              f"{r['gbps']:>7.2f} {r['p50_us']:>8.0f} {r['p99_us']:>8.0f} {c.get('gbps', float('nan')):>9.2f} "
              f"{c.get('p50_us', float('nan')):>8.0f} {r['ratio'].get(REFERENCE_CEILING, float('nan')):>6.2f} {r['misses']:>5}")
    others = sorted({c["name"] for c in report["ceilings"]} - {REFERENCE_CEILING})
    for name in others:
        print(f"\nceiling {name}:")
        for c in report["ceilings"]:
            if c["name"] == name:
                print(f"  srv {c['servers']} thr {c['threads']} {c['op']:<4} {_size_label(c['size']):>7} "
                      f"{c['gbps']:7.2f} GB/s p50 {c['p50_us']:.0f} us")
    t = report.get("target")
    if t:
        print(f"\ntarget: {t['cell']}: {t['ratio']:.2f}x the python-socket ceiling (goal >= {t['goal']}x): "
              f"{'met' if t['met'] else 'NOT met'}")


def _sizes(text: str) -> list[int]:
    from ..config import parse_size

    return [parse_size(s) for s in text.split(",") if s]


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench transport", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES, help="comma list, e.g. 64KiB,1MiB")
    ap.add_argument("--threads", type=_ints, default=[1, 4], help="comma list of client thread counts")
    ap.add_argument("--servers", type=_ints, default=[1, 2], help="comma list of server counts")
    ap.add_argument("--transports", type=lambda s: s.split(","), default=None,
                    help="comma list (default: every available transport)")
    ap.add_argument("--ceilings", type=lambda s: s.split(","), default=None,
                    help=f"comma list (default: all registered: {', '.join(CEILINGS)})")
    ap.add_argument("--duration", type=float, default=0.5, help="seconds per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions per cell; the median is reported")
    ap.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    ap.add_argument("--capacity", default="256MiB", help="capacity of each server")
    ap.add_argument("--quick", action="store_true", help="short cells (0.15 s, 1 repeat) for a fast run")
    ap.add_argument("--out", default="bench-results/transport.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 0.15)
        args.repeat = 1
    if args.duration <= 0 or args.repeat < 1:
        ap.error("--duration must be > 0 and --repeat >= 1")
    bad = [s for s in args.sizes if not 0 < s <= _RAW_MAX]
    if bad:
        ap.error(f"block sizes must be in 1..{_RAW_MAX} bytes: {bad}")
    unknown = [c for c in (args.ceilings or []) if c not in CEILINGS]
    if unknown:
        ap.error(f"unknown ceilings {unknown}; registered: {list(CEILINGS)}")
    report = run(args)
    print_table(report)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
