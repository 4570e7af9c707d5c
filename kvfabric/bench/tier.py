"""``kvfabric bench tier``: the SSD tier of a real pool server against the raw O_DIRECT ceiling (issue 11).

Three measurements, each through real ``kvfabric serve --ssd-path DIR
--ssd-capacity SIZE`` processes on loopback, and the ceiling in the same run:

1. **SSD GET** of ``--object-mib`` (1 MiB) objects. One server with a small
   DRAM arena (``--dram-mib``) and an SSD tier in ``--dir``; ``--working-set``
   objects (several times the DRAM) are PUT, the write-behind queue is left
   to drain (STATS ``ssd_queue_bytes`` 0, ``ssd_writes`` steady), then GETs
   walk the working set in a cycle, ``--batch`` keys per GET. With an LRU
   DRAM smaller than the cycle, every GET's objects were evicted since their
   last GET, so each is a true SSD read (then promoted); the STATS delta
   ``ssd_hits`` per object fetched is printed beside it (``ssd/get``), and
   every byte is checked. The **ceiling** is :func:`kvfabric._native.direct_read_ceiling`:
   io_uring O_DIRECT reads of the same size from registered aligned buffers,
   depth = the batch, on a file of ``--ceiling-mib`` written once (before
   the first cell) in the same directory (same filesystem).
   Cells are interleaved repeat by repeat (``--repeat``); the median repeat is
   reported. Beside each, the same GETs of objects that stay in DRAM (the
   request path without the tier). Target: SSD GET GB/s >= 0.8x the ceiling.
2. **DRAM PUT p99 with write-behind**: two servers with the same DRAM, one
   with the tier, one without; ``--puts`` PUTs of distinct objects go to them
   alternately (so both see the same machine load), well past the DRAM so
   the tiered one writes behind all along, ``--repeat`` times; p99 over all
   of them (a p99 of 200 was the second-largest sample: one CPU stall of a
   loaded machine), the per-repeat ratios and the servers' own PUT service
   time p99 (STATS ``lat_put_us_buckets``) beside it. Target: p99 on <= 1.2x p99 off.
3. **Restart**: one tiered server gets ``--restart-objects`` PUTs; its
   STATS ``ssd_objects`` is read once the write queue drained (``drained``
   row) or at once (``during writes`` row: the kill lands while the
   write-behind still runs); SIGKILL; a new server on the same directory;
   every key is GET and checked. served = objects returned with the right
   bytes / the larger of ``ssd_objects`` before the kill and after the
   restart (writes queued at the STATS read may land before the kill); wrong
   = objects returned with other bytes (a torn or corrupt record must be a
   miss). Target: >= 99% served, 0 wrong.

Where the server has no SSD tier (``kvfabric serve --help`` lists no
``--ssd-path``), the ceiling is still measured and printed, every server row
says why it was not measured, and the exit status is 1: no figure is made up.
Writes ``--json`` (bench-results/tier.json). ``--quick`` is a small run
(about half a minute) for tests.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import write_json
from ._servers import percentile
from ._tiers import ssd_geometry, tier_args, tier_stats, tier_unsupported

TARGET_GET_RATIO = 0.8
TARGET_PUT_P99_RATIO = 1.2
TARGET_RESTART_SERVED = 0.99
MIB = 1 << 20


def _key(tag: str, i: int) -> bytes:
    import hashlib

    return hashlib.blake2b(f"kvfabric-bench-tier/{tag}/{i}".encode(), digest_size=16).digest()


def _payload(key: bytes, nbytes: int) -> bytes:
    from .replay import payload_for

    return payload_for(key, nbytes)


def _lat(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "p50_us": percentile(s, 0.5) * 1e6, "p99_us": percentile(s, 0.99) * 1e6,
            "mean_us": statistics.fmean(s) * 1e6}


class TierError(RuntimeError):
    """A measurement that could not be made (server without a tier, a STATS key missing, a timeout)."""


def _stats(client: Any) -> dict[str, Any]:
    servers = client.stats(timeout_s=30).get("servers", {})
    st = next(iter(servers.values()), None)
    if not isinstance(st, dict) or "error" in st:
        raise TierError(f"no STATS from the server: {st!r}")
    return st


def _wait_drained(client: Any, timeout_s: float = 180.0) -> dict[str, Any]:
    """Poll STATS until the write-behind queue is empty and ``ssd_writes`` stops moving; the last STATS."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        st = _stats(client)
        if "ssd_queue_bytes" not in st or "ssd_writes" not in st:
            raise TierError(f"the server's STATS have no ssd_queue_bytes/ssd_writes: {sorted(st)}")
        now = (st["ssd_queue_bytes"], st["ssd_writes"], st.get("ssd_objects"))
        if now[0] == 0 and now == last:
            return st
        if time.monotonic() > deadline:
            raise TierError(f"write-behind queue did not drain within {timeout_s} s: {now}")
        last = now
        time.sleep(0.3)


