"""Start a real, single-member etcd on free loopback ports with a temporary data directory, for tests.

Usage::

    from kvfabric.testing.etcd import etcd_binary, start_etcd

    with start_etcd() as etcd:          # EtcdProcess
        etcd.url                        # "http://127.0.0.1:PORT"
        ...
        etcd.outage(); etcd.resume()    # an etcd outage: stopped, then back on the same ports and data
        etcd.stop()                     # SIGTERM, wait; the data directory is removed

``etcd_binary()`` is the path of ``etcd`` (``$KVFABRIC_ETCD_BIN``, else on
``PATH``, else ``/usr/bin/etcd`` as Debian's ``etcd-server`` installs it),
or None; tests skip with :data:`MISSING_REASON` when it is None
(``scripts/test-all`` installs the package when it runs as root with apt).
``start_etcd`` raises ``RuntimeError`` with etcd's log when it does not answer
``/health`` within ``timeout_s``. The pytest fixture ``etcd`` (in this
module; import it into a conftest or test module) yields one per test module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

__all__ = ["EtcdProcess", "MISSING_REASON", "etcd_binary", "start_etcd", "etcd"]

MISSING_REASON = ("etcd is not installed (Debian/Ubuntu: apt-get install etcd-server; or set KVFABRIC_ETCD_BIN); "
                  "scripts/test-all installs it when run as root")


def etcd_binary() -> str | None:
    env = os.environ.get("KVFABRIC_ETCD_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdProcess:
    """A running etcd (see the module docstring)."""

    def __init__(self, popen: subprocess.Popen, url: str, data_dir: str, log_path: str, cmd: list[str]) -> None:
        self.popen = popen
        self.url = url
        self.data_dir = data_dir
        self.log_path = log_path
        self.cmd = cmd

    def outage(self) -> None:
        """SIGTERM and wait, keeping the data directory (an etcd outage; :meth:`resume` ends it)."""
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(15)

    def resume(self, timeout_s: float = 30.0) -> None:
        """Start etcd again on the same ports and data (after :meth:`outage`); wait until healthy."""
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_healthy(self, timeout_s)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait()
        except Exception:
            pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def start_etcd(timeout_s: float = 30.0, host: str = "127.0.0.1") -> EtcdProcess:
    """Start etcd on two free ports (client, peer) with a temporary data dir; wait until healthy.

    ``host``: the address clients reach it on (default loopback; a network-namespace test passes its
    bridge address); the peer port stays on loopback."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError(MISSING_REASON)
    client_port, peer_port = _free_ports(2)  # free on loopback; the client port is also free on ``host``
    data_dir = tempfile.mkdtemp(prefix="kvfabric-etcd-")
    url = f"http://{host}:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    log_path = os.path.join(data_dir, "etcd.log")
    cmd = [
        binary, "--name", "kvfabric-test", "--data-dir", os.path.join(data_dir, "data"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"kvfabric-test={peer}", "--initial-cluster-state", "new",
        "--log-level", "warn",
    ]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc = EtcdProcess(popen, url, data_dir, log_path, cmd)
    _wait_healthy(proc, timeout_s)
    return proc


def _wait_healthy(proc: EtcdProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(proc.url):
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            text = proc.log_text()
            proc.stop()
            raise RuntimeError(f"etcd did not become healthy ({' '.join(proc.cmd)}):\n{text[-4000:]}")
        time.sleep(0.05)


try:
    import pytest

    @pytest.fixture(scope="module")
    def etcd():
        """One etcd per test module (skipped with the reason when the binary is missing); stopped after.
        Tests that share it use their own cluster names."""
        if etcd_binary() is None:
            pytest.skip(MISSING_REASON)
        proc = start_etcd()
        try:
            yield proc
        finally:
            proc.stop()
except ImportError:  # pytest is a test extra; start_etcd works without it
    pass
