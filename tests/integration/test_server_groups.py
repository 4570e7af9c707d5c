"""Issue 23, server-side groups, against real ``kvfabric serve`` processes (the native product
server and the Python reference, same assertions): a PUT group is stored whole or refused whole,
fills and evicts whole (no partial group in EXISTS or STATS), a DELETE of a part drops the group,
a LOOKUP lease on one part keeps the whole group, and a connection that dies mid-group leaves
nothing (counted ``groups_torn``). Frames are built with kvfabric.protocol directly: the client's
placement API is another change's (docs/notes/groups.md)."""

from __future__ import annotations

import socket

import pytest

from kvfabric import protocol as P
from kvfabric.protocol import PutStatus
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

MODULES = {"native": "kvfabric", "reference": "kvfabric.testing.reference"}
PART = 16 << 10


@pytest.fixture(params=sorted(MODULES))
def small(request):
    """A 1 MiB server of each kind (LRU), a real process."""
    if request.param == "native":
        pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    with start_server(capacity="1MiB", module=MODULES[request.param]) as srv:
        yield srv


class Conn:
    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.rid = 0

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed by the server")
            buf += chunk
        return bytes(buf)

    def call(self, msg, payload: bytes = b"") -> dict:
        self.rid += 1
        self.sock.sendall(P.encode_request(msg, self.rid) + payload)
        h = P.unpack_header(self._recv(P.HEADER_SIZE))
        meta = P.decode_meta(self._recv(h.meta_len))
        self._recv(h.payload_len)
        assert h.request_id == self.rid and not h.is_error, meta
        return meta

    def put_group(self, name: bytes, n: int, corrupt: int = -1, size: int = PART) -> list[int]:
        keys = [name + b"/%d" % i for i in range(n)]
        vals = [bytes([i + 1]) * size for i in range(n)]
        sums = [P.checksum(k, v) ^ (i == corrupt) for i, (k, v) in enumerate(zip(keys, vals))]
        msg = P.PutRequest(keys=keys, sizes=[size] * n, checksums=sums, groups=[name] * n, group_parts=[n] * n)
        return self.call(msg, b"".join(vals))["status"]

    def present(self, name: bytes, n: int) -> list[bool]:
        return self.call(P.ExistsRequest(keys=[name + b"/%d" % i for i in range(n)]))["present"]

    def stats(self) -> dict:
        return self.call(P.StatsRequest())

    def close(self) -> None:
        self.sock.close()


def group_names(n: int) -> list[bytes]:
    return [b"chunk-%03d" % i for i in range(n)]


def test_groups_fill_and_evict_whole(small):
    c = Conn(small.address)
    names = group_names(40)  # 40 groups x 4 parts x 16 KiB = 2.5 MiB through a 1 MiB arena
    for name in names:
        assert c.put_group(name, 4) == [PutStatus.STORED] * 4, name
    held = {name: c.present(name, 4) for name in names}
    partial = {n: p for n, p in held.items() if any(p) and not all(p)}
    whole = [n for n, p in held.items() if all(p)]
    assert partial == {}, f"partial groups after eviction: {partial}"
    assert 0 < len(whole) < len(names) and whole == names[-len(whole):], whole  # LRU: the newest stay
    s = c.stats()
    assert (s["groups"], s["group_objects"], s["objects"], s["groups_incomplete"]) == \
           (len(whole), 4 * len(whole), 4 * len(whole), 0), s
    assert s["groups_stored"] == len(names) and s["evictions"] == 4 * (len(names) - len(whole)), s
    c.close()


def test_a_group_is_refused_whole(small):
    c = Conn(small.address)
    assert c.put_group(b"bad", 3, corrupt=1) == [PutStatus.CHECKSUM_MISMATCH] * 3
    assert c.present(b"bad", 3) == [False] * 3
    assert c.put_group(b"huge", 3, size=400 << 10) == [PutStatus.TOO_LARGE] * 3  # 1.2 MiB > the arena
    assert c.present(b"huge", 3) == [False] * 3
    s = c.stats()
    assert (s["groups_refused"], s["objects"], s["checksum_rejects"], s["groups"]) == (2, 0, 1, 0), s
    assert s["bytes_allocated"] == 0, s  # every slot kept for the refused groups was given back
    c.close()


def test_delete_of_a_part_drops_the_group(small):
    c = Conn(small.address)
    assert c.put_group(b"a", 3) == [PutStatus.STORED] * 3
    assert c.put_group(b"b", 2) == [PutStatus.STORED] * 2
    assert c.call(P.DeleteRequest(keys=[b"a/1"])) == {"deleted": 3}
    assert (c.present(b"a", 3), c.present(b"b", 2)) == ([False] * 3, [True] * 2)
    s = c.stats()
    assert (s["groups"], s["objects"]) == (1, 2), s
    c.close()


def test_a_lease_on_one_part_keeps_its_whole_group(small):
    c = Conn(small.address)
    assert c.put_group(b"kept", 4) == [PutStatus.STORED] * 4
    assert c.call(P.LookupRequest(keys=[b"kept/2"], lease_ms=600_000)) == {"count": 1}
    for name in group_names(30):  # 1.9 MiB more: everything else is evicted at least once
        assert c.put_group(name, 4) == [PutStatus.STORED] * 4, name
    assert c.present(b"kept", 4) == [True] * 4
    assert c.stats()["groups_incomplete"] == 0
    c.close()