def _client(address: str, transport: str):
    from ..client import Client
    from ..config import ClientConfig

    return Client([address], config=ClientConfig(transport=transport, timeout_s=60.0, connect_timeout_s=10.0))


def _put_all(client: Any, keys: list[bytes], nbytes: int, chunk: int = 4) -> None:
    for off in range(0, len(keys), chunk):
        part = keys[off:off + chunk]
        res = client.put(part, [_payload(k, nbytes) for k in part])
        if res.dropped:
            raise TierError(f"{res.dropped} PUTs dropped while filling the server")


def _start(dram: int, ssd_dir: str | None, ssd_bytes: int, server_args: Sequence[str] = ()):
    """One server of ``dram`` bytes, with an SSD tier of ``ssd_bytes`` in ``ssd_dir`` (every object admitted)
    when a directory is given."""
    from ..testing.servers import start_server

    extra = [*(tier_args(ssd_dir, ssd_bytes, "all") if ssd_dir else []), *server_args]
    return start_server(capacity=dram, policy="lru", extra_args=extra, timeout_s=120.0)


class CeilingFile:
    """The raw read loop's file in ``directory`` (written once, unlinked at once); ``close()`` it."""

    def __init__(self, directory: str, obj: int, file_bytes: int) -> None:
        from .. import _native

        self.obj, self.file_bytes = obj, file_bytes
        self.fd = _native.direct_read_file(directory, file_bytes, obj)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def measure_ceiling(cf: CeilingFile, depth: int, reads: int) -> dict[str, Any]:
    """One cell of the raw O_DIRECT read loop: GB/s and per-read latency percentiles."""
    from .. import _native

    obj, file_bytes = cf.obj, cf.file_bytes
    secs, lat_ns = _native.direct_read_ceiling(cf.fd, file_bytes, obj, depth, reads)
    out = _lat([x / 1e9 for x in lat_ns])
    out.update(gb_per_s=reads * obj / secs / 1e9, secs=secs, depth=depth, file_bytes=file_bytes)
    return out


