"""Corrupt an object inside a running server's arena; the server must report a miss, never the bytes.

The test writes into the server process's memory through ``/proc/PID/mem``
(allowed for a child process). It finds the object by content: PUT payloads
are received straight into the arena, so a random object appears exactly
once in the server's memory.
"""

from __future__ import annotations

import os
import re

import pytest

from kvfabric import Client, ClientConfig
from kvfabric import protocol as P
from kvfabric.testing import start_server
from kvfabric.transport.tcp import connect


def find_in_process(pid: int, needle: bytes) -> list[int]:
    """Addresses of ``needle`` in the writable anonymous (or memfd: the arena) mappings of ``pid``."""
    hits = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and not fields[5].startswith("/memfd:")):
                continue  # only anonymous writable memory and memfd arenas
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except OSError:
                continue
            hits += [start + m.start() for m in re.finditer(re.escape(needle), data)]
    return hits


def _flip_byte_of(pid: int, needle: bytes, at: int) -> None:
    """Flip one byte of the object that starts with ``needle`` in the server's arena."""
    where = find_in_process(pid, needle)
    assert len(where) == 1, f"object found {len(where)} times in server memory (expected once, in the arena)"
    with open(f"/proc/{pid}/mem", "r+b") as mem:
        mem.seek(where[0] + at)
        byte = mem.read(1)
        mem.seek(where[0] + at)
        mem.write(bytes([byte[0] ^ 0x40]))


def _skip_without_proc_mem(pid: int) -> None:
    try:
        open(f"/proc/{pid}/mem", "rb").close()
    except OSError as e:
        pytest.skip(f"cannot open the server's memory here: {e}")


@pytest.mark.parametrize("module", ["kvfabric", "kvfabric.testing.reference"])
def test_corrupted_object_is_a_miss_dropped_and_counted(module):
    with start_server(capacity="4MiB", module=module) as srv:
        _skip_without_proc_mem(srv.pid)
        c = connect(srv.address, timeout_s=10)
        good, bad = os.urandom(50_000), os.urandom(50_000)
        msg = P.PutRequest([b"good", b"bad"], [len(good), len(bad)], [P.checksum(b"good", good), P.checksum(b"bad", bad)])
        assert c.request(msg, [good, bad]).msg.status == [0, 0]
        _flip_byte_of(srv.pid, bad[:4096], 1234)
        reply = c.request(P.GetRequest([b"bad", b"good"]))
        assert reply.msg.sizes == [-1, len(good)]
        assert bytes(reply.payload) == good
        st = c.request(P.StatsRequest()).msg.stats
        assert st["checksum_failures"] == 1 and st["objects"] == 1
        assert c.request(P.ExistsRequest([b"bad"])).msg.present == [False]  # dropped, not kept
        c.close()


@pytest.mark.parametrize("module", ["kvfabric", "kvfabric.testing.reference"])
@pytest.mark.parametrize("size", [50_000, 6 << 20], ids=["small", "streamed"])  # the C server streams > 4 MiB
def test_a_client_that_verifies_gets_unchecked_bytes_and_asks_again_on_a_mismatch(module, size):
    """``client_verifies``: the server sends without its own pass over the bytes (the reply's
    checksum no longer matches what came); the Client then asks again without the flag, the
    server checks, drops the corrupt object and answers a miss, so it cannot stay in the pool."""
    with start_server(capacity="64MiB", module=module) as srv:
        _skip_without_proc_mem(srv.pid)
        c = connect(srv.address, timeout_s=10)
        good, bad = os.urandom(size), os.urandom(size)
        msg = P.PutRequest([b"good", b"bad"], [size, size], [P.checksum(b"good", good), P.checksum(b"bad", bad)])
        assert c.request(msg, [good, bad]).msg.status == [0, 0]
        _flip_byte_of(srv.pid, bad[:4096], size - 1000)

        reply = c.request(P.GetRequest([b"bad", b"good"], client_verifies=True))
        assert reply.msg.sizes == [size, size]  # sent as stored: the server did not check
        got_bad = bytes(reply.payload[:size])
        assert got_bad != bad and P.checksum(b"bad", got_bad) != reply.msg.checksums[0]
        assert bytes(reply.payload[size:]) == good
        st = c.request(P.StatsRequest()).msg.stats
        assert st["checksum_failures"] == 0 and st["objects"] == 2
        if module == "kvfabric":
            assert st["client_verified_sends"] == 2

        with Client([srv.address], config=ClientConfig(timeout_s=10)) as client:
            assert client.get([b"bad", b"good"]) == [None, good]
            cs = client.stats()
            assert cs["client"]["checksum_failures"] == 1 and cs["client"]["misses"] == 1
        st = c.request(P.StatsRequest()).msg.stats
        assert st["checksum_failures"] == 1 and st["objects"] == 1  # the server's own check dropped it
        assert c.request(P.ExistsRequest([b"bad"])).msg.present == [False]
        c.close()

