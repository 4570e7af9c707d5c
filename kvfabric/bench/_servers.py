"""Server command lines for the server benchmarks (``startup``, ``lookup``), and a launcher.

A benchmark names the server it measures with a *spec*: a preset name from
:data:`PRESETS` or a whole command line (``"{python} -m kvfabric serve"``;
``{python}`` is this interpreter). The launcher appends ``--host 127.0.0.1
--port P --capacity C`` and the benchmark's ``--server-args``, so a spec
holds only what selects the server. Presets:

* ``native``: the product server, ``python -m kvfabric serve`` (the C
  io_uring data plane since issue 14);
* ``python``: the pure-Python reference server the tests compare against,
  ``python -m kvfabric.testing.reference serve``.

When a preset stops matching the code (a module moved), pass the command
line itself; a server that does not start is reported in the benchmark's
table (with its stderr), never a crash of the whole run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from ..testing.servers import LISTENING_PREFIX, ServerProcess

PRESETS = {
    "native": "{python} -m kvfabric serve",
    "python": "{python} -m kvfabric.testing.reference serve",
}


def command(spec: str) -> list[str]:
    """The argv of a preset name or a command line (``{python}`` -> this interpreter)."""
    text = PRESETS.get(spec, spec)
    return [a.replace("{python}", sys.executable) for a in shlex.split(text)]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launch(spec: str, capacity: str, extra: Sequence[str] = (), *, timeout_s: float = 120.0) -> ServerProcess:
    """Start the server of ``spec`` on a free loopback port and wait for its listening line.

    Returns a :class:`~kvfabric.testing.servers.ServerProcess` (``.stop()``,
    ``.kill()``, ``.address``). Raises ``RuntimeError`` with the command and
    the server's stderr when it exits or prints no listening line within
    ``timeout_s``.
    """
    argv = [*command(spec), "--host", "127.0.0.1", "--port", "0", "--capacity", str(capacity), *extra]
    err = tempfile.NamedTemporaryFile(prefix="kvfabric-bench-serve-", suffix=".log", delete=False)
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=server_env())
    err.close()
    proc = ServerProcess(popen, "127.0.0.1", 0, err)
    try:
        line = read_line(popen, time.monotonic() + timeout_s)
    except BaseException:
        proc.kill()
        raise
    if line is None or not line.startswith(LISTENING_PREFIX):
        proc.kill()
        raise RuntimeError(f"server did not start ({shlex.join(argv)}): {line!r}\n{proc.stderr_text()[-2000:]}")
    host, _, port = line[len(LISTENING_PREFIX):].strip().rpartition(":")
    proc.host, proc.port, proc.address = host, int(port), f"{host}:{int(port)}"
    return proc


def read_line(popen: subprocess.Popen, deadline: float) -> str | None:
    """The first stdout line of ``popen``; None when it exits or ``deadline`` (monotonic) passes first."""
    import selectors

    assert popen.stdout is not None
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(popen.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not sel.select(left):
                continue
            chunk = os.read(popen.stdout.fileno(), 4096)
            if not chunk:
                return None
            buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1, nearest rank) of an ascending, non-empty sequence."""
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]
