"""Hostile bytes at the C parser: the native server answers or closes, never crashes or leaks slots.

Seeded, so a failure reproduces; runs under AddressSanitizer in
scripts/ci-native.sh, which is where an out-of-bounds read would show.
"""

import random
import socket

import msgpack
import pytest

from kvfabric import protocol as p
from kvfabric.transport import tcp

from test_server import wait_for


def _mutated_frames(rng: random.Random):
    keys = [rng.randbytes(rng.randint(0, 70)) for _ in range(rng.randint(0, 5))]
    metas = [
        {"keys": keys},
        {"keys": keys, "sizes": [rng.randint(-2, 5000) for _ in keys], "checksums": [rng.getrandbits(64) for _ in keys]},
        {"keys": rng.choice([None, 3, "x", [1, 2], {"a": 1}])},
        {"lease": rng.getrandbits(64), "res": -1, "checksums": "no"},
        {rng.randbytes(3).hex(): [[[[]]]] * rng.randint(0, 3)},
    ]
    meta = msgpack.packb(rng.choice(metas), use_bin_type=True)
    if rng.random() < 0.3:  # truncate or corrupt the metadata
        cut = rng.randint(0, len(meta))
        meta = meta[:cut] + rng.randbytes(rng.randint(0, 8))
    payload = rng.randbytes(rng.choice([0, 0, 1, 100, 5000]))
    op = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 32, 33, 34, 35, 36, 255])
    plen = len(payload) if rng.random() < 0.8 else rng.randint(0, 10000)
    head = p.pack_header(op, rng.getrandbits(64), len(meta), plen, rng.choice([0, 0, 0, 1, 4]))
    if rng.random() < 0.1:
        head = bytearray(head)
        head[rng.randrange(32)] ^= 1 << rng.randrange(8)
        head = bytes(head)
    return head + meta + payload


@pytest.mark.parametrize("seed", range(6))
def test_random_frames_never_hurt_the_server(server, seed):
    rng = random.Random(seed)
    free = server.stats()["free_bytes"]
    host, port = server.host, server.port
    for i in range(60):
        if i % 3 == 2:  # the unix socket too: the shm operations are only parsed there
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.shm_socket)
        else:
            s = socket.create_connection((host, port), timeout=5)
        with s:
            s.settimeout(2)
            try:
                for _ in range(rng.randint(1, 4)):
                    s.sendall(_mutated_frames(rng))
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except (ConnectionError, TimeoutError, OSError):
                pass
    c = tcp.connect(server.address, timeout_s=5)  # still serving, nothing left reserved or pinned
    assert c.request(p.PingRequest()).msg == p.PingReply()
    assert wait_for(lambda: server.stats()["connections"] == 1)
    assert wait_for(lambda: server.stats()["free_bytes"] == free and server.stats()["pinned"] == 0)
    assert server._srv.check()
    c.close()
