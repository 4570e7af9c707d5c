"""``kvfabric bench redis``: Redis's own C client against a redis-server, beside kvfabric native.

The reference the issue-14 target is stated against: ``redis-benchmark``
(one connection, ``-c 1``, no pipelining, ``-d SIZE`` values, the one key
``key:__rand_int__``) against a ``redis-server`` this run starts on a free
loopback port (no persistence) and stops afterwards. GET reads the value a
one-request SET stored first. A cell runs ``redis-benchmark`` with a request
count calibrated to about ``--duration`` seconds; GB/s = requests/s x SIZE.
The server's CPU time per GB comes from /proc, as for kvfabric's servers.

``kvfabric bench redis [transport-native options]`` is ``kvfabric bench
transport_native --paths native`` with its JSON at bench-results/redis.json:
the table then holds ``redis``, ``native`` and the ``c-socket`` one-stream
loopback TCP limit from the same run, interleaved cell by cell.
``kvfabric bench transport_native`` includes the ``redis`` row itself
whenever the binaries are found (``--no-redis`` leaves it out).

When ``redis-server`` or ``redis-benchmark`` is not on PATH the row is
skipped and the table says why (install: the distribution's
``redis-server`` and ``redis-tools`` packages); nothing crashes.
"""

from __future__ import annotations

import csv
import io
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from . import proc_cpu_s
from ..testing.ports import free_port

BINARIES = ("redis-server", "redis-benchmark")
KEY = "key:__rand_int__"  # redis-benchmark's key without -r: SET and GET use this one key


def unavailable() -> str | None:
    """Why the Redis reference cannot run here, or None when it can."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"{' and '.join(missing)} not found on PATH (install the distribution's redis-server and "
                f"redis-tools packages to compare against Redis)")
    return None


class RedisServer:
    """A ``redis-server`` on a free loopback port holding one ``size``-byte value; ``close()`` stops it."""

    def __init__(self, size: int, *, start_timeout_s: float = 20.0) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.size = size
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvfabric-bench-redis-")
        self.popen = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
             "--save", "", "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "yes"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_ready(start_timeout_s)
            self._bench("set", 1)  # the value GET reads
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self.popen.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING within {timeout_s} s")
            time.sleep(0.02)

    def _bench(self, op: str, requests: int) -> tuple[float, float | None, float | None]:
        """(requests/s, p50 s, p99 s) of one ``redis-benchmark -t op`` run (latencies None on old versions)."""
        cmd = [shutil.which("redis-benchmark") or "redis-benchmark", "-h", "127.0.0.1", "-p", str(self.port),
               "-c", "1", "-P", "1", "-n", str(requests), "-d", str(self.size), "-t", op, "--csv"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
        rows = [r for r in csv.reader(io.StringIO(out)) if r]
        head = rows[0] if rows and rows[0][0] == "test" else []  # redis >= 6 prints a header and latencies
        for row in rows:
            if row[0].upper() == op.upper():
                cols = dict(zip(head, row))
                p50 = float(cols["p50_latency_ms"]) / 1e3 if "p50_latency_ms" in cols else None
                p99 = float(cols["p99_latency_ms"]) / 1e3 if "p99_latency_ms" in cols else None
                return float(row[1]), p50, p99
        raise RuntimeError(f"redis-benchmark printed no {op.upper()} row: {out[-500:]!r}")

    def measure(self, op: str, duration: float) -> tuple[float, float, float | None, float]:
        """(GB/s, p50 us, p99 us, server CPU s per GB) of ``op`` ("get" or "put" = SET) for about ``duration`` s."""
        rop = "set" if op == "put" else "get"
        probe_rps, _, _ = self._bench(rop, 20)
        n = int(min(1_000_000, max(20, probe_rps * duration)))
        cpu0 = proc_cpu_s(self.popen.pid)
        rps, p50, p99 = self._bench(rop, n)
        cpu = proc_cpu_s(self.popen.pid) - cpu0
        moved = n * self.size
        p50_us = (p50 * 1e6) if p50 is not None else 1e6 / rps
        return rps * self.size / 1e9, p50_us, None if p99 is None else p99 * 1e6, cpu / (moved / 1e9)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._dir.cleanup()


def main(argv: list[str] | None = None) -> int:
    """``kvfabric bench redis [options]``: ``transport_native --paths native`` with the Redis row (see above)."""
    from . import transport_native

    argv = list(argv or [])
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
    if "--no-redis" in argv:
        print("kvfabric bench redis: --no-redis makes no sense here", file=sys.stderr)
        return 2
    return transport_native.main(["--paths", "native", "--out", "bench-results/redis.json", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
