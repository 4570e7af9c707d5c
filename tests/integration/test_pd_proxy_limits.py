"""The PD example proxy (``examples/pd/proxy.py``) under hostile clients: a real proxy process, real sockets.

The instances behind it are a small stand-in engine in this process (``/v1/completions`` answers
with ``kv_transfer_params`` like a vLLM producer, ``/health`` 200), so these run without vLLM; the
proxy's behaviour with real engines is tests/e2e/vllm/test_pd.py's. Bounds are generous and every
wait polls with a long deadline: the machine these run on is loaded.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvfabric.testing import stop_process_group, wait_for
from kvfabric.testing.rawhttp import ask, closed_by_peer, hold_silent, read_answer, thread_count

PROXY = Path(__file__).resolve().parents[2] / "examples" / "pd" / "proxy.py"
MiB = 1 << 20


class _Engine(BaseHTTPRequestHandler):
    """A stand-in vLLM instance: answers every completion with one token and kv_transfer_params."""

    protocol_version = "HTTP/1.1"
    big_answer = 0          # > 0: /v1/completions answers this many bytes (an oversize upstream answer)

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send(b'{"data": [{"id": "stand-in"}]}')

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.big_answer:
            self._send(b" " * self.big_answer)
            return
        self._send(json.dumps({"choices": [{"text": "x"}], "echo_max_tokens": req.get("max_tokens"),
                               "got_params": req.get("kv_transfer_params"),
                               "kv_transfer_params": {"kvfabric": {"chunks": 1}}}).encode())


@pytest.fixture
def engine():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


class Proxy:
    def __init__(self, engine: str, *args: str) -> None:
        self.popen = subprocess.Popen([sys.executable, str(PROXY), "--port", "0", "--prefill", engine,
                                       "--decode", engine, *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)
        line = self.popen.stdout.readline()
        if not line.startswith("PD proxy listening on "):
            stop_process_group(self.popen)
            raise RuntimeError(f"the proxy did not start: {line!r} {self.popen.stderr.read()}")
        self.port = int(line.rsplit(":", 1)[1])

    def connect(self, timeout: float = 60) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def rss(self) -> int:
        return _status(self.popen.pid, "VmRSS:") * 1024

    def threads(self) -> int:
        return thread_count(self.popen.pid)

    def close(self) -> None:
        stop_process_group(self.popen)
        self.popen.stdout.close()
        self.popen.stderr.close()


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


@pytest.fixture
def proxy_factory(engine):
    made: list[Proxy] = []

    def make(*args: str) -> Proxy:
        made.append(Proxy(engine, *args))
        return made[-1]

    yield make
    for p in made:
        p.close()


def post_head(path: str, *headers: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def test_completion_goes_through(proxy_factory):
    p = proxy_factory()
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 5}).encode()
    with p.connect() as s:
        s.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}") + body)
        status, data = read_answer(s)
    answer = json.loads(data.partition(b"\r\n\r\n")[2])
    assert status == 200 and answer["echo_max_tokens"] == 5, data
    assert answer["got_params"] == {"kvfabric": {"chunks": 1}}, data


@pytest.mark.parametrize("headers, status", [
    (["Content-Length: -1"], 400),
    (["Content-Length: abc"], 400),
    (["Content-Length: 1e3"], 400),
    (["Content-Length: +5"], 400),
    (["Content-Length: 5", "Content-Length: 7"], 400),
    (["Content-Length: 5, 7"], 400),
    ([f"Content-Length: {(64 << 20) + 1}"], 413),
    (["Content-Length: 99999999999999999999999"], 400),
    (["Transfer-Encoding: chunked"], 501),
    ([], 411),
], ids=["negative", "word", "float", "plus", "repeated", "list", "over-cap", "huge", "chunked", "none"])
def test_bad_content_length_is_answered_before_the_body(proxy_factory, headers, status):
    """Each is answered without the proxy reading a byte of the body, and the connection closed."""
    p = proxy_factory()
    with p.connect() as s:
        s.sendall(post_head("/v1/completions", *headers))
        got, data = read_answer(s)
        assert got == status, f"{headers}: answered {data[:300]!r}, expected {status}"
        assert wait_for(lambda: closed_by_peer(s), 60), f"{headers}: the proxy kept the connection open"


def test_repeated_equal_content_length_is_accepted(proxy_factory):
    p = proxy_factory()
    body = json.dumps({"prompt": "hi"}).encode()
    with p.connect() as s:
        s.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}", f"Content-Length: {len(body)}") + body)
        status, data = read_answer(s)
    assert status == 200, data


def _blast(sock: socket.socket, total: int, sent: list[int]) -> None:
    chunk = b"[" * MiB
    try:
        while sent[0] < total:
            sock.sendall(chunk)
            sent[0] += len(chunk)
    except OSError:
        pass                      # the proxy closed: what we want


def test_negative_content_length_with_256mib_body_keeps_rss_bounded(proxy_factory):
    """On main, Content-Length: -1 made the proxy read to EOF: 256 MiB sent took it from 22 to 888 MiB."""
    p = proxy_factory()
    before = p.rss()
    with p.connect() as s:
        s.sendall(post_head("/v1/completions", "Content-Length: -1"))
        sent = [0]
        t = threading.Thread(target=_blast, args=(s, 256 * MiB, sent))
        t.start()
        t.join(300)
        assert not t.is_alive(), f"sending did not end in 300 s ({sent[0] / MiB:.0f} MiB sent)"
        after = p.rss()
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    bound = before + 32 * MiB
    assert after <= bound, (f"proxy RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB after {sent[0] / MiB:.0f} MiB "
                            f"sent with Content-Length: -1 (bound {bound / MiB:.1f} MiB)")
    assert sent[0] < 256 * MiB, f"the proxy took all {sent[0] / MiB:.0f} MiB instead of refusing the request"


def test_oversize_body_is_refused_and_rss_stays_bounded(proxy_factory):
    p = proxy_factory("--max-body-bytes", "1MiB")
    before = p.rss()
    with p.connect() as s:
        s.sendall(post_head("/v1/completions", f"Content-Length: {200 * MiB}"))
        status, data = read_answer(s)
        assert status == 413, data[:300]
        sent = [0]
        _blast(s, 200 * MiB, sent)
    after = p.rss()
    assert after <= before + 32 * MiB, (f"proxy RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB after a refused "
                                         f"200 MiB body ({sent[0] / MiB:.0f} MiB of it sent)")


def test_connection_cap_answers_503_without_a_thread_per_connection(proxy_factory):
    """600 connections: the first 16 (the cap) are held idle, every later one is answered 503 and closed
    by the accepting thread; the proxy never has more than cap + a few threads."""
    cap, total = 16, 600
    p = proxy_factory("--max-connections", str(cap), "--header-timeout-s", "600")
    base = p.threads()
    held = [p.connect() for _ in range(cap)]
    most = 0
    try:
        assert wait_for(lambda: p.threads() >= base + cap, 120), \
            f"the proxy has {p.threads()} threads, expected {base} + {cap} for the held connections"
        refused = 0
        for i in range(total - cap):
            with p.connect() as s:
                status, data = read_answer(s)
                assert status == 503, f"connection {cap + i + 1}: {data[:300]!r}"
                refused += 1
            if i % 50 == 0:
                most = max(most, p.threads())
        most = max(most, p.threads())
        assert refused == total - cap
        assert most <= base + cap + 2, f"{most} threads for {cap} held + {refused} refused connections (base {base})"
    finally:
        for s in held:
            s.close()
    # the slots come back: a request goes through once the held connections are gone
    def served() -> bool:
        with p.connect() as s:
            s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
            return read_answer(s)[0] == 200
    assert wait_for(served, 120, 0.5), "no request served after the held connections closed"


@pytest.mark.parametrize("phase", ["silent", "trickled-head", "trickled-body"])
def test_slow_clients_are_dropped_at_the_timeout(proxy_factory, phase):
    """A client that sends nothing, trickles its headers, or trickles its body (one byte every 0.2 s,
    far inside any per-recv timeout) is dropped at the header / body deadline (1 s here), and its
    slot serves the next client."""
    p = proxy_factory("--max-connections", "1", "--header-timeout-s", "1", "--body-timeout-s", "1")
    s = p.connect()
    try:
        if phase == "trickled-body":
            s.sendall(post_head("/v1/completions", "Content-Length: 100000"))
        trickle = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 100000
        stop = time.monotonic() + 120
        i = 0
        while not closed_by_peer(s):
            assert time.monotonic() < stop, f"{phase}: still connected after 120 s (1 s timeouts)"
            if phase != "silent":
                try:
                    s.send(trickle[i:i + 1] if phase == "trickled-head" else b"[")
                except OSError:
                    break
                i += 1
            time.sleep(0.2)
    finally:
        s.close()

    def served() -> bool:
        with p.connect() as c:
            c.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
            return read_answer(c)[0] == 200
    assert wait_for(served, 120, 0.5), f"{phase}: the dropped client's slot did not come back"


def test_header_block_over_the_cap_is_431(proxy_factory):
    p = proxy_factory("--max-header-bytes", "4KiB")
    with p.connect() as s:
        s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 8192 + b"\r\n\r\n")
        status, data = read_answer(s)
    assert status == 431, data[:300]


def test_upstream_answer_over_the_cap_is_bounded(engine, proxy_factory):
    """An instance answering more than --max-response-bytes: the prefill counts as failed and the
    decode answer is 502, with the proxy's RSS not holding it."""
    _Engine.big_answer = 48 * MiB
    try:
        p = proxy_factory("--max-response-bytes", "1MiB")
        before = p.rss()
        body = json.dumps({"prompt": "hi"}).encode()
        with p.connect(timeout=300) as s:
            s.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}") + body)
            status, data = read_answer(s)
        after = p.rss()
    finally:
        _Engine.big_answer = 0
    assert status == 502, data[:300]
    assert after <= before + 32 * MiB, f"proxy RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB"
    with p.connect() as s:
        s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
        counts = json.loads(read_answer(s)[1].partition(b"\r\n\r\n")[2])
    assert counts["prefill_failures"] == 1, counts


