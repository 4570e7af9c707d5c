"""Hostile etcd answers (issue 22, part 2): a fake etcd written here (a real HTTP socket server) answers the
client's range and watch with garbage: a bad ``mod_revision``, wrong types, non-JSON, a cut-short body, a
256 MiB body. ``Client()`` and its calls never raise; the members stay as they were; each bad answer is
counted (``etcd_bad_answers``) and logged; a 256 MiB answer is refused at the cap and the client process's
peak RSS stays bounded. Nothing waits a fixed time.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import logging
import subprocess
import sys
import threading

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.membership import Member
from kvfabric.membership.etcd import DEFAULT_MAX_RESPONSE_BYTES
from kvfabric.membership.registry import encode_member, member_key
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

WAIT_S = 60.0
MiB = 1 << 20


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


class FakeEtcd:
    """etcd's JSON gateway as far as the client's range and watch go; ``range``/``watch`` are callables that
    write the raw answer to the handler (so a test can send anything)."""

    def __init__(self, range_answer, watch_answer=None) -> None:
        fake = self
        self.range_answer = range_answer
        self.watch_answer = watch_answer or (lambda h: _send(h, b"", close=True))
        self.requests: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests.append(self.path)
                try:
                    (fake.range_answer if self.path == "/v3/kv/range" else fake.watch_answer)(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading: what a bounded reader does

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def __enter__(self) -> FakeEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _send(h: http.server.BaseHTTPRequestHandler, body: bytes, *, length: int | None = None, close: bool = False) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    if not close:
        h.send_header("Content-Length", str(len(body) if length is None else length))
    h.end_headers()
    h.wfile.write(body)
    h.wfile.flush()
    h.close_connection = True


def _range(kvs: list[dict] | str, revision: object = "5") -> bytes:
    return json.dumps({"header": {"revision": revision}, "kvs": kvs}).encode()


def _kv(key: bytes, value: bytes, mod_revision: object = "3") -> dict:
    return {"key": _b64(key), "value": _b64(value), "mod_revision": mod_revision, "create_revision": "3"}


@pytest.fixture
def fakes():
    """``fakes.enter_context(FakeEtcd(...))``: every fake made is closed after the test."""
    with contextlib.ExitStack() as stack:
        yield stack


CLUSTER = "hostile"
RECORD = encode_member(Member("pool-a", "127.0.0.1:9", {"tcp": "127.0.0.1:9"}, 1 << 20, {}))
BAD_ANSWERS = {
    "a bad mod_revision": lambda h: _send(h, _range([_kv(member_key(CLUSTER, "pool-a"), RECORD, "1e9x")])),
    "a revision that is a list": lambda h: _send(h, _range([], revision=[1])),
    "kvs that is a string": lambda h: _send(h, _range("nope")),
    "a kv that is a number": lambda h: _send(h, json.dumps({"kvs": [5]}).encode()),
    "bad base64": lambda h: _send(h, _range([{"key": "!!!", "value": "***", "mod_revision": "3"}])),
    "not JSON": lambda h: _send(h, b"<html>502 Bad Gateway</html>"),
    "a JSON array": lambda h: _send(h, b"[1, 2, 3]"),
    "cut short": lambda h: _send(h, _range([])[:10], length=1000),
    "over the cap": lambda h: _send(h, b"{}", length=DEFAULT_MAX_RESPONSE_BYTES + 1),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_malformed_etcd_answer_is_counted_and_never_raises(case, fakes, caplog):
    fake = fakes.enter_context(FakeEtcd(BAD_ANSWERS[case]))
    caplog.set_level(logging.WARNING, logger="kvfabric")
    cfg = ClientConfig(timeout_s=5.0, connect_timeout_s=2.0)
    with Client(etcd=fake.url, cluster=CLUSTER, config=cfg) as client:  # must not raise
        assert client.members == ()
        bad = lambda: client.stats()["client"]["etcd_bad_answers"]  # noqa: E731
        assert wait_for(lambda: bad() >= 2, WAIT_S), (case, bad(), fake.requests, caplog.text[-2000:])  # retried
        assert client.get([b"k" * 16]) == [None] and client.lookup([b"k" * 16]) == 0
        assert client.put([b"k" * 16], [b"v"]).dropped == 1
        assert client.members == ()
    assert "cannot read cluster hostile" in caplog.text, caplog.text[-2000:]


def test_a_malformed_watch_message_leaves_the_members_unchanged(fakes, caplog):
    with start_server(capacity="16MiB", extra_args=["--server-id", "pool-a"]) as srv:
        record = encode_member(Member("pool-a", srv.address, {"tcp": srv.address}, 16 << 20, {}))
        key = member_key(CLUSTER, "pool-a")
        lines = iter([
            {"result": {"events": [{"type": "DELETE", "kv": {"key": _b64(key), "mod_revision": "not a number"}}]}},
            {"result": {"events": "not a list"}},
            {"result": {"events": [{"type": "EXPLODE", "kv": {"key": _b64(key), "mod_revision": "9"}}]}},
            "not json at all",
        ])

        def watch(h):
            line = next(lines, None)
            h.send_response(200)
            h.end_headers()
            if line is not None:
                h.wfile.write((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n")
            h.wfile.flush()
            h.close_connection = True

        fake = fakes.enter_context(FakeEtcd(lambda h: _send(h, _range([_kv(key, record)])), watch))
        caplog.set_level(logging.WARNING, logger="kvfabric")
        cfg = ClientConfig(timeout_s=10.0, connect_timeout_s=5.0)
        with Client(etcd=fake.url, cluster=CLUSTER, config=cfg) as client:
            assert client.members == ("pool-a",)
            bad = lambda: client.stats()["client"]["etcd_bad_answers"]  # noqa: E731
            assert wait_for(lambda: bad() >= 4, WAIT_S), (bad(), caplog.text[-3000:])
            assert client.members == ("pool-a",), client.members
            assert client.put([b"k" * 16], [b"v"]).stored == 1
            assert client.get([b"k" * 16]) == [b"v"]
        assert "members unchanged" in caplog.text and "malformed message" in caplog.text, caplog.text[-3000:]


_PROBE = r"""
import json, resource, sys
from kvfabric import Client, ClientConfig
with Client(etcd=sys.argv[1], cluster="big", config=ClientConfig(timeout_s=60.0)) as c:
    st = c.stats()["client"]
    print(json.dumps({"members": list(c.members), "bad": st["etcd_bad_answers"],
                      "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _huge(with_length: bool):
    def answer(h):
        h.send_response(200)
        if with_length:
            h.send_header("Content-Length", str(256 * MiB))
        h.end_headers()
        chunk = b" " * MiB
        for _ in range(256):
            h.wfile.write(chunk)
        h.close_connection = True
    return answer


def _probe(fake: FakeEtcd) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, fake.url], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_256_mib_etcd_answer_is_refused_and_rss_stays_bounded(fakes):
    empty = fakes.enter_context(FakeEtcd(lambda h: _send(h, _range([]))))
    base = _probe(empty)
    assert base["members"] == [] and base["bad"] == 0, base
    for with_length in (True, False):
        fake = fakes.enter_context(FakeEtcd(_huge(with_length)))
        got = _probe(fake)
        assert got["members"] == [] and got["bad"] >= 1, (with_length, got)
        # a 16 MiB cap: at most the capped read beyond the baseline (it was +480 MiB before the cap)
        grew = got["maxrss"] - base["maxrss"]
        assert grew < 64 * MiB, (with_length, f"peak RSS grew {grew / MiB:.1f} MiB", base, got)