def test_a_connection_that_dies_mid_group_leaves_nothing(small):
    c = Conn(small.address)
    keys = [b"torn/%d" % i for i in range(3)]
    vals = [bytes([i + 1]) * PART for i in range(3)]
    msg = P.PutRequest(keys=keys, sizes=[PART] * 3, checksums=[P.checksum(k, v) for k, v in zip(keys, vals)],
                       groups=[b"torn"] * 3, group_parts=[3] * 3)
    c.sock.sendall(P.encode_request(msg, 1) + vals[0] + vals[1] + vals[2][:100])  # 2 parts and a bit
    c.close()
    probe = Conn(small.address)
    assert wait_for(lambda: probe.stats()["groups_torn"] == 1), probe.stats()
    assert probe.present(b"torn", 3) == [False] * 3
    s = probe.stats()
    assert (s["objects"], s["groups"], s["bytes_allocated"]) == (0, 0, 0), s
    probe.close()


# ---------------------------------------------------------------- the SSD tier (native server only)


@pytest.fixture
def tier_dir():
    import os
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="kvf-groups-tier-", dir=os.environ.get("KVFABRIC_TIER_TEST_DIR") or None)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def tier_server(d: str):
    pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    # evictions on demand only: which groups leave DRAM is exact (LRU)
    return start_server(capacity="1MiB", extra_args=["--ssd-path", d, "--ssd-capacity", "64MiB",
                                                     "--evict-watermarks", "0,0"])


def settled(c: Conn, **want) -> dict:
    """STATS once the write-behind queue is empty and every ``want`` figure is there."""
    ok = wait_for(lambda: (s := c.stats())["ssd_queue_bytes"] == 0 and all(s[k] == v for k, v in want.items()),
                  timeout_s=60)
    assert ok, (want, c.stats())
    return c.stats()


def test_a_group_promoted_from_the_ssd_tier_is_one_unit_again(tier_dir):
    with tier_server(tier_dir) as srv:
        c = Conn(srv.address)
        names = group_names(20)  # 20 x 64 KiB: the first ones go to the tier
        for name in names:
            assert c.put_group(name, 4) == [PutStatus.STORED] * 4, name
        s = settled(c)
        assert s["ssd_objects"] > 0 and s["ssd_objects"] % 4 == 0, s
        assert c.present(names[0], 4) == [True] * 4  # EXISTS answers from the tier index
        keys = [names[0] + b"/%d" % i for i in range(4)]
        got = c.call(P.GetRequest(keys=keys))  # read back and promoted: a DRAM hit now
        assert got["sizes"] == [PART] * 4, got
        s = c.stats()
        assert s["ssd_promotions"] == 4 and s["groups_incomplete"] == 0, s
        assert (s["groups"], s["group_objects"]) == (s["objects"] // 4, s["objects"]), s
        c.close()


def test_a_torn_group_on_the_ssd_tier_is_dropped_whole_at_restart(tier_dir):
    with tier_server(tier_dir) as srv:
        c = Conn(srv.address)
        names = group_names(24)
        for name in names:
            assert c.put_group(name, 4) == [PutStatus.STORED] * 4, name
        s = settled(c)
        on_tier = s["ssd_objects"] // 4
        assert on_tier >= 2, s
        # one part of group 0 is DELETEd while the group is on the tier only: the whole group leaves the
        # tier's index, a tombstone is written for that part, and its three other records stay on disk
        # until the restart's scan finds the group short of a part
        assert c.call(P.DeleteRequest(keys=[names[0] + b"/1"])) == {"deleted": 4}
        assert c.present(names[0], 4) == [False] * 4
        settled(c, ssd_objects=4 * (on_tier - 1))
        c.close()
        srv.kill()  # SIGKILL: nothing is flushed
    with tier_server(tier_dir) as srv:
        c = Conn(srv.address)
        s = c.stats()
        assert (s["ssd_groups_torn"], s["ssd_objects"]) == (1, 4 * (on_tier - 1)), s
        assert c.present(names[0], 4) == [False] * 4  # dropped whole: not three parts of four
        assert c.present(names[1], 4) == [True] * 4
        c.close()


def test_the_log_wrapping_drops_groups_whole(tier_dir):
    """A 3 MiB tier (two 1 MiB segments) takes 60 evicted groups of 4 records of 20 KiB (header block
    + value): 51 records fit a segment, so groups straddle segment ends. After 240 records the live
    ones start at record 153 (the older segment's first), in the middle of group 38 (records
    152-155), whose record 152 went with a reused segment: the group must have left whole."""
    pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    args = ["--ssd-path", tier_dir, "--ssd-capacity", "3MiB", "--evict-watermarks", "0,0"]
    with start_server(capacity="1MiB", extra_args=args) as srv:
        c = Conn(srv.address)
        names = group_names(76)  # 16 stay in the 1 MiB arena, 60 go to the tier
        for name in names:
            assert c.put_group(name, 4) == [PutStatus.STORED] * 4, name
        s = settled(c)
        held = {name: c.present(name, 4) for name in names}
        partial = {n: h for n, h in held.items() if any(h) and not all(h)}
        assert partial == {}, f"partial groups in DRAM + the tier: {partial}"
        assert s["ssd_writes"] == 240 and s["ssd_groups_torn"] >= 1 and s["ssd_objects"] % 4 == 0, s
        assert held[names[38]] == [False] * 4 and held[names[39]] == [True] * 4, (held[names[38]], s)
        c.close()