def test_bad_options_are_refused():
    for args in (["--max-connections", "0"], ["--header-timeout-s", "-1"], ["--max-body-bytes", "4G"],
                 ["--max-body-total", "1MiB"]):
        r = subprocess.run([sys.executable, str(PROXY), "--prefill", "http://x", "--decode", "http://y", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "error" in r.stderr, (args, r.returncode, r.stderr)


def test_refusals_and_drops_are_exported_at_metrics(proxy_factory):
    """``GET /metrics`` (Prometheus text, names from kvfabric.metrics.HTTP): each connection over the cap
    answered 503, each client dropped at a deadline, each 400 / 404 / 411 / 413 / 431 / 501 by status.
    Three silent connections against a cap of 2: at least one refused, the others dropped. The refused
    count lies between the 503s read and those plus the connections that ended with no byte (a refusal
    whose answer a reset discarded); a request that meets a slot still held by a finishing handler is
    refused and asked again (kvfabric.testing.rawhttp.ask)."""
    parser = pytest.importorskip("prometheus_client.parser")
    p = proxy_factory("--max-connections", "2", "--header-timeout-s", "2", "--max-body-bytes", "1MiB",
                      "--max-header-bytes", "4KiB")
    seen = {"503": 0, "lost": 0}
    dropped = hold_silent(p.connect, 3, seen)
    assert seen["503"] >= 1 and dropped >= 1, (seen, dropped)
    for request, status in ((post_head("/v1/completions", "Content-Length: -1"), 400),
                            (post_head("/v1/completions", f"Content-Length: {2 * MiB}"), 413),
                            (post_head("/v1/completions"), 411),
                            (post_head("/v1/completions", "Transfer-Encoding: chunked"), 501),
                            (b"GET /stats HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8192 + b"\r\n\r\n", 431),
                            (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
                            (post_head("/v1/completions", "Content-Length: 5") + b"[1,2]", 400)):   # not an object
        got, data = ask(p.connect, request, seen)
        assert got == status, f"{request[:60]!r}: {data[:300]!r}"

    def alone() -> dict | None:
        status, data = ask(p.connect, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", seen)
        assert status == 200, data[:300]
        fams = {f.name: f for f in parser.text_string_to_metric_families(data.partition(b"\r\n\r\n")[2].decode())}
        return fams if fams["kvfabric_http_connections"].samples[0].value == 1 else None

    fams = wait_for(alone, 120, 0.2)
    assert fams, "no /metrics answer served alone"
    one = {n: f.samples[0].value for n, f in fams.items() if n.startswith("kvfabric_http_") and not f.samples[0].labels}
    assert fams["kvfabric_http_connections_refused"].type == "counter", one
    assert seen["503"] <= one["kvfabric_http_connections_refused"] <= seen["503"] + seen["lost"], (one, seen)
    assert one["kvfabric_http_timeouts"] >= dropped, (one, dropped)
    by_status = {s.labels["status"]: s.value for s in fams["kvfabric_http_error_answers"].samples
                 if s.name.endswith("_total")}
    assert by_status == {"400": 2, "404": 1, "411": 1, "413": 1, "431": 1, "501": 1}, by_status
