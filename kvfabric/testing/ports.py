"""Loopback ports for the servers a test, benchmark or example starts, and who listens on one.

A port picked free and handed to a process that binds it later (a vLLM server imports for seconds before
it binds) can be taken in between. The kernel hands out ports of its *ephemeral range*
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default) to every bind to port 0 and to every
outgoing connection; on a machine running the suite's other parts beside a benchmark that is hundreds a
minute, and it happened in CI: a vLLM server's port went to a ``kvfabric serve`` of another part before the
engine bound it, and the benchmark read the pool server's reply to ``GET /health`` ("BadStatusLine:
KVFB..."). So:

* :func:`free_port` picks a port *outside* the ephemeral range (at random from :data:`PICK_LOW` up to the
  range, or above it: ~27,000 ports with the default range) that binds on loopback now (a bind there
  fails while the port is bound on loopback or on every address). A port-0 bind or an outgoing
  connection never takes it; only another caller of :func:`free_port` can, by picking the same one. It
  falls back to the kernel's pick (port 0) only when nothing outside the range binds after
  :data:`PICK_TRIES` tries per port.
* :func:`listener` says who listens on a TCP port: nobody yet, the process tree that should (``"ours"``),
  or someone else (``"other"``), from ``/proc/net/tcp{,6}`` and the tree's file descriptors. A waiter can
  then tell "not bound yet" from "taken" instead of parsing another server's reply as its own;
  :func:`http_ready` is that check for an HTTP server (``GET /health`` asked only of the right process).
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable

#: the lowest port :func:`free_port` picks (below it sit the well-known and registered services)
PICK_LOW = 10000
#: random candidates :func:`free_port` tries before it takes the kernel's pick
PICK_TRIES = 200
_LISTEN = "0A"                 # TCP_LISTEN in /proc/net/tcp's "st" column
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), (32768, 60999) when it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _binds(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))    # fails while the port is bound on loopback or on every address
        return s
    except OSError:
        s.close()
        return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports, each bindable on loopback right now and outside the kernel's
    ephemeral range where it leaves room (see the module docstring)."""
    lo, hi = ephemeral_range()
    candidates = [(PICK_LOW, lo - 1)] if lo - PICK_LOW >= 1000 else []
    if 65535 - hi >= 1000:
        candidates.append((hi + 1, 65535))
    held: list[socket.socket] = []
    try:
        tries = 0
        while len(held) < n and candidates and tries < PICK_TRIES * n:
            tries += 1
            first, last = random.choice(candidates)
            s = _binds(random.randint(first, last))
            if s is not None:
                held.append(s)
        while len(held) < n:             # no room outside the range: the kernel's pick
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """One TCP port, as :func:`free_ports`."""
    return free_ports(1)[0]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (from /proc; ``[pid]`` alone if it has none or is gone)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port``; None when neither /proc table can be read."""
    inodes: set[str] = set()
    read = False
    for table in _TABLES:
        try:
            with open(table) as f:
                next(f)
                read = True
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except (OSError, StopIteration, ValueError):
            continue
    return inodes if read else None


def _socket_inodes(pids: Iterable[int]) -> set[str]:
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    return found


def listener(port: int, pid: int) -> str | None:
    """Who listens on TCP ``port`` (any address, this network namespace): None when nobody does,
    ``"ours"`` when a socket of ``pid`` or one of its descendants does, ``"other"`` otherwise, and
    ``"unknown"`` where /proc/net/tcp cannot be read (a restricted /proc)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return "unknown"
    if not inodes:
        return None
    return "ours" if inodes & _socket_inodes(process_tree(pid)) else "other"


class PortTaken(RuntimeError):
    """Another process listens on the port a server was given (taken between the pick and the bind)."""


def http_ready(url: str, pid: int, path: str = "/health", timeout_s: float = 5.0) -> bool:
    """Whether the HTTP server process ``pid`` (or a descendant) at ``url`` (``http://HOST:PORT``) listens
    and answers ``GET url + path`` with 200: False while it does not yet (not bound, not answering, an
    error status); :class:`PortTaken` when another process listens on the port, whose reply is never read.
    Where /proc cannot say who listens (:func:`listener` ``"unknown"``) it asks whoever answers, and a
    reply that is not HTTP counts as not ready."""
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    who = listener(port, pid)
    if who == "other":
        raise PortTaken(f"another process listens on {url}, the port given to pid {pid}, which has not bound it")
    if who is None:
        return False
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False
