"""The harness's ports (kvfabric.testing.ports): picked where no port-0 bind or outgoing connection lands,
and who listens on one, on real processes.

CI saw a vLLM server's port taken by a pool server of another part between the pick and the engine's bind;
the benchmark read the pool server's reply to ``GET /health``. :func:`listener` is how a waiter tells
"not bound yet" from "bound by someone else"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvfabric.testing.ports import PortTaken, ephemeral_range, free_port, free_ports, http_ready, listener
from kvfabric.testing.servers import start_server

# an HTTP server answering 200 on /health, 404 elsewhere; prints its port once it listens
HEALTH_SERVER = ("import http.server, sys\n"
                 "class H(http.server.BaseHTTPRequestHandler):\n"
                 "    def do_GET(self):\n"
                 "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
                 "    def log_message(self, *a): pass\n"
                 "s = http.server.HTTPServer(('127.0.0.1', 0), H)\n"
                 "print(s.server_address[1], flush=True)\ns.serve_forever()\n")

# a child of `sh` (the `; true` keeps sh from exec'ing it) that listens and prints its port
LISTEN_IN_A_CHILD = ("import socket, sys, time\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
                     "print(s.getsockname()[1], flush=True)\nsys.stdin.read()\n")


def test_picked_ports_bind_on_loopback_and_sit_outside_the_ephemeral_range():
    lo, hi = ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20, ports
    for port in ports:
        if lo - 10000 >= 1000 or 65535 - hi >= 1000:       # room outside the range (the default 32768-60999)
            assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert isinstance(free_port(), int)


def test_a_port_is_nobody_s_until_a_socket_of_ours_listens_on_it():
    port = free_port()
    assert listener(port, os.getpid()) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert listener(port, os.getpid()) is None, "bound but not listening"
        s.listen()
        assert listener(port, os.getpid()) == "ours"
        assert listener(port, os.getppid()) == "ours", "this process is a descendant of its parent"
    assert listener(port, os.getpid()) is None


def _listening_child() -> tuple[subprocess.Popen, int]:
    """``sh`` with a Python child that listens on a port: (the sh process, the port), once it listens."""
    sh = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"$0\"; true", LISTEN_IN_A_CHILD],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return sh, int(sh.stdout.readline())


def test_a_descendant_s_socket_is_its_ancestors_and_a_sibling_s_is_other():
    sh, port = _listening_child()
    try:
        assert listener(port, sh.pid) == "ours", "the listening process is sh's child"
        assert listener(port, os.getpid()) == "ours", "and this test's grandchild"
        with start_server(capacity="8MiB") as srv:     # a sibling of sh
            assert listener(srv.port, srv.pid) == "ours"
            assert listener(srv.port, sh.pid) == "other"
            assert listener(port, srv.pid) == "other"
    finally:
        sh.stdin.close()
        sh.wait(timeout=60)


def test_http_ready_asks_only_the_process_that_listens():
    port = free_port()
    assert http_ready(f"http://127.0.0.1:{port}", os.getpid()) is False       # nobody listens yet
    web = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(web.stdout.readline())}"
        assert http_ready(url, web.pid) is True
        assert http_ready(url, web.pid, path="/nothing") is False            # 404: not ready
        with start_server(capacity="8MiB") as srv:
            # the CI case: a pool server on the port an engine was given; its binary reply is never read
            with pytest.raises(PortTaken, match=f"another process listens on http://{srv.address}"):
                http_ready(f"http://{srv.address}", web.pid)
            # its own process, but not HTTP (the reply fails to parse): not ready, no exception
            assert http_ready(f"http://{srv.address}", srv.pid) is False
            with pytest.raises(PortTaken):
                http_ready(url, srv.pid)
    finally:
        web.kill()
        web.wait(timeout=60)


def test_without_proc_net_tables_it_asks_whoever_answers(monkeypatch, tmp_path):
    """A restricted /proc (no /proc/net/tcp): who listens is "unknown"; http_ready then asks, and a reply
    that is not HTTP is "not ready", never an exception."""
    from kvfabric.testing import ports

    monkeypatch.setattr(ports, "_TABLES", (str(tmp_path / "tcp"), str(tmp_path / "tcp6")))
    web = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(web.stdout.readline())
        assert listener(port, web.pid) == "unknown"
        assert http_ready(f"http://127.0.0.1:{port}", os.getpid()) is True
        with start_server(capacity="8MiB") as srv:
            assert http_ready(f"http://{srv.address}", web.pid) is False
    finally:
        web.kill()
        web.wait(timeout=60)
