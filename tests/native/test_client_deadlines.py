"""The native client's socket timeouts (``arm`` in csrc/kvf_client.c) follow each call's deadline.

A call with a deadline arms SO_RCVTIMEO/SO_SNDTIMEO on the connection's fd; a
later call without one must block, whichever thread makes it (pooled
connections move between threads). It once kept the earlier call's timeout
when made from another thread and failed with "timed out".
"""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import pytest

from kvfabric import protocol
from kvfabric.errors import DeadlineExceeded

_native = pytest.importorskip("kvfabric._native")


def _recv(fd: int, deadline: float = 0.0):
    return _native.recv_frame(fd, None, 1 << 16, 1 << 20, deadline)


def test_a_call_without_deadline_blocks_after_a_timed_call_on_another_thread() -> None:
    a, b = socket.socketpair()
    with a, b:
        timed: list[BaseException] = []

        def timed_call() -> None:
            try:
                _recv(a.fileno(), time.monotonic() + 0.2)  # nothing comes: times out, leaves the fd armed
            except BaseException as e:  # noqa: BLE001 - kept for the assert below
                timed.append(e)

        t = threading.Thread(target=timed_call)
        t.start()
        t.join(60)
        assert len(timed) == 1 and isinstance(timed[0], DeadlineExceeded), timed

        got: list = []

        def blocking_call() -> None:
            try:
                got.append(_recv(a.fileno()))
            except BaseException as e:  # noqa: BLE001
                got.append(e)

        t = threading.Thread(target=blocking_call)  # a thread that never armed this fd
        t.start()
        time.sleep(1.0)  # well past the 0.2 s the fd was armed with
        meta = msgpack.packb({"sizes": []})
        _native.send_frame(b.fileno(), int(protocol.Op.GET), 0, 7, meta, [])
        t.join(60)
        assert len(got) == 1 and not isinstance(got[0], BaseException), got
        assert got[0][2] == 7 and got[0][3] == meta  # the frame sent: request id, meta
