"""Start real ``kvfabric serve`` processes on free loopback ports, for tests and benchmarks.

Usage::

    from kvfabric.testing.servers import start_server, start_pool

    with start_server(capacity="64MiB") as srv:          # one server
        client = kvfabric.Client([srv.address])           # "127.0.0.1:PORT"
        ...
        srv.kill()                                        # SIGKILL (a crash)

    with start_pool(3, capacity="32MiB") as pool:         # N servers
        client = kvfabric.Client(pool.addresses)
        pool[1].kill()                                    # kill one shard

``start_server(capacity="64MiB", policy="lru", extra_args=(), env=None,
timeout_s=20.0, module="kvfabric")`` runs ``python -m MODULE serve --host
127.0.0.1 --port 0`` with the same interpreter (``kvfabric``: the product
server, ``kvfabric serve``; ``module="kvfabric.testing.reference"`` starts the
pure-Python reference server, which takes the common options), waits until
the process prints its listening line and returns a :class:`ServerProcess`:

* ``.address`` "127.0.0.1:PORT", ``.host``, ``.port``, ``.pid``, ``.popen``;
* ``.stop(timeout_s=10)`` SIGTERM and wait; returns the exit status (0 = clean);
* ``.kill()`` SIGKILL and wait (simulates a crash);
* ``with .paused():`` SIGSTOP, and return only once every thread of the
  process is stopped (the signal is asynchronous: on a loaded machine a
  server goes on answering for a while after ``kill()`` returns), SIGCONT on
  exit (a server that stops answering, like a short partition);
* ``.alive``; ``.stderr_text()`` the server's log so far (stderr goes to a
  temporary file, so a chatty server never blocks on a full pipe);
* ``.rss_bytes()`` the process's current VmRSS.

Used as a context manager the process is always stopped on exit, and every
process started here is also killed at interpreter exit, so a failing test
never leaves a server behind. ``start_server`` raises ``RuntimeError`` (with
the server's stderr) if the process exits or does not print its listening
line within ``timeout_s``.

``start_pool(n, **kwargs)`` starts ``n`` servers with the same arguments and
returns a :class:`ServerPool` (a list of :class:`ServerProcess` with
``.addresses`` and ``.stop()``; also a context manager).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence

LISTENING_PREFIX = "kvfabric serve: listening on "

_live: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


def stop_process_group(popen: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the process group ``popen`` leads (started with ``start_new_session=True``),
    wait up to ``timeout_s``, then SIGKILL the group; returns the exit status."""
    os.killpg(popen.pid, signal.SIGTERM)
    try:
        return popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        return popen.wait()


