"""Start a real, single-member etcd on free loopback ports with a temporary data directory, for tests.

Usage::

    from kvfabric.testing.etcd import etcd_binary, start_etcd

    with start_etcd() as etcd:          # EtcdProcess
        etcd.url                        # "http://127.0.0.1:PORT"
        ...
        etcd.outage(); etcd.resume()    # an etcd outage: stopped, then back on the same ports and data
        etcd.stop()                     # SIGTERM, wait; the data directory is removed

    with start_etcd(tls=True, client_cert_auth=True) as etcd:
        etcd.url                        # "https://127.0.0.1:PORT"
        etcd.ca_file, etcd.client_cert, etcd.client_key   # PEM files made for this etcd

``tls=True`` makes a CA, a server certificate for the host (an IP SAN) and a
client certificate with ``openssl`` (:func:`make_certificates`) in the data
directory, and serves clients over ``https://`` only; ``client_cert_auth``
makes etcd require a client certificate signed by that CA
(``--client-cert-auth``). Without ``openssl`` on PATH it raises RuntimeError.

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
import ssl
import subprocess
import tempfile
import time
import urllib.request

from .ports import free_ports

__all__ = ["EtcdProcess", "MISSING_REASON", "etcd_binary", "make_certificates", "start_etcd", "etcd"]

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


class EtcdProcess:
    """A running etcd (see the module docstring)."""

    def __init__(self, popen: subprocess.Popen, url: str, data_dir: str, log_path: str, cmd: list[str],
                 certs: dict[str, str] | None = None) -> None:
        self.popen = popen
        self.url = url
        self.data_dir = data_dir
        self.log_path = log_path
        self.cmd = cmd
        certs = certs or {}
        self.ca_file: str | None = certs.get("ca")
        self.client_cert: str | None = certs.get("client_cert")
        self.client_key: str | None = certs.get("client_key")

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


def _healthy(proc: EtcdProcess) -> bool:
    ctx = None
    if proc.ca_file:
        ctx = ssl.create_default_context(cafile=proc.ca_file)
        if proc.client_cert:
            ctx.load_cert_chain(proc.client_cert, proc.client_key)
    try:
        with urllib.request.urlopen(proc.url + "/health", timeout=2, context=ctx) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def make_certificates(directory: str, host: str = "127.0.0.1") -> dict[str, str]:
    """A test CA, a server certificate for ``host`` (IP or DNS SAN) and a client certificate, all signed by
    the CA, made with ``openssl`` in ``directory``: ``{"ca", "ca_key", "server_cert", "server_key",
    "client_cert", "client_key"}`` -> paths. RuntimeError with openssl's output when it fails."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is not installed (needed to make test certificates)")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    f = {name: os.path.join(directory, name + ".pem") for name in
         ("ca", "ca_key", "server_cert", "server_key", "client_cert", "client_key")}
    san = f"IP:{host}" if host.replace(".", "").isdigit() or ":" in host else f"DNS:{host}"

    def openssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stderr[-2000:]}")

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f["ca_key"], "-out", f["ca"],
            "-days", "2", "-subj", "/CN=kvfabric-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    # the server certificate is a client one too: etcd's own JSON gateway dials etcd's gRPC port with it,
    # and an etcd with --client-cert-auth refuses that dial otherwise (the gateway answers 503)
    for who, cn, ext in (("server", host, f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth"),
                         ("client", "kvfabric-test-client", "extendedKeyUsage=clientAuth")):
        csr, extfile = os.path.join(directory, who + ".csr"), os.path.join(directory, who + ".ext")
        with open(extfile, "w") as fh:
            fh.write(ext + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f[f"{who}_key"], "-out", csr,
                "-subj", f"/CN={cn}")
        openssl("x509", "-req", "-in", csr, "-CA", f["ca"], "-CAkey", f["ca_key"], "-CAcreateserial",
                "-out", f[f"{who}_cert"], "-days", "2", "-extfile", extfile)
    return f


def start_etcd(timeout_s: float = 30.0, host: str = "127.0.0.1", *, tls: bool = False,
               client_cert_auth: bool = False) -> EtcdProcess:
    """Start etcd on two free ports (client, peer) with a temporary data dir; wait until healthy.

    ``host``: the address clients reach it on (default loopback; a network-namespace test passes its
    bridge address); the peer port stays on loopback. ``tls`` / ``client_cert_auth``: see the module
    docstring."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError(MISSING_REASON)
    if client_cert_auth and not tls:
        raise ValueError("client_cert_auth needs tls=True")
    client_port, peer_port = free_ports(2)  # free on loopback (the client port then on ``host``)
    data_dir = tempfile.mkdtemp(prefix="kvfabric-etcd-")
    url = f"{'https' if tls else 'http'}://{host}:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    log_path = os.path.join(data_dir, "etcd.log")
    cmd = [
        binary, "--name", "kvfabric-test", "--data-dir", os.path.join(data_dir, "data"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"kvfabric-test={peer}", "--initial-cluster-state", "new",
        "--log-level", "warn",
    ]
    certs = None
    if tls:
        try:
            certs = make_certificates(os.path.join(data_dir, "tls"), host)
        except BaseException:
            shutil.rmtree(data_dir, ignore_errors=True)
            raise
        cmd += ["--cert-file", certs["server_cert"], "--key-file", certs["server_key"]]
        if client_cert_auth:  # (etcd 3.4 asks every client for a certificate once it has a trusted CA file)
            cmd += ["--client-cert-auth", "--trusted-ca-file", certs["ca"]]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc = EtcdProcess(popen, url, data_dir, log_path, cmd,
                       certs and {"ca": certs["ca"], **({"client_cert": certs["client_cert"],
                                                         "client_key": certs["client_key"]} if client_cert_auth
                                                        else {})})
    _wait_healthy(proc, timeout_s)
    return proc


def _wait_healthy(proc: EtcdProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(proc):
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
