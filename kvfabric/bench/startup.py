"""``kvfabric bench startup``: how soon a fresh pool server answers, at several capacities.

Each trial starts the server (``--server``, default the C server; see
:mod:`kvfabric.bench._servers`) on a port picked beforehand and, from the same
instant, a client that tries to connect every ``--poll-ms`` (1 ms): as soon
as the port accepts TCP it sends a HELLO (``kvfabric.protocol``) and waits
for the reply (``--hello-timeout``, 60 s). Measured from process start
(just before ``fork``):

* ``listen``: the server's ``kvfabric serve: listening on`` line;
* ``accept``: the port accepted the client's TCP connection;
* ``hello``: the HELLO reply arrived;
* ``stall``: a trial whose port accepted TCP but whose HELLO was not
  answered within ``--stall-s`` (1 s) after that, the failure issue 14
  describes: a real client marks such a shard down and drops its puts;
* ``rss``: the server's resident memory right after the HELLO (an arena
  pinned for io_uring shows up here as the whole capacity);
* ``stop``: SIGTERM to exit.

Floors, measured in the same run and interleaved with the trials: the time
to start and exit ``python -c pass``, ``python -c "import kvfabric"`` and
``python -c "import kvfabric.server.native"`` (the interpreter and imports
every Python-launched server pays before it can do anything). Capacities and
floors are interleaved round by round, so load on the machine falls on all
of them alike.

Target (issue 14): first HELLO < 1 s from process start at 3 GiB, no stalls.
Prints a table; writes JSON (``--out``, default bench-results/startup.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from . import write_json
from ..testing.ports import free_port
from ..testing.servers import thread_states
from ._servers import PRESETS, command, read_line, server_env
from .. import protocol
from ..config import parse_size

FLOORS = {
    "python -c pass": "pass",
    "python -c 'import kvfabric'": "import kvfabric",
    "python -c 'import kvfabric.server.native'": "import kvfabric.server.native",
}
TARGET_S = 1.0


@dataclass
class Trial:
    capacity: str
    listen_s: float | None = None
    accept_s: float | None = None
    hello_s: float | None = None
    stalled: bool = False
    stop_s: float | None = None
    rss_mib: float | None = None
    error: str | None = None


@dataclass
class Summary:
    name: str
    trials: int
    ok: int = 0
    stalls: int = 0
    listen_p50_s: float | None = None
    listen_max_s: float | None = None
    accept_p50_s: float | None = None
    hello_p50_s: float | None = None
    hello_max_s: float | None = None
    stop_p50_s: float | None = None
    rss_mib_p50: float | None = None
    errors: list[str] = field(default_factory=list)


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _hello(sock: socket.socket, timeout_s: float) -> None:
    """Send a HELLO and wait up to ``timeout_s`` for its reply; raises on anything but a valid reply."""
    sock.settimeout(timeout_s)
    sock.sendall(protocol.encode_request(protocol.HelloRequest(client="kvfabric-bench-startup"), 1))

    def recv_exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the server closed the connection before its HELLO reply")
            buf += chunk
        return bytes(buf)

    header = protocol.unpack_header(recv_exact(protocol.HEADER_SIZE))
    protocol.decode_reply(header, recv_exact(header.meta_len), protocol.Op.HELLO)


def run_trial(argv_head: list[str], capacity: str, extra: list[str], args: argparse.Namespace) -> Trial:
    """One fresh server: start it, race a client against it, stop it."""
    t = Trial(capacity)
    port = free_port()
    argv = [*argv_head, "--host", "127.0.0.1", "--port", str(port), "--capacity", capacity, *extra]
    err = tempfile.NamedTemporaryFile(prefix="kvfabric-bench-startup-", suffix=".log", delete=False)
    listened: dict[str, object] = {}
    t0 = time.perf_counter()
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=server_env())
    err.close()

    def watch() -> None:
        line = read_line(popen, time.monotonic() + args.hello_timeout)
        listened["at"] = time.perf_counter() - t0
        listened["line"] = line

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    sock = None
    try:
        deadline = time.perf_counter() + args.hello_timeout
        while sock is None:
            if popen.poll() is not None:
                raise RuntimeError(f"the server exited with status {popen.returncode} before accepting")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the port accepted nothing within {args.hello_timeout} s")
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            except (ConnectionRefusedError, socket.timeout):
                time.sleep(args.poll_ms / 1000)
        t.accept_s = time.perf_counter() - t0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _hello(sock, args.hello_timeout)
            t.hello_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - recorded (a reset, a timeout, a bad reply), the run goes on
            t.error = f"HELLO: {type(e).__name__}: {e}"
        t.stalled = t.hello_s is None or t.hello_s - t.accept_s > args.stall_s
        t.rss_mib = _rss_mib(popen.pid)
        watcher.join(args.hello_timeout)
        line = listened.get("line")
        if isinstance(line, str) and line.startswith("kvfabric serve: listening on "):
            t.listen_s = float(listened["at"])  # type: ignore[arg-type]
        elif t.error is None:
            t.error = f"no listening line: {line!r}"
    except Exception as e:  # noqa: BLE001 - a failed trial is reported, not fatal
        t.error = t.error or str(e)
    finally:
        if sock is not None:
            sock.close()
        a = time.perf_counter()
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(args.stop_timeout)
                t.stop_s = time.perf_counter() - a
            except subprocess.TimeoutExpired:
                threads = "; ".join(thread_states(popen.pid, detail=True)) or "none"  # before the SIGKILL
                popen.kill()
                popen.wait()
                t.error = t.error or f"did not exit within {args.stop_timeout:g} s of SIGTERM (threads: {threads})"
        watcher.join(5)
        if popen.stdout is not None:
            popen.stdout.close()
        if t.error:
            try:
                with open(err.name, errors="replace") as f:
                    tail = f.read()[-500:].strip()
                if tail:
                    t.error += f" | stderr: {tail}"
            except OSError:
                pass
        try:
            os.unlink(err.name)
        except OSError:
            pass
    return t


def run_floor(code: str) -> float:
    """Seconds to start and exit ``python -c code``."""
    a = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=server_env(), stdin=subprocess.DEVNULL)
    return time.perf_counter() - a


def _p50(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(name: str, trials: list[Trial]) -> Summary:
    s = Summary(name, len(trials))
    ok = [t for t in trials if t.hello_s is not None]
    s.ok = len(ok)
    s.stalls = sum(t.stalled for t in trials if t.accept_s is not None)
    s.listen_p50_s = _p50([t.listen_s for t in trials if t.listen_s is not None])
    s.listen_max_s = max((t.listen_s for t in trials if t.listen_s is not None), default=None)
    s.accept_p50_s = _p50([t.accept_s for t in trials if t.accept_s is not None])
    s.hello_p50_s = _p50([t.hello_s for t in ok])  # type: ignore[misc]
    s.hello_max_s = max((t.hello_s for t in ok), default=None)  # type: ignore[type-var]
    s.stop_p50_s = _p50([t.stop_s for t in trials if t.stop_s is not None])
    s.rss_mib_p50 = _p50([t.rss_mib for t in trials if t.rss_mib is not None])
    s.errors = [t.error for t in trials if t.error]
    return s


def run(args: argparse.Namespace) -> dict:
    head = command(args.server)
    extra = shlex.split(args.server_args)
    floors: dict[str, list[float]] = {name: [] for name in FLOORS}
    trials: dict[str, list[Trial]] = {c: [] for c in args.capacities}
    for r in range(args.trials):
        for name, code in FLOORS.items():
            floors[name].append(run_floor(code))
        for cap in args.capacities:
            t = run_trial(head, cap, extra, args)
            trials[cap].append(t)
            if args.verbose:
                print(f"round {r + 1} {cap}: {asdict(t)}", flush=True)
    floor_rows = [{"name": n, "p50_s": statistics.median(v), "max_s": max(v), "samples": v} for n, v in floors.items()]
    rows = [asdict(summarize(c, trials[c])) for c in args.capacities]
    ref = statistics.median(floors["python -c 'import kvfabric.server.native'"])
    for row in rows:
        row["hello_over_import_floor"] = None if row["hello_p50_s"] is None else row["hello_p50_s"] / ref
    largest = max(args.capacities, key=parse_size)
    big = next(r for r in rows if r["name"] == largest)
    met = big["ok"] == big["trials"] and big["stalls"] == 0 and big["hello_max_s"] is not None \
        and big["hello_max_s"] < TARGET_S
    return {
        "benchmark": "startup",
        "meta": {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
                 "kernel": platform.release(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                 "server": args.server, "command": shlex.join([*head, *extra]), "trials": args.trials,
                 "poll_ms": args.poll_ms, "stall_s": args.stall_s, "hello_timeout_s": args.hello_timeout,
                 "argv": sys.argv[1:]},
        "floors": floor_rows,
        "rows": rows,
        "trials": {c: [asdict(t) for t in trials[c]] for c in args.capacities},
        "targets": [{"cell": f"first HELLO at {largest} (max over trials)", "goal_s": TARGET_S,
                     "value_s": big["hello_max_s"], "stalls": big["stalls"], "met": met}],
    }


def _s(v: float | None, width: int = 8) -> str:
    return f"{v:>{width}.3f}" if v is not None else f"{'-':>{width}}"


def print_table(report: dict) -> None:
    m = report["meta"]
    print(f"server: {m['command']} --host 127.0.0.1 --port P --capacity C; {m['trials']} trials per capacity; "
          f"stall = no HELLO reply within {m['stall_s']} s of TCP accept; kernel {m['kernel']}, {m['cpus']} cpus, "
          f"load {m['load_avg'][0]:.1f}")
    hdr = (f"{'capacity':<10} {'ok':>5} {'stalls':>6} {'listen p50':>10} {'max':>8} {'accept p50':>10} "
           f"{'HELLO p50':>10} {'max':>8} {'/floor':>7} {'RSS MiB':>8} {'stop p50':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in report["rows"]:
        ratio = r["hello_over_import_floor"]
        rss = r["rss_mib_p50"]
        print(f"{r['name']:<10} {r['ok']:>2}/{r['trials']:<2} {r['stalls']:>6} {_s(r['listen_p50_s'], 10)} "
              f"{_s(r['listen_max_s'])} {_s(r['accept_p50_s'], 10)} {_s(r['hello_p50_s'], 10)} {_s(r['hello_max_s'])} "
              f"{'-' if ratio is None else f'{ratio:.1f}x':>7} {'-' if rss is None else f'{rss:.0f}':>8} "
              f"{_s(r['stop_p50_s'])}")
    print("floors (start + exit of the interpreter, same run):")
    for f in report["floors"]:
        print(f"  {f['name']:<45} p50 {f['p50_s']:.3f} s  max {f['max_s']:.3f} s")
    print("(times in seconds from process start; /floor = HELLO p50 / the import-kvfabric.server.native floor)")
    for row in report["rows"]:
        for e in row["errors"]:
            print(f"error at {row['name']}: {e}")
    for t in report["targets"]:
        v = "-" if t["value_s"] is None else f"{t['value_s']:.3f} s"
        print(f"target {t['cell']} < {t['goal_s']} s and no stalls: {v}, {t['stalls']} stalls: "
              f"{'met' if t['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench startup", description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="native",
                    help=f"preset ({', '.join(f'{k}: {v}' for k, v in PRESETS.items())}) or a command line; "
                         "--host/--port/--capacity are appended (default native)")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="extra server arguments, written --server-args='--zerocopy on' (with =, so that "
                         "they are not read as this command's options)")
    ap.add_argument("--capacities", type=lambda s: s.split(","), default=["256MiB", "1GiB", "3GiB"],
                    help="comma list (default 256MiB,1GiB,3GiB)")
    ap.add_argument("--trials", type=int, default=3, help="fresh servers per capacity (default 3)")
    ap.add_argument("--poll-ms", type=float, default=1.0, help="client connect retry interval (default 1 ms)")
    ap.add_argument("--stall-s", type=float, default=1.0, help="HELLO later than this after accept = stall (default 1)")
    ap.add_argument("--hello-timeout", type=float, default=60.0, help="give up on a trial after this (default 60 s)")
    ap.add_argument("--stop-timeout", type=float, default=60.0,
                    help="a server not gone this long after SIGTERM is an error, with its threads' states "
                         "(default 60 s)")
    ap.add_argument("--verbose", action="store_true", help="print every trial")
    ap.add_argument("--out", default="bench-results/startup.json")
    args = ap.parse_args(argv)
    try:
        for c in args.capacities:
            parse_size(c)
    except Exception as e:  # noqa: BLE001
        ap.error(f"--capacities: {e}")
    if args.trials < 1 or args.poll_ms < 0 or args.stall_s <= 0 or args.hello_timeout <= 0:
        ap.error("bad arguments")
    report = run(args)
    print_table(report)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
