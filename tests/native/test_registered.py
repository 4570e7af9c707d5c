"""Native client GET into registered buffers (io_uring fixed buffers, READ_FIXED on the socket).

Against the Python server and the native server: byte-exact objects in
registered numpy buffers (whole and sliced), mixed registered/unregistered
buffers in one reply, pipelined GETs, the limits checked before registering,
a too-small buffer (ValueError, connection still usable), and a server that
dies or stalls mid-reply (the same errors as the recvmsg path, and no read
left in flight: the buffer is not written afterwards).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvfabric import protocol
from kvfabric.errors import ConnectionClosed, DeadlineExceeded, TransportUnavailable
from kvfabric.protocol import GetReply, GetRequest, HelloReply, PutRequest
from kvfabric.transport import native as tn

MiB = 1 << 20


def _objects(seed: int, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    objs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    keys = [rng.integers(0, 256, size=16, dtype=np.uint8).tobytes() for _ in sizes]
    return keys, objs


def _put(conn: tn.NativeConnection, keys: list[bytes], objs: list[bytes]) -> None:
    msg = PutRequest(keys=keys, sizes=[len(o) for o in objs], checksums=[protocol.checksum(k, o) for k, o in zip(keys, objs)])
    reply = conn.request(msg, objs, deadline=time.monotonic() + 10).msg
    assert all(s in (0, 1) for s in reply.status)


def _get(conn, keys, bufs, timeout=10.0):
    return conn.request(GetRequest(keys=keys), recv_buffers=bufs, deadline=time.monotonic() + timeout).msg


def test_get_into_registered_numpy_buffers_is_byte_exact(address):
    sizes = [MiB, MiB - 7, 3 * 4096 + 1, 1]
    keys, objs = _objects(1, sizes)
    with tn.connect(address, timeout_s=5) as conn:
        _put(conn, keys, objs)
        staging = np.zeros(4 * MiB, dtype=np.uint8)  # an engine's reused staging buffer
        conn.register_buffers([staging])
        slots = [staging[i * MiB:(i + 1) * MiB] for i in range(4)]
        for _ in range(3):  # reused: the same registration serves every call
            staging[:] = 0xAA
            reply = _get(conn, keys, slots)
            assert list(reply.sizes) == sizes
            for s, o, n in zip(slots, objs, sizes):
                assert s[:n].tobytes() == o
                assert (s[n:] == 0xAA).all()  # nothing written past the object
        st = conn.registered_stats()
        assert st["buffers"] == 1 and st["bytes"] == 4 * MiB
        assert st["fixed_bytes"] == 3 * sum(sizes)  # every byte came through READ_FIXED
        # one registered buffer per object works too
        own = [np.zeros(MiB, dtype=np.uint8) for _ in range(4)]
        conn.register_buffers(own)
        _get(conn, keys, own)
        assert [b[:n].tobytes() for b, n in zip(own, sizes)] == objs
        assert conn.registered_stats()["fixed_bytes"] == sum(sizes)


def test_mixed_registered_and_unregistered_buffers_in_one_batch(address):
    sizes = [MiB, 5000, MiB // 2, 77, 4096]
    keys, objs = _objects(2, sizes)
    miss = b"\x00" * 15 + b"\x01"
    with tn.connect(address, timeout_s=5) as conn:
        _put(conn, keys, objs)
        staging = np.zeros(2 * MiB, dtype=np.uint8)
        conn.register_buffers([staging])
        plain_np = np.zeros(8192, dtype=np.uint8)
        plain_ba = bytearray(MiB)
        bufs = [staging[:MiB], plain_np, staging[MiB:], plain_ba, bytearray(1), staging[MiB + MiB // 2:]]
        # order: registered, plain, registered, plain, (miss), registered
        req_keys = [keys[0], keys[1], keys[2], keys[3], miss, keys[4]]
        reply = _get(conn, req_keys, bufs)
        assert list(reply.sizes) == [MiB, 5000, MiB // 2, 77, -1, 4096]
        assert staging[:MiB].tobytes() == objs[0]
        assert plain_np[:5000].tobytes() == objs[1]
        assert staging[MiB:MiB + MiB // 2].tobytes() == objs[2]
        assert bytes(plain_ba[:77]) == objs[3]
        assert staging[MiB + MiB // 2:MiB + MiB // 2 + 4096].tobytes() == objs[4]
        assert conn.registered_stats()["fixed_bytes"] == MiB + MiB // 2 + 4096
        # a buffer straddling the end of the registered one is not registered: recvmsg
        straddle = np.zeros(2 * MiB + 4096, dtype=np.uint8)
        conn.register_buffers([straddle[:2 * MiB]])
        _get(conn, [keys[4]], [straddle[2 * MiB - 100:]])
        assert straddle[2 * MiB - 100:2 * MiB - 100 + 4096].tobytes() == objs[4]
        assert conn.registered_stats()["fixed_bytes"] == 0


def test_pipelined_gets_into_registered_buffers(server):
    sizes = [MiB // 4] * 8
    keys, objs = _objects(3, sizes)
    with tn.connect(server.address, timeout_s=5) as conn:
        _put(conn, keys, objs)
        staging = np.zeros(2 * MiB, dtype=np.uint8)
        conn.register_buffers([staging])
        slots = [staging[i * (MiB // 4):(i + 1) * (MiB // 4)] for i in range(8)]
        reqs = [(GetRequest(keys=[k]), (), [s]) for k, s in zip(keys, slots)]
        replies = conn.pipeline(reqs, deadline=time.monotonic() + 10)
        assert [list(r.msg.sizes) for r in replies] == [[MiB // 4]] * 8
        assert staging.tobytes() == b"".join(objs)
        conn.unregister_buffers()
        assert conn.registered_stats() is None
        staging[:] = 0
        conn.pipeline(reqs, deadline=time.monotonic() + 10)  # plain path after unregistering
        assert staging.tobytes() == b"".join(objs)


def test_registering_over_the_limits_raises_before_registering(server):
    keys, objs = _objects(4, [4096])
    with tn.connect(server.address, timeout_s=5) as conn:
        _put(conn, keys, objs)
        good = np.zeros(8192, dtype=np.uint8)
        conn.register_buffers([good])
        with pytest.raises(ValueError, match="limit is 2"):
            conn.register_buffers([np.zeros(10, np.uint8)] * 3, max_buffers=2)
        with pytest.raises(ValueError, match="limit is 1000"):
            conn.register_buffers([np.zeros(600, np.uint8), np.zeros(600, np.uint8)], max_bytes=1000)
        with pytest.raises(ValueError, match="no buffers"):
            conn.register_buffers([])
        with pytest.raises(ValueError, match="read-only"):
            conn.register_buffers([b"immutable"])
        with pytest.raises(ValueError, match="read-only or not contiguous"):
            conn.register_buffers([np.zeros((64, 64), np.uint8)[:, ::2]])
        with pytest.raises(ValueError, match="holds 0 bytes"):
            conn.register_buffers([bytearray()])
        with pytest.raises(ValueError, match="buffer protocol"):
            conn.register_buffers([object()])
        big = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=((1 << 30) + 1,), strides=(1,))
        big.flags.writeable = False  # never touched: the size check comes first
        with pytest.raises(ValueError):
            conn.register_buffers([big])
        # every refusal left the earlier registration in place and the connection usable
        assert conn.registered_stats()["bytes"] == 8192
        _get(conn, keys, [good])
        assert good[:4096].tobytes() == objs[0]
        assert conn.registered_stats()["fixed_bytes"] == 4096


def test_a_too_small_registered_buffer_raises_valueerror_and_the_connection_stays_usable(address):
    keys, objs = _objects(5, [MiB, 4096])
    with tn.connect(address, timeout_s=5) as conn:
        _put(conn, keys, objs)
        staging = np.zeros(2 * MiB, dtype=np.uint8)
        conn.register_buffers([staging])
        with pytest.raises(ValueError, match="too small"):
            _get(conn, keys, [staging[:MiB - 1], staging[MiB:]])
        assert not conn.closed
        reply = _get(conn, keys, [staging[:MiB], staging[MiB:]])
        assert list(reply.sizes) == [MiB, 4096]
        assert staging[:MiB].tobytes() == objs[0] and staging[MiB:MiB + 4096].tobytes() == objs[1]


def test_registration_is_released_on_close_and_refused_after(server):
    conn = tn.connect(server.address, timeout_s=5)
    staging = bytearray(MiB)
    conn.register_buffers([staging])
    with pytest.raises(BufferError):  # exported while registered: cannot be resized
        staging.extend(b"x")
    conn.close()
    staging.extend(b"x")  # released with the connection
    with pytest.raises(ConnectionClosed):
        conn.register_buffers([staging])


def test_shm_connections_refuse_registration(server):
    from kvfabric.transport import shm

    conn = shm.connect(server.address, timeout_s=5)
    try:
        with pytest.raises(TransportUnavailable):
            conn.register_buffers([bytearray(4096)])
    finally:
        conn.close()


# ---------------------------------------------------------------- a server dying mid-reply


class HalfReplyServer:
    """Answers HELLO, then each GET with a 1 MiB reply of which only half is sent;
    then closes the connection (mode "close") or stalls (mode "stall")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _frame(self, s: socket.socket) -> protocol.Header:
        head = b""
        while len(head) < protocol.HEADER_SIZE:
            chunk = s.recv(protocol.HEADER_SIZE - len(head))
            if not chunk:
                raise ConnectionError
            head += chunk
        h = protocol.unpack_header(head)
        left = h.meta_len + h.payload_len
        while left:
            left -= len(s.recv(min(left, 65536)))
        return h

    def _run(self) -> None:
        try:
            while True:
                s, _ = self.lsock.accept()
                self.conns.append(s)
                h = self._frame(s)
                hello = HelloReply(server="half", server_id=self.address, transports=("tcp",),
                                   limits=protocol.DEFAULT_LIMITS, capacity=0)
                s.sendall(protocol.encode_reply(hello, h.request_id))
                h = self._frame(s)
                s.sendall(protocol.encode_reply(GetReply(sizes=[MiB], checksums=[0]), h.request_id))
                s.sendall(b"\x5a" * (MiB // 2))
                if self.mode == "close":
                    s.close()
        except OSError:
            pass

    def close(self) -> None:
        self.lsock.close()
        for s in self.conns:
            s.close()


@pytest.mark.parametrize("mode, exc", [("close", ConnectionClosed), ("stall", DeadlineExceeded)])
def test_server_dying_or_stalling_mid_get_raises_like_the_plain_path(mode, exc):
    srv = HalfReplyServer(mode)
    try:
        errors = {}
        for registered in (False, True):
            conn = tn.connect(srv.address, timeout_s=5)
            staging = np.zeros(MiB, dtype=np.uint8)
            if registered:
                conn.register_buffers([staging])
            with pytest.raises(exc) as ei:
                _get(conn, [b"k" * 16], [staging], timeout=0.5)
            errors[registered] = type(ei.value)
            assert conn.closed
            assert (staging[:MiB // 2] == 0x5A).all()  # what arrived, arrived
            if registered:
                before = staging.copy()
                time.sleep(0.1)
                assert (staging == before).all()  # no read left in flight writing into it
        assert errors[True] is errors[False]
    finally:
        srv.close()
