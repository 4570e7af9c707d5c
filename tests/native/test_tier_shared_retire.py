"""Retire (issue 27 part 2) covers the shared-filesystem tier, on real ``kvfabric serve`` processes.

Servers sharing one ``--shared-path`` write tagged objects through with their namespace tag and
generation (docs/notes/tier-shared.md), record each RETIRE in the shared directory
(``kvfabric-retired/<nonce>-<n>.rec``), load every server's records at start, and treat a tagged
file of a retired generation as a miss (``shared_retired``). So a retired namespace misses on every
server: in DRAM, read back through the shared tier, on a server restarted without ``--ssd-path``, and
on a fresh server that only ever read the directory. Garbage records are skipped and counted; planted
files and records never bring a retired object back. No timed assertions: every wait is on a condition.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import os
import struct

import pytest
import xxhash

from kvfabric import Client, namespace_tag
from kvfabric import protocol as p
from kvfabric.testing.poll import wait_for
from kvfabric.transport import tcp
from test_tier_shared import WAIT_S, _get, _serve, _stats, _value
from test_tier_shared import servers, shared  # noqa: F401  (the fixtures)

pytest.importorskip("kvfabric._native", reason="the shared tier is the native server's")

A, B = namespace_tag(b"shared policy step 1"), namespace_tag(b"shared policy step 2")
TOKEN = "pool-secret-for-the-retire-tests"
REC = 72  # bytes per retirement record (csrc/kvf_shared.h)
RETIRE_LABEL = b"kvfabric shared-tier retirement v1\0"
MAC_LABEL = b"kvfabric shared-tier object v2\0"


def _objs(prefix: bytes, n: int) -> dict[bytes, bytes]:
    return {prefix + b"-%02d" % i: _value(prefix + b"-%02d" % i, 5000 + 97 * i) for i in range(n)}


def _put_ns(address: str, objs: dict[bytes, bytes], ns: bytes | None, token: str | None = None) -> list[int]:
    keys = list(objs)
    with tcp.connect(address, timeout_s=30, auth_token=token) as c:
        msg = p.PutRequest(keys, [len(objs[k]) for k in keys], [p.checksum(k, objs[k]) for k in keys], ns=ns)
        return list(c.request(msg, [objs[k] for k in keys]).msg.status)


def _retire(address: str, ns: bytes, token: str | None = None) -> int:
    with tcp.connect(address, timeout_s=30, auth_token=token) as c:
        return c.request(p.RetireRequest(ns=ns)).msg.generation


def _written(address: str, n: int, token: str | None = None) -> bool:
    st = _stats(address, token)
    return st["shared_writes"] + st["shared_exists"] >= n


def _exact(address: str, objs: dict[bytes, bytes], token: str | None = None) -> bool:
    return _get(address, list(objs), token) == list(objs.values())


def _misses(address: str, objs: dict[bytes, bytes], token: str | None = None) -> bool:
    return _get(address, list(objs), token) == [None] * len(objs)


def _records(shared: str) -> list[str]:
    return sorted(glob.glob(os.path.join(shared, "kvfabric-retired", "*.rec")))


def _path(shared: str, key: bytes) -> str:
    h = xxhash.xxh3_64_intdigest(key)
    return os.path.join(shared, f"{h & 0xff:02x}", f"{(h >> 8) & 0xff:02x}", key.hex() + ".kvf")


def _record(tag: bytes, gen: int, mac_key: bytes | None) -> bytes:
    """A retirement record as docs/notes/tier-shared.md lays it out (version 2 with a MAC key)."""
    r = b"KVFR" + struct.pack("<HH", 2 if mac_key else 1, REC) + tag + struct.pack("<II", gen, 0)
    r += struct.pack("<Q", xxhash.xxh3_64_intdigest(r))
    r += hmac.new(mac_key, RETIRE_LABEL + r[:32], hashlib.sha256).digest() if mac_key else bytes(32)
    return r


def test_a_retired_namespace_misses_on_every_server_sharing_the_directory(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    oa, ob, ou = _objs(b"ra", 12), _objs(b"rb", 12), _objs(b"ru", 6)
    assert _put_ns(a.address, oa, A) == [p.PutStatus.STORED] * 12
    assert _put_ns(a.address, ob, B) == [p.PutStatus.STORED] * 12
    assert _put_ns(a.address, ou, None) == [p.PutStatus.STORED] * 6
    assert wait_for(lambda: _written(a.address, 30), WAIT_S), _stats(a.address)
    # tagged files carry the trailer (flags bit 0, 32 bytes after the value); untagged ones keep format 1
    for k, v in list(oa.items())[:1] + list(ou.items())[:1]:
        with open(_path(shared, k), "rb") as f:
            data = f.read()
        tagged = k in oa
        assert data[9] == (1 if tagged else 0) and len(data) == 40 + len(k) + len(v) + (32 if tagged else 0)
        if tagged:
            assert data[-32:-16] == A and struct.unpack_from("<II", data, len(data) - 16) == (0, 0)
    # b promotes four of A's objects before the retire (they keep their tag in b's DRAM)
    first4 = dict(list(oa.items())[:4])
    assert _exact(b.address, first4)

    c = Client([a.address, b.address])
    try:
        assert c.retire(A) == {a.address: 1, b.address: 1}
    finally:
        c.close()
    assert [os.path.getsize(r) for r in _records(shared)] == [REC, REC]  # one file per server, one record each

    for srv in (a, b):
        assert _misses(srv.address, oa), srv.address
        assert _exact(srv.address, ob) and _exact(srv.address, ou), srv.address
    sa, sb = _stats(a.address), _stats(b.address)
    assert sa["retired_objects_freed"] == 12 and sb["retired_objects_freed"] == 4, (sa, sb)
    assert sa["shared_retired"] == 12 and sb["shared_retired"] == 12, (sa, sb)  # read back, refused by generation

    # a server that only ever read the directory, and a restarted one without --ssd-path: the records
    fresh = _serve(shared)
    servers.append(fresh)
    assert _misses(fresh.address, oa) and _exact(fresh.address, ob) and _exact(fresh.address, ou)
    sf = _stats(fresh.address)
    assert sf["shared_retired"] == 12 and sf["shared_hits"] == 30 and sf["namespaces"] == 2, sf
    a.kill()
    a2 = _serve(shared)
    servers.append(a2)
    assert _misses(a2.address, oa) and _exact(a2.address, ob)

    # PUT under the new generation: the stale files are replaced, and every server serves them
    again = dict(list(oa.items())[:3])
    assert _put_ns(a2.address, again, A) == [p.PutStatus.STORED] * 3
    assert wait_for(lambda: _stats(a2.address)["shared_replaced"] == 3, WAIT_S), _stats(a2.address)
    assert _exact(fresh.address, again) and _exact(b.address, again)
    # generations agree across the servers: the next retire is 2 everywhere, and drops them all
    c = Client([a2.address, b.address, fresh.address])
    try:
        assert c.retire(A) == {a2.address: 2, b.address: 2, fresh.address: 2}
    finally:
        c.close()
    for srv in (a2, b, fresh):
        assert _misses(srv.address, again), srv.address

    # a full tag table: a tagged file of a tag that does not fit is a miss, never served untagged
    small = _serve(shared, "--max-namespaces", "1")  # A, from the records, fills it
    servers.append(small)
    assert _misses(small.address, ob) and _exact(small.address, ou)
    assert _stats(small.address)["shared_retired"] == 12


def test_planted_files_and_records_never_bring_a_retired_object_back(shared, servers):
    a = _serve(shared, "--auth-token", TOKEN)
    servers.append(a)
    oa, ob = _objs(b"pa", 8), _objs(b"pb", 4)
    assert _put_ns(a.address, oa, A, TOKEN) == [p.PutStatus.STORED] * 8
    assert _put_ns(a.address, ob, B, TOKEN) == [p.PutStatus.STORED] * 4
    assert wait_for(lambda: _written(a.address, 12, TOKEN), WAIT_S), _stats(a.address, TOKEN)
    assert _retire(a.address, A, TOKEN) == 1
    (own,) = _records(shared)
    with open(own, "rb") as f:
        assert f.read() == _record(A, 1, TOKEN.encode())  # version 2, MAC'd with the token

    keys = list(oa)
    # key 0: an untagged copy with a MAC under another token; key 1: an untagged format-1 copy (no MAC);
    # key 2: the genuine file with its tag stripped (flag cleared, trailer cut, header checksum redone)
    for i, mac_key in ((0, b"another pool's token"), (1, None)):
        k, v = keys[i], oa[keys[i]]
        ver, hlen = (2, 72 + len(k)) if mac_key else (1, 40 + len(k))
        h = b"KVFS" + struct.pack("<HHB7s", ver, hlen, len(k), bytes(7)) + struct.pack("<QQ", len(v), p.checksum(k, v)) + k
        h += struct.pack("<Q", xxhash.xxh3_64_intdigest(h))
        if mac_key:
            h += hmac.new(mac_key, MAC_LABEL + h[:32 + len(k)] + v, hashlib.sha256).digest()
        with open(_path(shared, k), "wb") as f:
            f.write(h + v)
    k2 = keys[2]
    with open(_path(shared, k2), "rb") as f:
        data = bytearray(f.read()[:-32])
    data[9] = 0
    data[32 + len(k2):40 + len(k2)] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:32 + len(k2)])))
    with open(_path(shared, k2), "wb") as f:
        f.write(data)
    # records: A at generation 0 MAC'd with the real token (cannot lower), one under another token, one
    # without a MAC, one of garbage (all three skipped and counted), and a torn tail (left unread)
    with open(os.path.join(shared, "kvfabric-retired", "planted.rec"), "wb") as f:
        f.write(_record(A, 0, TOKEN.encode()) + _record(B, 5, b"another pool's token") + _record(B, 6, None)
                + os.urandom(REC) + b"\x01" * 30)

    fresh = _serve(shared, "--auth-token", TOKEN)
    servers.append(fresh)
    assert _misses(fresh.address, oa, TOKEN) and _exact(fresh.address, ob, TOKEN)
    sf = _stats(fresh.address, TOKEN)
    assert sf["shared_retire_bad"] == 3, sf
    assert sf["shared_mac_refused"] == 3 and sf["shared_retired"] == 5 and sf["shared_hits"] == 9, sf
    # the original server too (its DRAM copies were retired at the RETIRE; the planted files are refused)
    assert _misses(a.address, oa, TOKEN) and _exact(a.address, ob, TOKEN)
    # a new generation of A is served again: the next retire is 2 on both (B's planted records never counted)
    assert _retire(fresh.address, B, TOKEN) == 1 and _retire(a.address, B, TOKEN) == 1
    assert _misses(fresh.address, ob, TOKEN)


def test_a_records_directory_that_is_not_ours_stops_the_start(shared, servers):
    target = os.path.join(os.path.dirname(shared), "elsewhere")
    os.mkdir(target, 0o700)
    os.symlink(target, os.path.join(shared, "kvfabric-retired"))
    from test_tier_shared import _serve_fails

    r = _serve_fails("--shared-path", shared)
    assert r.returncode != 0 and "kvfabric-retired" in r.stderr and "symlink" in r.stderr, r.stderr
    assert os.listdir(target) == []


def test_a_server_that_missed_the_retire_catches_up_from_the_records(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    oa, ob = _objs(b"ma", 6), _objs(b"mb", 3)
    assert _put_ns(a.address, oa, A) == [p.PutStatus.STORED] * 6
    assert _put_ns(a.address, ob, B) == [p.PutStatus.STORED] * 3
    assert wait_for(lambda: _written(a.address, 9), WAIT_S), _stats(a.address)
    assert _exact(b.address, oa)  # b knows A now (at generation 0) and holds its objects in DRAM
    assert _retire(a.address, A) == 1  # only a hears the RETIRE (b was unreachable, say)
    assert _misses(a.address, oa)
    # b's control thread reads the records every few seconds: its DRAM copies and the files go stale
    assert wait_for(lambda: _misses(b.address, oa), WAIT_S), _stats(b.address)
    assert _exact(b.address, ob)
    assert _retire(b.address, A) == 2  # and it goes on from the recorded generation
