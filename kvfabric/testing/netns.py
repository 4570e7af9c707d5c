"""Several "hosts" on one machine: network namespaces on a private bridge, for multi-host tests.

Usage (root and the ``ip`` tool required; :func:`missing_reason` says why not)::

    from kvfabric.testing.netns import NetLab, missing_reason, start_server_in

    with NetLab(4) as lab:                       # bridge 10.213.S.1/24, namespaces at 10.213.S.11..14
        srv = start_server_in(lab, 0, ["--etcd", url, "--cluster", "c"])   # kvfabric serve in namespace 0
        lab.partition(0)                         # its link to the bridge goes down (no packets either way)
        lab.heal(0)

Layout: one Linux bridge in the calling (root) namespace with the first
address of a private /24 of the 10.213.0.0/16 test range (the third octet
is picked so that it is unused on this machine), and ``n`` namespaces, each
with a veth pair whose host end is enslaved to the bridge and whose inner
end carries ``10.213.S.(11+i)/24``. The caller's namespace (where the test
and its clients run) reaches every namespace through the bridge address;
namespaces reach each other and the caller, nothing else (no default route,
no forwarding). :meth:`NetLab.partition` sets the host end of a namespace's
veth down, which drops every packet to and from it (a cut cable);
:meth:`NetLab.heal` sets it up again.

Everything is named ``kvf<tag>...`` with a per-lab tag and removed by
:meth:`NetLab.close` (also at interpreter exit): processes still running in
a namespace are killed by the caller first (``start_server_in`` registers
them with the same cleanup as :mod:`kvfabric.testing.servers`).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Sequence

from .servers import LISTENING_PREFIX, ServerProcess, _live, _read_line

__all__ = ["NetLab", "missing_reason", "start_server_in"]

_labs: weakref.WeakSet[NetLab] = weakref.WeakSet()


def missing_reason() -> str | None:
    """Why namespace tests cannot run here (not root, no ``ip``, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns, veth, bridge)"
    if shutil.which("ip") is None:
        return "network-namespace tests need the ip tool (Debian: apt-get install iproute2)"
    probe = f"kvfprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "-br", "addr"], capture_output=True, text=True).stdout
    free = [s for s in range(1, 255) if f"10.213.{s}." not in used]
    if not free:
        raise RuntimeError("no free 10.213.S.0/24 test subnet on this machine")
    return random.choice(free)


class NetLab:
    """A bridge and ``n`` network namespaces (see the module docstring)."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 200:
            raise ValueError("NetLab needs 1..200 namespaces")
        self.tag = f"{random.getrandbits(16):04x}"
        self.subnet = _free_subnet()
        self.bridge = f"kvf{self.tag}br"
        self.bridge_ip = f"10.213.{self.subnet}.1"
        self.namespaces = [f"kvf{self.tag}n{i}" for i in range(n)]
        self.ips = [f"10.213.{self.subnet}.{11 + i}" for i in range(n)]
        self._host_if = [f"kvf{self.tag}h{i}" for i in range(n)]
        self._created: list[tuple[str, str]] = []  # ("netns"|"link", name), undone in reverse
        _labs.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            inner = f"kvf{self.tag}i{i}"
            _ip("netns", "add", ns)
            self._created.append(("netns", ns))
            _ip("link", "add", self._host_if[i], "type", "veth", "peer", "name", inner)
            self._created.append(("link", self._host_if[i]))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", self._host_if[i], "master", self.bridge)
            _ip("link", "set", self._host_if[i], "up")
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{self.ips[i]}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside namespace ``i``."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def partition(self, i: int) -> None:
        """Cut namespace ``i`` off: its veth's host end goes down (packets both ways are lost)."""
        _ip("link", "set", self._host_if[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._host_if[i], "up")

    def close(self) -> None:
        """Remove the namespaces, veths and the bridge (idempotent)."""
        while self._created:
            kind, name = self._created.pop()
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server_in(lab: NetLab, i: int, extra_args: Sequence[str] = (), *, port: int = 7070,
                    capacity: str = "16MiB", timeout_s: float = 30.0) -> ServerProcess:
    """``kvfabric serve --host <namespace i's address> --port PORT`` inside namespace ``i``; waits for its
    listening line (RuntimeError with its log otherwise). The process is killed at interpreter exit."""
    cmd = lab.exec_prefix(i) + [
        sys.executable, "-m", "kvfabric", "serve", "--host", lab.ips[i], "--port", str(port),
        "--capacity", capacity, *extra_args,
    ]
    stderr_file = tempfile.NamedTemporaryFile(prefix="kvfabric-netns-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr_file, stdin=subprocess.DEVNULL, env=env)
    stderr_file.close()
    proc = ServerProcess(popen, lab.ips[i], port, stderr_file)
    _live.add(proc)
    try:
        line = _read_line(popen, timeout_s)
    except BaseException as e:
        proc.kill()
        raise RuntimeError(f"{e} ({' '.join(cmd)})\n{proc.stderr_text()}") from None
    if not line.startswith(LISTENING_PREFIX):
        proc.kill()
        raise RuntimeError(f"kvfabric serve did not start in {lab.namespaces[i]}: {line!r}\n{proc.stderr_text()}")
    return proc


@atexit.register
def _cleanup() -> None:
    for lab in list(_labs):
        lab.close()
