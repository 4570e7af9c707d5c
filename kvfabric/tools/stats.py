"""``kvfabric stats HOST:PORT...`` and ``kvfabric top HOST:PORT...``: watch running pool servers.

``stats`` asks every server for STATS once (through the public
:class:`kvfabric.Client`, so auth and transports work as for an engine) and
prints one row per server: objects, bytes used / capacity, hit rate, bytes in
and out, connections, evictions, checksum failures, errors; ``--json`` prints
the whole answer instead. ``top`` does the same every ``--interval`` seconds
and shows rates between two samples (GB/s in and out, hits/s, and the GET
service-time p99 as the bound of its log2 bucket), until Ctrl-C or
``--count`` refreshes. With no address, the servers of ``KVFABRIC_SERVERS``.
Options and environment as every tool (``kvfabric/tools/connect.py``:
``--token``/``--token-file``/``$KVFABRIC_AUTH_TOKEN``, ``--timeout``); always
over tcp. A server that does not answer (or refuses the token) is a row that
says why; when none answers, one line per server on stderr
(``kvfabric stats: 127.0.0.1:7070: authentication failed (wrong or missing
--token)``) and exit status 1; 2 for bad arguments, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from ..client import Client
from ..config import ClientConfig
from ..metrics import LAT_BOUNDS_US, lat_quantile
from .connect import FAILED, ToolError, add_options, addresses, client_config, describe, open_client, quiet_logs, run

COLUMNS = ("server", "objects", "used", "capacity", "hit%", "in", "out", "conns", "evict", "csum_fail", "errors")
RATE_COLUMNS = ("server", "objects", "used", "hit%", "GB/s in", "GB/s out", "hits/s", "conns", "errors",
                "get p99 ms")


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5K"``; binary units, one decimal."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def hit_rate(st: Mapping[str, Any]) -> str:
    hits, misses = int(st.get("hits", 0)), int(st.get("misses", 0))
    return f"{100.0 * hits / (hits + misses):.1f}" if hits + misses else "-"


def error_count(st: Mapping[str, Any]) -> int:
    errors = st.get("errors", {})
    return sum(int(v) for v in errors.values()) if isinstance(errors, Mapping) else 0


def stats_rows(servers: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """One row of :data:`COLUMNS` per server (``servers``: ``Client.stats()["servers"]``)."""
    rows = []
    for address, st in servers.items():
        if "error" in st:
            rows.append((address, f"unreachable: {st['error']}"))
            continue
        rows.append((
            address, str(st.get("objects", 0)), human_bytes(st.get("bytes_used", 0)),
            human_bytes(st.get("capacity", 0)), hit_rate(st), human_bytes(st.get("bytes_in", 0)),
            human_bytes(st.get("bytes_out", 0)), str(st.get("connections", 0)), str(st.get("evictions", 0)),
            str(st.get("checksum_failures", 0)), str(error_count(st)),
        ))
    return rows


def rate_rows(before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]],
              seconds: float) -> list[tuple[str, ...]]:
    """One row of :data:`RATE_COLUMNS` per server from two samples ``seconds`` apart."""
    rows = []
    for address, st in after.items():
        prev = before.get(address, {})
        if "error" in st:
            rows.append((address, f"unreachable: {st['error']}"))
            continue
        if "error" in prev or seconds <= 0:
            prev = st

        def rate(name: str) -> float:
            return max(0, int(st.get(name, 0)) - int(prev.get(name, 0))) / seconds if seconds > 0 else 0.0

        rows.append((
            address, str(st.get("objects", 0)), human_bytes(st.get("bytes_used", 0)), hit_rate(st),
            f"{rate('bytes_in') / 1e9:.3f}", f"{rate('bytes_out') / 1e9:.3f}", f"{rate('hits'):.0f}",
            str(st.get("connections", 0)), str(error_count(st)), get_p99(prev, st),
        ))
    return rows


def get_p99(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """GET service-time p99 between two samples, as the upper bound of its log2 bucket in ms ("-": no GETs,
    or a server without the histograms)."""
    a, b = after.get("lat_get_us_buckets"), before.get("lat_get_us_buckets")
    if not isinstance(a, list):
        return "-"
    delta = [x - y for x, y in zip(a, b)] if isinstance(b, list) and len(b) == len(a) and b is not a else a
    p99 = lat_quantile([max(0, int(d)) for d in delta], 0.99)
    if p99 is None:
        return "-"
    return f"<{p99 * 1000:g}" if p99 != float("inf") else f">{LAT_BOUNDS_US[-1] / 1000:g}"


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned numbers; a short row (an error) runs on."""
    widths = [len(c) for c in columns]
    for row in rows:
        if len(row) == len(columns):
            widths = [max(w, len(v)) for w, v in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(columns)]
    for row in rows:
        out.append(line(row) if len(row) == len(columns) else f"{row[0].ljust(widths[0])}  {' '.join(row[1:])}")
    return "\n".join(out)


