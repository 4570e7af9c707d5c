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

Everything is named ``kvfp<pid><n>...`` (the creating process's id in hex
and a per-process lab number) and removed by :meth:`NetLab.close` (also at
interpreter exit), after the processes started in it (``start_server_in``,
:meth:`NetLab.start_load`) are killed. A lab left behind by a process that
was killed outright (SIGKILL: no exit handler ran) is removed by the next
``NetLab`` created on the machine: names whose creator pid is gone are swept
(labs of running processes are never touched).

Clients in their own namespace: :meth:`NetLab.start_load` runs
:mod:`kvfabric.testing.netns_load` (a read-through load against a cluster in
etcd that reports JSON lines) inside a namespace; :class:`LoadClient` keeps
its latest report and stops it.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from .servers import LISTENING_PREFIX, ServerProcess, _live, first_line

__all__ = ["NetLab", "LoadClient", "missing_reason", "start_server_in", "sweep_stale"]

_labs: weakref.WeakSet[NetLab] = weakref.WeakSet()
_lab_numbers = itertools.count()
_NAME_RE = re.compile(r"^kvfp([0-9a-f]{6})[0-9a-f](?:br|[hin]\d+)(?:@\S+)?$")


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove namespaces and links of labs whose creating process is gone; returns what was removed."""
    removed = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [n for n in netns if n.startswith("kvfp")]
    names += [m.group(1).split("@")[0] for m in re.finditer(r"^\d+: (kvfp\S+?):", links, re.MULTILINE)]
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or _pid_alive(int(m.group(1), 16)):
            continue
        if name in netns:  # processes a killed test left running in it go first
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        cmd = ["ip", "netns", "del", name] if name in netns else ["ip", "link", "del", name]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            removed.append(name)
    return removed


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
        sweep_stale()
        self.tag = f"p{os.getpid() & 0xFFFFFF:06x}{next(_lab_numbers) % 16:x}"
        self.subnet = _free_subnet()
        self.bridge = f"kvf{self.tag}br"
        self.bridge_ip = f"10.213.{self.subnet}.1"
        self.namespaces = [f"kvf{self.tag}n{i}" for i in range(n)]
        self.ips = [f"10.213.{self.subnet}.{11 + i}" for i in range(n)]
        self._host_if = [f"kvf{self.tag}h{i}" for i in range(n)]
        self._created: list[tuple[str, str]] = []  # ("netns"|"link", name), undone in reverse
        self._procs: list[Any] = []  # ServerProcess / LoadClient started in this lab: killed by close()
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

    def link_cmd(self, i: int, up: bool) -> list[str]:
        """The command that sets namespace ``i``'s veth host end up (heal) or down (partition), for a
        process other than this one to run (root)."""
        return ["ip", "link", "set", self._host_if[i], "up" if up else "down"]

    def partition(self, i: int) -> None:
        """Cut namespace ``i`` off: its veth's host end goes down (packets both ways are lost)."""
        _ip(*self.link_cmd(i, False)[1:])

    def heal(self, i: int) -> None:
        _ip(*self.link_cmd(i, True)[1:])

    def start_load(self, i: int, etcd_url: str, cluster: str, *, seed: int = 1, keys: int = 2000,
                   batch: int = 64, timeout_s: float = 1.0) -> LoadClient:
        """Run :mod:`kvfabric.testing.netns_load` inside namespace ``i`` against ``cluster`` in etcd."""
        cmd = self.exec_prefix(i) + [
            sys.executable, "-m", "kvfabric.testing.netns_load", "--etcd", etcd_url, "--cluster", cluster,
            "--seed", str(seed), "--keys", str(keys), "--batch", str(batch), "--timeout-s", str(timeout_s),
        ]
        load = LoadClient(cmd)
        self._procs.append(load)
        return load

    def close(self) -> None:
        """Kill what was started in the lab, then remove the namespaces, veths and the bridge (idempotent)."""
        for p in self._procs:
            p.kill()
        self._procs.clear()
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
    lab._procs.append(proc)
    try:
        line = first_line(popen, timeout_s)
    except BaseException as e:
        proc.kill()
        raise RuntimeError(f"{e} ({' '.join(cmd)})\n{proc.stderr_text()}") from None
    if not line.startswith(LISTENING_PREFIX):
        proc.kill()
        raise RuntimeError(f"kvfabric serve did not start in {lab.namespaces[i]}: {line!r}\n{proc.stderr_text()}")
    return proc


class LoadClient:
    """A :mod:`kvfabric.testing.netns_load` process: its reports (``latest``, ``reports``) and :meth:`stop`."""

    def __init__(self, cmd: list[str]) -> None:
        self._stderr = tempfile.NamedTemporaryFile(prefix="kvfabric-netns-load-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=env)
        self.reports: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            try:
                self.reports.append(json.loads(line))
            except ValueError:
                pass

    @property
    def latest(self) -> dict[str, Any]:
        return self.reports[-1] if self.reports else {"rounds": 0, "errors": 0, "wrong": 0, "members": []}

    def stop(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Stop the load, wait for its recovery check; its final report (RuntimeError with its log otherwise)."""
        try:
            self.popen.stdin.write("stop\n")
            self.popen.stdin.close()
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (self.reports and self.reports[-1].get("final")):
            if self.popen.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.05)
        if not (self.reports and self.reports[-1].get("final")):
            self.kill()
            raise RuntimeError(f"load client gave no final report; its log:\n{self.log()}")
        self.popen.wait(timeout_s)
        return self.reports[-1]

    def log(self) -> str:
        with open(self._stderr.name, errors="replace") as f:
            return f.read()[-4000:]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


@atexit.register
def _cleanup() -> None:
    for lab in list(_labs):
        lab.close()