def _ceiling_file(args: argparse.Namespace) -> int:
    """Bytes of the ceiling's file: ``--ceiling-mib`` in whole objects, at least one per read in flight."""
    obj = args.object_mib * MIB
    return max(args.ceiling_mib * MIB // obj, max(args.batch)) * obj


class GetCell:
    """The SSD GET loop on one populated server: cycles over the working set, ``batch`` keys per GET."""

    def __init__(self, client: Any, keys: list[bytes], obj: int) -> None:
        self.client, self.keys, self.obj, self.cursor = client, keys, obj, 0
        self.bufs = [bytearray(obj) for _ in range(64)]

    def run_dram(self, batch: int, gets: int) -> dict[str, Any]:
        """The same GETs of ``batch`` keys that stay in DRAM (fetched again and again): the request path alone."""
        hot = self.keys[:batch]
        views = [memoryview(b) for b in self.bufs[:batch]]
        self.client.get_into(hot, views)  # promoted now if they were on SSD; DRAM hits from here on
        st0 = _stats(self.client)
        lat = []
        for _ in range(gets):
            t0 = time.perf_counter()
            sizes = self.client.get_into(hot, views)
            lat.append(time.perf_counter() - t0)
            if any(n != self.obj for n in sizes):
                raise TierError(f"a DRAM-resident object came back as {sizes}")
        st1 = _stats(self.client)
        out = _lat(lat)
        out.update(batch=batch, gets=gets, gb_per_s=gets * batch * self.obj / sum(lat) / 1e9,
                   ssd_hits=st1.get("ssd_hits", 0) - st0.get("ssd_hits", 0))
        return out

    def run_pipelined(self, address: str, gets: int) -> dict[str, Any]:
        """``gets`` one-key SSD GETs pipelined on one native connection (the transport keeps up to the
        server's ``max_in_flight`` requests outstanding; the server reads ahead as far as its promotion
        cap per connection), checksums computed as the bytes land and checked: what the server streams
        to a client that pipelines its GETs (the ``kvfabric.Client`` sends one request per call)."""
        from ..protocol import GetRequest
        from ..transport import native as tn

        part = [self.keys[(self.cursor + j) % len(self.keys)] for j in range(gets)]
        self.cursor = (self.cursor + gets) % len(self.keys)
        views = [memoryview(b) for b in self.bufs]  # reused in order: at most len(bufs) replies outstanding
        wrong = missing = 0
        st0 = _stats(self.client)
        with tn.connect(address, timeout_s=60) as conn:
            window = conn.hello.limits.max_in_flight
            if window > len(views):
                raise TierError(f"the server allows {window} requests in flight, the bench has {len(views)} buffers")
            reqs = [(GetRequest(keys=[k], client_verifies=True), (), [views[i % len(views)]])
                    for i, k in enumerate(part)]
            t0 = time.perf_counter()
            replies = conn.pipeline(reqs, deadline=time.monotonic() + 120, checksums=True)
            total = time.perf_counter() - t0
        for k, r in zip(part, replies):
            if r.msg.sizes[0] < 0:
                missing += 1
            elif r.msg.sizes[0] != self.obj or r.checksums[0] != r.msg.checksums[0]:
                wrong += 1  # the bytes themselves: checked through their checksum (the buffers are reused)
        st1 = _stats(self.client)
        out = {"gets": gets, "window": window, "gb_per_s": (gets - missing) * self.obj / total / 1e9,
               "missing": missing, "wrong": wrong, "secs": total,
               "ssd_hits": st1.get("ssd_hits", 0) - st0.get("ssd_hits", 0)}
        out["ssd_per_object"] = out["ssd_hits"] / gets if gets else None
        return out

    def run(self, batch: int, gets: int) -> dict[str, Any]:
        views = [memoryview(b) for b in self.bufs[:batch]]
        lat, wrong, missing = [], 0, 0
        st0 = _stats(self.client)
        for _ in range(gets):
            part = [self.keys[(self.cursor + j) % len(self.keys)] for j in range(batch)]
            self.cursor = (self.cursor + batch) % len(self.keys)
            t0 = time.perf_counter()
            sizes = self.client.get_into(part, views)
            lat.append(time.perf_counter() - t0)
            for k, v, n in zip(part, views, sizes):
                if n is None:
                    missing += 1
                elif n != self.obj or v != _payload(k, self.obj):
                    wrong += 1
        st1 = _stats(self.client)
        fetched = gets * batch
        total = sum(lat)
        out = _lat(lat)
        out.update(batch=batch, gets=gets, objects=fetched, gb_per_s=(fetched - missing) * self.obj / total / 1e9,
                   missing=missing, wrong=wrong,
                   ssd_hits=st1.get("ssd_hits", 0) - st0.get("ssd_hits", 0),
                   ssd_reads=st1.get("ssd_reads", 0) - st0.get("ssd_reads", 0),
                   ssd_writes=st1.get("ssd_writes", 0) - st0.get("ssd_writes", 0),
                   ssd_misses=st1.get("ssd_misses", 0) - st0.get("ssd_misses", 0))
        read_us = st1.get("ssd_read_us_total", 0) - st0.get("ssd_read_us_total", 0)
        out["ssd_per_object"] = out["ssd_hits"] / fetched if fetched else None
        # where a GET's time goes: the tier thread's read of one record (post to verified), server side
        out["server_read_us"] = read_us / out["ssd_reads"] if out["ssd_reads"] else None
        return out


def _median_cell(cells: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(cells, key=lambda c: c["gb_per_s"])
    out = dict(ranked[len(ranked) // 2])
    out["repeats_gb_per_s"] = [c["gb_per_s"] for c in cells]
    return out


def bench_get(args: argparse.Namespace, base: str, log) -> dict[str, Any]:
    obj, dram = args.object_mib * MIB, args.dram_mib * MIB
    ssd_dir = os.path.join(base, "get")
    os.makedirs(ssd_dir, exist_ok=True)
    keys = [_key("get", i) for i in range(args.working_set)]
    ceilings: dict[int, list] = {b: [] for b in args.batch}
    cells: dict[int, list] = {b: [] for b in args.batch}
    drams: dict[int, list] = {b: [] for b in args.batch}  # the same GET path with the objects in DRAM
    piped: list = []  # one-key GETs pipelined on one connection ...
    piped_ceil: list = []  # ... and the raw loop at the depth the server reads ahead for one connection
    ahead = max(1, (args.dram_mib // 4) // args.object_mib)  # the promotion cap (a quarter of DRAM) in objects
    srv = _start(dram, ssd_dir, ssd_geometry(2 * args.working_set, obj)[0], args.server_args)
    try:
        with _client(srv.address, args.transport) as client:
            print(f"[tier] SSD GET: filling {args.working_set} x {args.object_mib} MiB, DRAM {args.dram_mib} MiB",
                  file=log)
            _put_all(client, keys, obj)
            filled = _wait_drained(client)
            if not filled.get("ssd_objects"):
                raise TierError(f"nothing reached the SSD tier after {args.working_set} PUTs: "
                                f"{ {k: v for k, v in filled.items() if k.startswith('ssd_')} }")
            cell = GetCell(client, keys, obj)
            cell.run(1, min(len(keys), 8))  # connections and the cycle's start, not measured
            cf = CeilingFile(ssd_dir, obj, _ceiling_file(args))  # written once, before any cell
            try:
                for rep in range(args.repeat):
                    for b in args.batch:
                        ceilings[b].append(measure_ceiling(cf, b, args.gets * b))
                        cells[b].append(cell.run(b, args.gets))
                        drams[b].append(cell.run_dram(b, args.gets))
                    if args.transport == "native":
                        piped_ceil.append(measure_ceiling(cf, ahead, args.gets * max(args.batch)))
                        piped.append(cell.run_pipelined(srv.address, args.gets * max(args.batch)))
                    print(f"[tier] SSD GET repeat {rep + 1}/{args.repeat} done", file=log)
            finally:
                cf.close()
            final = _stats(client)
    finally:
        srv.stop()
    rows = []
    for b in args.batch:
        c, ceil = _median_cell(cells[b]), _median_cell(ceilings[b])
        ratio = c["gb_per_s"] / ceil["gb_per_s"] if ceil["gb_per_s"] else None
        dram = _median_cell(drams[b])
        # the repeat's own ceiling for each ratio (the disk's speed moves between repeats)
        ratios = [x["gb_per_s"] / y["gb_per_s"] for x, y in zip(cells[b], ceilings[b]) if y["gb_per_s"]]
        row = {"batch": b, "server": c, "ceiling": ceil, "ratio": ratio, "repeat_ratios": ratios, "dram": dram,
               "dram_ratio": dram["gb_per_s"] / ceil["gb_per_s"] if ceil["gb_per_s"] else None,
               "target_met": ratio is not None and ratio >= TARGET_GET_RATIO and c["wrong"] == 0
               and c["missing"] == 0}
        rows.append(row)
    pipelined = None
    if piped:
        pc, pceil = _median_cell(piped), _median_cell(piped_ceil)
        pipelined = {"server": pc, "ceiling": pceil, "depth": ahead,
                     "ratio": pc["gb_per_s"] / pceil["gb_per_s"] if pceil["gb_per_s"] else None,
                     "repeat_ratios": [x["gb_per_s"] / y["gb_per_s"] for x, y in zip(piped, piped_ceil)
                                       if y["gb_per_s"]]}
    return {"rows": rows, "pipelined": pipelined, "ssd_after_fill": {k: v for k, v in filled.items() if k.startswith("ssd_")},
            "ssd_final": tier_stats({"s": final})}


def bench_put(args: argparse.Namespace, base: str, log) -> dict[str, Any]:
    obj, dram = args.object_mib * MIB, args.dram_mib * MIB
    ssd_dir = os.path.join(base, "put")
    os.makedirs(ssd_dir, exist_ok=True)
    off = _start(dram, None, 0, args.server_args)
    try:
        on = _start(dram, ssd_dir, ssd_geometry(args.puts + 8, obj)[0], args.server_args)
    except BaseException:
        off.stop()
        raise
    lat: dict[str, list[float]] = {"off": [], "on": []}
    per_rep: list[dict[str, float]] = []
    server_p99: dict[str, list] = {"off": [], "on": []}
    try:
        with _client(off.address, args.transport) as c_off, _client(on.address, args.transport) as c_on:
            clients = {"off": c_off, "on": c_on}
            st0 = _stats(c_on)
            print(f"[tier] DRAM PUT: {args.repeat} x {args.puts} PUTs of {args.object_mib} MiB to each server, "
                  f"alternating", file=log)
            for rep in range(args.repeat):
                rep_lat: dict[str, list[float]] = {"off": [], "on": []}
                b0 = {n: _stats(c).get("lat_put_us_buckets") for n, c in clients.items()}
                for i in range(args.puts):
                    order = ("off", "on") if i % 2 == 0 else ("on", "off")
                    for name in order:
                        k = _key(f"put-{name}-{rep}", i)
                        data = _payload(k, obj)
                        t0 = time.perf_counter()
                        res = clients[name].put([k], [data])
                        rep_lat[name].append(time.perf_counter() - t0)
                        if res.dropped:
                            raise TierError(f"a PUT to the tier-{name} server was dropped")
                for name, c in clients.items():
                    lat[name] += rep_lat[name]
                    server_p99[name].append(_bucket_p99(b0[name], _stats(c).get("lat_put_us_buckets")))
                p_off = _lat(rep_lat["off"])["p99_us"]
                per_rep.append({"off_p99_us": p_off, "on_p99_us": _lat(rep_lat["on"])["p99_us"]})
            st1 = _stats(c_on)
    finally:
        off.stop()
        on.stop()
    l_off, l_on = _lat(lat["off"]), _lat(lat["on"])
    ratio = l_on["p99_us"] / l_off["p99_us"] if l_off["p99_us"] else None
    writes = st1.get("ssd_writes", 0) - st0.get("ssd_writes", 0)
    return {"off": l_off, "on": l_on, "p99_ratio": ratio, "p50_ratio": l_on["p50_us"] / l_off["p50_us"],
            "repeat_p99_ratios": [r["on_p99_us"] / r["off_p99_us"] for r in per_rep if r["off_p99_us"]],
            "server_p99_us_below": server_p99,
            "ssd_writes_during": writes, "ssd_write_drops_during":
                st1.get("ssd_write_drops", 0) - st0.get("ssd_write_drops", 0),
            "target_met": ratio is not None and ratio <= TARGET_PUT_P99_RATIO and writes > 0}


def _bucket_p99(before: list[int] | None, after: list[int] | None) -> int | None:
    """The server's own PUT service time (header in .. reply queued) at p99 over a STATS delta: the upper
    bound in us of the histogram bucket it falls in (bucket b holds times below 2**b us)."""
    if not before or not after:
        return None
    d = [a - b for a, b in zip(after, before)]
    total, acc = sum(d), 0
    for b, n in enumerate(d):
        acc += n
        if total and acc >= 0.99 * total:
            return 1 << b
    return None


def bench_restart(args: argparse.Namespace, base: str, drain: bool, log) -> dict[str, Any]:
    obj, dram = args.object_mib * MIB, args.dram_mib * MIB
    tag = "drained" if drain else "during-writes"
    ssd_dir = os.path.join(base, f"restart-{tag}")
    os.makedirs(ssd_dir, exist_ok=True)
    keys = [_key(f"restart-{tag}", i) for i in range(args.restart_objects)]
    ssd_bytes = ssd_geometry(2 * len(keys), obj)[0]
    srv = _start(dram, ssd_dir, ssd_bytes, args.server_args)
    try:
        with _client(srv.address, args.transport) as client:
            print(f"[tier] restart ({tag}): {len(keys)} PUTs, then SIGKILL", file=log)
            _put_all(client, keys, obj)
            before = _wait_drained(client) if drain else _stats(client)
    except BaseException:
        srv.kill()
        raise
    srv.kill()
    t0 = time.perf_counter()
    srv2 = _start(dram, ssd_dir, ssd_bytes, args.server_args)
    start_s = time.perf_counter() - t0
    try:
        with _client(srv2.address, args.transport) as client:
            after = _stats(client)
            served = wrong = 0
            buf = bytearray(obj)
            for k in keys:
                (n,) = client.get_into([k], [memoryview(buf)])
                if n is None:
                    continue
                if n == obj and buf == _payload(k, obj):
                    served += 1
                else:
                    wrong += 1
            final = _stats(client)
    finally:
        srv2.stop()
    # Writes still queued at the STATS read may land before the kill: the rebuilt index can hold more than
    # ssd_objects said, so the denominator is the larger of the two (never a fraction over 100%).
    written = max(before.get("ssd_objects", 0), after.get("ssd_objects", 0))
    frac = served / written if written else None
    return {"mode": tag, "objects_put": len(keys), "ssd_objects_before_kill": before.get("ssd_objects"),
            "denominator": written,
            "ssd_writes_before_kill": before.get("ssd_writes"), "ssd_queue_bytes_at_kill": before.get("ssd_queue_bytes"),
            "ssd_objects_after_restart": after.get("ssd_objects"), "restart_to_listening_s": start_s,
            "served": served, "wrong": wrong, "served_fraction": frac,
            "ssd_corrupt_after": final.get("ssd_corrupt"), "ssd_errors_after": final.get("ssd_errors"),
            "target_met": frac is not None and frac >= TARGET_RESTART_SERVED and wrong == 0}


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 or x > 64 for x in out):
        raise argparse.ArgumentTypeError(f"batches must be in 1..64, got {text!r}")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfabric bench tier", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None,
                   help="directory on the filesystem to measure (the servers' --ssd-path go below it; default: a "
                        "temp dir under /tmp, removed afterwards)")
    p.add_argument("--object-mib", type=int, default=1, help="object size in MiB (default 1)")
    p.add_argument("--dram-mib", type=int, default=32, help="each server's DRAM arena in MiB (default 32)")
    p.add_argument("--working-set", type=int, default=192, help="objects cycled by the SSD GETs (default 192)")
    p.add_argument("--gets", type=int, default=64, help="GETs per cell and repeat (default 64)")
    p.add_argument("--batch", type=_ints, default=[1, 4],
                   help="keys per GET = the ceiling's queue depth, comma-separated (default 1,4)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats of every GET cell (default 3)")
    p.add_argument("--ceiling-mib", type=int, default=256, help="size of the ceiling's file in MiB (default 256)")
    p.add_argument("--puts", type=int, default=400,
                   help="PUTs to each of the two servers per repeat (default 400; --repeat repeats, pooled for p99)")
    p.add_argument("--restart-objects", type=int, default=128, help="objects stored before the SIGKILL (default 128)")
    p.add_argument("--transport", default="native", help="client transport (default native)")
    p.add_argument("--parts", default="get,put,restart", help="comma-separated subset of get,put,restart")
    p.add_argument("--server-args", type=shlex.split, default=[], metavar="ARGS",
                   help='extra arguments for every server started, e.g. "--huge-pages on"')
    p.add_argument("--quick", action="store_true", help="small sizes for a test run (~30 s)")
    p.add_argument("--json", default="bench-results/tier.json")
    args = p.parse_args(argv)
    if args.quick:
        args.dram_mib, args.working_set, args.gets, args.repeat = 32, 72, 12, 1
        args.ceiling_mib, args.puts, args.restart_objects, args.batch = 32, 60, 64, [1, 4]
    args.parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in args.parts if x not in ("get", "put", "restart")]
    if bad or not args.parts:
        p.error(f"--parts takes get, put, restart; got {bad or 'nothing'}")
    if min(args.object_mib, args.dram_mib, args.gets, args.repeat, args.puts, args.restart_objects) < 1:
        p.error("sizes and counts must be >= 1")
    if args.working_set * args.object_mib < 2 * args.dram_mib:
        p.error("--working-set x --object-mib must be at least twice --dram-mib, or GETs would hit DRAM")
    return args


def _fmt(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_report(rep: dict[str, Any], out=None) -> None:
    out = out or sys.stdout
    print(f"kvfabric bench tier: {rep['object_mib']} MiB objects, DRAM {rep['dram_mib']} MiB, dir {rep['dir']} "
          f"({rep['filesystem']}); load {rep['load_before']} -> {rep['load_after']}"
          f"{'; servers ' + ' '.join(rep['server_args']) if rep.get('server_args') else ''}", file=out)
    for part, err in rep["errors"].items():
        print(f"  {part}: NOT MEASURED: {err}", file=out)
    get = rep.get("get")
    if get:
        print(f"\nSSD GET vs raw io_uring O_DIRECT reads (median of {rep['repeat']} interleaved repeats)", file=out)
        print(f"{'batch':>5} {'server GB/s':>11} {'p50 us':>8} {'p99 us':>8} {'read us':>7} {'ssd/get':>7} {'wrong':>5} | "
              f"{'depth':>5} {'ceil GB/s':>9} {'p50 us':>8} {'p99 us':>8} | {'ratio':>6} target", file=out)
        for r in get["rows"]:
            s, c = r["server"], r["ceiling"]
            print(f"{r['batch']:>5} {s['gb_per_s']:>11.3f} {s['p50_us']:>8.0f} {s['p99_us']:>8.0f} "
                  f"{_fmt(s['server_read_us'], '.0f'):>7} "
                  f"{_fmt(s['ssd_per_object'], '.2f'):>7} {s['wrong'] + s['missing']:>5} | {c['depth']:>5} "
                  f"{c['gb_per_s']:>9.3f} {c['p50_us']:>8.0f} {c['p99_us']:>8.0f} | {_fmt(r['ratio'], '.2f'):>5}x "
                  f">= {TARGET_GET_RATIO}x: {'met' if r['target_met'] else 'NOT met'}", file=out)
        for r in get["rows"]:
            rr = ", ".join(f"{x:.2f}" for x in r.get("repeat_ratios", []))
            print(f"  {r['batch']} key(s) per GET: ratio per repeat (each against its own ceiling) {rr}", file=out)
        for r in get["rows"]:
            d = r.get("dram")
            if d:
                print(f"  the same {r['batch']}-key GET of objects in DRAM: {d['gb_per_s']:.3f} GB/s "
                      f"= {_fmt(r.get('dram_ratio'), '.2f')}x the ceiling (the bound of a serial client), p50 "
                      f"{d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us (ssd hits meanwhile {d['ssd_hits']})", file=out)
        pl = get.get("pipelined")
        if pl:
            pc, pceil = pl["server"], pl["ceiling"]
            rr = ", ".join(f"{x:.2f}" for x in pl["repeat_ratios"])
            print(f"  one-key SSD GETs pipelined on one native connection (up to {pc['window']} requests "
                  f"outstanding; the server reads ahead {pl['depth']} objects, its promotion cap): "
                  f"{pc['gb_per_s']:.3f} GB/s vs the raw loop at depth {pl['depth']} {pceil['gb_per_s']:.3f} GB/s = "
                  f"{_fmt(pl['ratio'], '.2f')}x (repeats {rr}); ssd/get {_fmt(pc['ssd_per_object'], '.2f')}, wrong "
                  f"{pc['wrong'] + pc['missing']}", file=out)
        print("read us = the server's mean time per SSD record read (STATS ssd_read_us_total / ssd_reads); ssd/get = "
              "STATS ssd_hits per object fetched (1.00: every object came from the SSD tier); wrong = missing or "
              "other bytes", file=out)
    put = rep.get("put")
    if put:
        print(f"\nDRAM PUT of {rep['object_mib']} MiB, tier off vs on (write-behind: {put['ssd_writes_during']} "
              f"writes, {put['ssd_write_drops_during']} drops during the run)", file=out)
        for name in ("off", "on"):
            x = put[name]
            print(f"  tier {name:>3}: p50 {x['p50_us']:8.0f} us  p99 {x['p99_us']:8.0f} us  ({x['n']} PUTs)", file=out)
        print(f"  p99 on/off {put['p99_ratio']:.2f}x over all {put['on']['n']} PUTs each (p50 {put['p50_ratio']:.2f}x); "
              f"target <= {TARGET_PUT_P99_RATIO}x: {'met' if put['target_met'] else 'NOT met'}", file=out)
        rr = ", ".join(f"{x:.2f}" for x in put.get("repeat_p99_ratios", []))
        sp = put.get("server_p99_us_below", {})
        print(f"  p99 on/off per repeat: {rr}; the servers' own PUT p99 (service time, histogram bucket) per repeat: "
              f"off < {sp.get('off')} us, on < {sp.get('on')} us", file=out)
    for r in rep.get("restart", []):
        print(f"\nrestart after SIGKILL ({r['mode']}): {r['objects_put']} PUT, {r['ssd_objects_before_kill']} on the "
              f"tier before the kill, {r['ssd_objects_after_restart']} indexed after restart "
              f"({r['restart_to_listening_s']:.2f} s to listen); served {r['served']} "
              f"({_fmt(r['served_fraction'], '.1%')} of the tier), wrong bytes {r['wrong']}, ssd_corrupt "
              f"{r['ssd_corrupt_after']}; target >= {TARGET_RESTART_SERVED:.0%} and 0 wrong: "
              f"{'met' if r['target_met'] else 'NOT met'}", file=out)


def _filesystem(path: str) -> str:
    best, fs = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fs = mnt, f"{typ} on {dev}"
    except OSError:
        pass
    return fs


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    log = sys.stderr
    tmp = tempfile.TemporaryDirectory(prefix="kvfabric-bench-tier-", dir=args.dir)
    base = os.path.realpath(tmp.name)
    rep: dict[str, Any] = {"object_mib": args.object_mib, "dram_mib": args.dram_mib, "dir": base,
                           "filesystem": _filesystem(base), "repeat": args.repeat, "quick": args.quick,
                           "working_set": args.working_set, "gets": args.gets, "batch": args.batch,
                           "server_args": args.server_args, "errors": {},
                           "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                           "targets": {"get_ratio": TARGET_GET_RATIO, "put_p99_ratio": TARGET_PUT_P99_RATIO,
                                       "restart_served": TARGET_RESTART_SERVED}}
    reason = tier_unsupported()
    try:
        if reason:
            # No server figure without a tier; the ceiling alone is still a real measurement.
            cf = CeilingFile(base, args.object_mib * MIB, _ceiling_file(args))
            try:
                rep["ceiling_only"] = [measure_ceiling(cf, b, args.gets * b) for b in args.batch]
            finally:
                cf.close()
            for part in args.parts:
                rep["errors"][part] = reason
        else:
            for part, fn in (("get", lambda: bench_get(args, base, log)), ("put", lambda: bench_put(args, base, log)),
                             ("restart", lambda: [bench_restart(args, base, True, log),
                                                  bench_restart(args, base, False, log)])):
                if part not in args.parts:
                    continue
                try:
                    rep[part] = fn()
                except (TierError, RuntimeError, OSError) as e:
                    rep["errors"][part] = f"{type(e).__name__}: {e}"
    finally:
        tmp.cleanup()
    rep["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print_report(rep)
    for c in rep.get("ceiling_only", []):
        print(f"  ceiling alone: depth {c['depth']}: {c['gb_per_s']:.3f} GB/s, p50 {c['p50_us']:.0f} us, "
              f"p99 {c['p99_us']:.0f} us")
    write_json(Path(args.json), rep)
    return 1 if rep["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