def _parser(prog: str, top: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog="Exit status: 0 a server answered, 1 none did, 2 bad arguments.")
    p.add_argument("servers", nargs="*", metavar="HOST:PORT", help="pool servers (default: $KVFABRIC_SERVERS)")
    add_options(p, transport=False)
    if top:
        p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
        p.add_argument("--count", type=int, default=0, help="refreshes before exiting (default 0: until Ctrl-C)")
    else:
        p.add_argument("--json", action="store_true", help="print the whole STATS answer as JSON")
    return p


def _config(args: argparse.Namespace, environ: Mapping[str, str] | None) -> ClientConfig:
    # tcp: any server answers it, and a watcher should not map an arena or register buffers
    servers = addresses(args.servers)
    # replicas=1: STATS asks every server whatever KVFABRIC_REPLICAS says, even a single one
    return client_config(args, servers, transport="tcp", environ=environ).with_(replicas=1)


def _sample(client: Client, cfg: ClientConfig) -> dict[str, Any]:
    """One STATS of every server; an error entry says what happened in words (``describe``)."""
    servers = client.stats(timeout_s=cfg.timeout_s)["servers"]
    return {a: {"error": describe(st["error"], cfg.timeout_s)} if "error" in st else st for a, st in servers.items()}


def _none_answered(servers: Mapping[str, Mapping[str, Any]]) -> ToolError:
    return ToolError([f"{a}: {st['error']}" for a, st in servers.items()], FAILED)


def stats_main(argv: Sequence[str], out: TextIO = sys.stdout, environ: Mapping[str, str] | None = None) -> int:
    """``kvfabric stats``; returns the exit status."""
    args = _parser("kvfabric stats", top=False).parse_args(list(argv))
    quiet_logs(args.verbose)
    return run("kvfabric stats", lambda: _stats(args, out, environ))


def _stats(args: argparse.Namespace, out: TextIO, environ: Mapping[str, str] | None) -> int:
    cfg = _config(args, environ)
    with open_client(cfg) as client:
        servers = _sample(client, cfg)
    if not any("error" not in st for st in servers.values()):
        raise _none_answered(servers)
    if args.json:
        print(json.dumps(servers, indent=2, sort_keys=True, default=str), file=out)
    else:
        print(format_table(COLUMNS, stats_rows(servers)), file=out)
    return 0


def top_main(argv: Sequence[str], out: TextIO = sys.stdout, environ: Mapping[str, str] | None = None) -> int:
    """``kvfabric top``; returns the exit status (0 after Ctrl-C or --count refreshes)."""
    args = _parser("kvfabric top", top=True).parse_args(list(argv))
    quiet_logs(args.verbose)
    if args.interval <= 0:
        print("kvfabric top: --interval must be > 0", file=sys.stderr)
        return 2
    return run("kvfabric top", lambda: _top(args, out, environ))


def _top(args: argparse.Namespace, out: TextIO, environ: Mapping[str, str] | None) -> int:
    cfg = _config(args, environ)
    shown = 0
    with open_client(cfg) as client:
        before, t0 = _sample(client, cfg), time.monotonic()
        if not any("error" not in st for st in before.values()):
            raise _none_answered(before)
        try:
            while not args.count or shown < args.count:
                time.sleep(args.interval)
                after, t1 = _sample(client, cfg), time.monotonic()
                if out.isatty():
                    out.write("\x1b[H\x1b[2J")
                stamp = time.strftime("%H:%M:%S")
                print(f"kvfabric top  {stamp}  every {args.interval:g}s\n"
                      + format_table(RATE_COLUMNS, rate_rows(before, after, t1 - t0)), file=out, flush=True)
                before, t0 = after, t1
                shown += 1
        except KeyboardInterrupt:
            pass
    return 0