def thread_states(pid: int, *, detail: bool = False) -> list[str]:
    """The scheduler state letter of each thread of ``pid`` (/proc; empty once it is gone); with
    ``detail``, "name state wchan" each (its name and the kernel function it waits in: for saying what a
    process that did not stop was doing)."""
    states = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for t in tasks:
        base = f"/proc/{pid}/task/{t}"
        try:
            with open(f"{base}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if detail:
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
                with open(f"{base}/wchan") as f:
                    state = f"{name} {state} {f.read().strip() or '-'}"
        except (OSError, IndexError):
            continue          # a thread that exited meanwhile
        states.append(state)
    return states


def stop_process(pid: int, timeout_s: float = 120.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    ``kill`` only queues the signal: one thread takes it and stops the others
    when it next runs, and until then they go on serving (on a loaded machine,
    for as long as a scheduler slice or more). A test that asserts what a
    stopped server cannot do must wait for the stop. Raises ``RuntimeError``
    with the threads' states when the process is gone or not stopped within
    ``timeout_s`` (generous: this is a wait for a state, not a timing)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if states and all(s in ("T", "t") for s in states):
            return
        if not states or "Z" in states or "X" in states:
            raise RuntimeError(f"process {pid} exited instead of stopping (thread states {states})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} not stopped {timeout_s} s after SIGSTOP (thread states {states})")
        time.sleep(0.001)


@contextlib.contextmanager
def paused(pid: int, timeout_s: float = 120.0) -> Iterator[None]:
    """:func:`stop_process` on entry, SIGCONT on exit (also when the body raises)."""
    try:
        stop_process(pid, timeout_s)
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class ServerProcess:
    """One running ``kvfabric serve`` subprocess (see the module docstring)."""

    def __init__(self, popen: subprocess.Popen, host: str, port: int, stderr_file) -> None:
        self.popen = popen
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self._stderr = stderr_file

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout_s`` (then SIGKILL); returns the exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._close_pipes()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL and reap (a crash, as far as clients can tell)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self._close_pipes()

    def paused(self, timeout_s: float = 120.0) -> contextlib.AbstractContextManager[None]:
        """SIGSTOP until every thread is stopped, SIGCONT on exit (:func:`paused`)."""
        return paused(self.pid, timeout_s)

    def stderr_text(self) -> str:
        """Everything the server has written to stderr (its log) so far."""
        try:
            with open(self._stderr.name, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def rss_bytes(self) -> int:
        """The process's resident set size (VmRSS from /proc), in bytes."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("VmRSS not found")

    def _close_pipes(self) -> None:
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<ServerProcess {self.address} pid={self.pid} {'alive' if self.alive else 'exited'}>"

    def __del__(self) -> None:
        try:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait()
            os.unlink(self._stderr.name)
        except Exception:
            pass


class ServerPool(list):
    """A list of :class:`ServerProcess`; ``.addresses`` in order; ``.stop()`` stops all."""

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self]

    def stop(self) -> None:
        for s in self:
            s.stop()

    def deaths(self, tail_lines: int = 30) -> list[str]:
        """One line (plus the tail of its log) per server that exited on its own: a crash, say."""
        out = []
        for s in self:
            if not s.alive:
                log = "\n".join(s.stderr_text().splitlines()[-tail_lines:])
                out.append(f"{s.address} exited with status {s.popen.returncode}; its log ends:\n{log}")
        return out

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    capacity: str | int = "64MiB",
    policy: str = "lru",
    extra_args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 20.0,
    module: str = "kvfabric",  # "kvfabric.testing.reference": the pure-Python reference server
) -> ServerProcess:
    """Start one server on a free loopback port and wait until it listens (see module docs)."""
    cmd = [
        sys.executable, "-m", module, "serve",
        "--host", "127.0.0.1", "--port", "0",
        "--capacity", str(capacity), "--policy", policy,
        *extra_args,
    ]
    stderr_file = tempfile.NamedTemporaryFile(prefix="kvfabric-serve-", suffix=".log", delete=False)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr_file, stdin=subprocess.DEVNULL, env=full_env)
    stderr_file.close()
    proc = ServerProcess(popen, "127.0.0.1", 0, stderr_file)
    _live.add(proc)
    try:
        line = first_line(popen, timeout_s)
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"{e} ({' '.join(cmd)})\n{proc.stderr_text()}") from None
    except BaseException:
        proc.kill()
        raise
    if not line.startswith(LISTENING_PREFIX):
        proc.kill()
        raise RuntimeError(f"kvfabric serve did not start ({' '.join(cmd)}): {line!r}\n{proc.stderr_text()}")
    host, _, port = line[len(LISTENING_PREFIX):].strip().rpartition(":")
    proc.host, proc.port, proc.address = host, int(port), f"{host}:{int(port)}"
    return proc


def start_pool(n: int, **kwargs) -> ServerPool:
    """Start ``n`` servers (same arguments as :func:`start_server`); all or none."""
    if n < 1:
        raise ValueError("start_pool needs n >= 1")
    pool = ServerPool()
    try:
        for _ in range(n):
            pool.append(start_server(**kwargs))
    except BaseException:
        for s in pool:
            s.kill()
        raise
    return pool


def first_line(popen: subprocess.Popen, timeout_s: float, what: str = "kvfabric serve") -> str:
    """The first stdout line of ``popen`` (its stdout a binary pipe), or a RuntimeError naming ``what`` when the
    process exits / times out first."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(popen.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{what} printed no first line within {timeout_s}s")
            if not sel.select(left):
                continue
            chunk = os.read(popen.stdout.fileno(), 4096)
            if not chunk:
                popen.wait()
                raise RuntimeError(f"{what} exited with status {popen.returncode} before its first line")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_live):
        proc.kill()


__all__ = ["LISTENING_PREFIX", "ServerPool", "ServerProcess", "first_line", "paused", "start_pool", "start_server", "stop_process"]
