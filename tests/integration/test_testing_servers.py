"""The test harness's own promises (kvfabric.testing.servers), on real server processes.

``paused()`` is what every "a stopped server cannot answer" test relies on:
SIGSTOP is asynchronous (one thread takes it and stops the others when it next
runs), so on a loaded machine a server went on answering after ``kill()``
returned and a test saw a put acknowledged by a server it had just stopped.
"""

from __future__ import annotations

import time

import pytest

from kvfabric import protocol, transport
from kvfabric.config import ClientConfig
from kvfabric.errors import DeadlineExceeded
from kvfabric.testing.servers import start_server, stop_process


def test_a_paused_server_answers_nothing_until_it_is_resumed():
    with start_server(capacity="8MiB") as srv:
        conn = transport.connect("tcp", srv.address, ClientConfig(transport="tcp"))
        try:
            assert isinstance(conn.request(protocol.PingRequest()).msg, protocol.PingReply)
            with srv.paused():
                with open(f"/proc/{srv.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                assert state in ("T", "t"), state
                # already stopped when paused() returned: not one request is served
                with pytest.raises(DeadlineExceeded):
                    conn.request(protocol.PingRequest(), deadline=time.monotonic() + 0.5)
        finally:
            conn.close()
        again = transport.connect("tcp", srv.address, ClientConfig(transport="tcp"))
        try:
            assert isinstance(again.request(protocol.PingRequest()).msg, protocol.PingReply)
        finally:
            again.close()


def test_stopping_a_process_that_exited_says_so():
    srv = start_server(capacity="8MiB")
    pid = srv.pid
    srv.kill()
    with pytest.raises((RuntimeError, ProcessLookupError)) as e:
        stop_process(pid, timeout_s=5)
    assert isinstance(e.value, ProcessLookupError) or "exited" in str(e.value), e.value
