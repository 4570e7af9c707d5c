"""The shared-filesystem tier (``kvfabric serve --shared-path DIR``) through real server processes.

Several servers on this machine share one local directory, as pool servers share a DingoFS / JuiceFS /
CephFS / NFS mount: a committed PUT is written there once by key (asynchronously, by the tier thread), and
a key missing in a server's DRAM (and SSD tier) is looked for there. What is checked: a server serves what
another one was sent, with exact bytes, also after that one was SIGKILLed; a client following the cluster
keeps hitting after a server dies; a torn, corrupt or truncated file is dropped and counted, never served;
a temporary left by a crashed writer is never served; an unusable directory stops the server at start
(exit 2, a message naming the problem). Nothing waits a fixed time: asynchronous writes are awaited through
STATS with generous deadlines (docs/notes/tier-shared.md).
"""

from __future__ import annotations

import glob
import os
import random
import subprocess
import sys

import pytest

from kvfabric import Client, ClientConfig
from kvfabric import protocol as p
from kvfabric.protocol.stats import SHARED_STATS_FIELDS
from kvfabric.testing.etcd import etcd  # noqa: F401  (the fixture: skips where etcd is missing)
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp

WAIT_S = 60.0  # generous: a loaded machine must pass


def _value(key: bytes, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def _serve(shared: str, *extra: str, capacity: str = "16MiB", **kw):
    # the promotion cap (bytes one request may read from the tiers) is a quarter of the arena: 4 MiB here
    return start_server(capacity=capacity, extra_args=["--shared-path", shared, *extra], **kw)


def _put(address: str, objs: dict[bytes, bytes], token: str | None = None) -> list[int]:
    keys = list(objs)
    with tcp.connect(address, timeout_s=30, auth_token=token) as c:
        msg = p.PutRequest(keys, [len(objs[k]) for k in keys], [p.checksum(k, objs[k]) for k in keys])
        return list(c.request(msg, [objs[k] for k in keys]).msg.status)


def _get(address: str, keys: list[bytes], token: str | None = None) -> list[bytes | None]:
    """GET through a plain TCP connection; each object checked against the checksum the server sent."""
    with tcp.connect(address, timeout_s=30, auth_token=token) as c:
        reply = c.request(p.GetRequest(keys))
    out: list[bytes | None] = []
    payload, off = bytes(reply.payload or b""), 0
    for k, n, ck in zip(keys, reply.msg.sizes, reply.msg.checksums):
        if n < 0:
            out.append(None)
            continue
        v = payload[off:off + n]
        off += n
        assert p.checksum(k, v) == ck
        out.append(v)
    return out


def _stats(address: str, token: str | None = None) -> dict:
    with tcp.connect(address, timeout_s=30, auth_token=token) as c:
        return c.request(p.StatsRequest()).msg.stats


def _written(address: str, n: int) -> bool:
    st = _stats(address)
    return st["shared_writes"] + st["shared_exists"] >= n


def _files(shared: str) -> list[str]:
    return sorted(glob.glob(os.path.join(shared, "*", "*", "*.kvf")))


def _file_of(shared: str, key: bytes) -> str:
    (path,) = glob.glob(os.path.join(shared, "*", "*", key.hex() + ".kvf"))
    return path


@pytest.fixture
def shared(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    return str(d)


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.kill()


def test_a_key_put_to_a_is_served_by_b_with_exact_bytes(shared, servers):
    a = _serve(shared, "--shared-fsync", "always")
    b = _serve(shared, capacity="64MiB")  # one GET reads them all: 4.2 MiB, within its 16 MiB promotion cap
    servers += [a, b]
    sizes = [0, 1, 4095, 4096, 100_000, 1 << 20, (3 << 20) + 7]
    objs = {b"obj-%d" % i: _value(b"obj-%d" % i, n) for i, n in enumerate(sizes)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
    assert wait_for(lambda: _written(a.address, len(objs)), WAIT_S), _stats(a.address)
    assert len(_files(shared)) == len(objs)
    assert not glob.glob(os.path.join(shared, "*", "*", ".*"))  # no temporary left behind

    keys = list(objs)
    assert _get(b.address, keys + [b"never-put"]) == [objs[k] for k in keys] + [None]
    st = _stats(b.address)
    assert st["shared_hits"] == len(objs) and st["shared_corrupt"] == 0 and st["shared_errors"] == 0
    assert st["shared_read_bytes"] == sum(sizes)
    assert st["shared_misses"] >= 1
    assert {k for k in st if k.startswith("shared_")} == set(SHARED_STATS_FIELDS)
    assert not [k for k in st if k.startswith("ssd_")]  # the tier thread runs, but there is no SSD tier
    sa = _stats(a.address)
    assert (sa["shared_writes"], sa["shared_write_bytes"], sa["shared_errors"]) == (len(objs), sum(sizes), 0)
    # B holds them now (promoted into its arena): served again from DRAM, no second shared read
    assert _get(b.address, keys) == [objs[k] for k in keys]
    st = _stats(b.address)
    assert st["shared_hits"] == len(objs) and st["objects"] == len(objs)
    assert _put(b.address, {k: objs[k] for k in keys[:2]}) == [p.PutStatus.EXISTS] * 2
    # written once by key: a third server PUT the same objects; its writes find the files there
    c = _serve(shared)
    servers.append(c)
    assert _put(c.address, {k: objs[k] for k in keys[:3]}) == [p.PutStatus.STORED] * 3
    assert wait_for(lambda: _stats(c.address)["shared_exists"] == 3, WAIT_S), _stats(c.address)
    assert _stats(c.address)["shared_writes"] == 0
    assert len(_files(shared)) == len(objs)


def test_without_shared_path_no_shared_stats():
    with start_server(capacity="4MiB") as srv:
        assert not [k for k in _stats(srv.address) if k.startswith("shared_")]


def test_b_serves_a_keys_after_a_is_sigkilled(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    objs = {b"k%03d" % i: _value(b"k%03d" % i, 1000 + 997 * i) for i in range(64)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
    assert wait_for(lambda: _written(a.address, len(objs)), WAIT_S)
    a.kill()
    keys = list(objs)
    assert _get(b.address, keys) == [objs[k] for k in keys]
    # and a fresh server that never saw them, started after A died
    c = _serve(shared)
    servers.append(c)
    assert _get(c.address, keys[::7]) == [objs[k] for k in keys[::7]]


def test_a_client_following_the_cluster_keeps_hitting_after_a_server_dies(etcd, shared, servers):
    cluster = "shared-tier"
    for sid in ("alpha", "beta"):
        servers.append(_serve(shared, "--etcd", etcd.url, "--cluster", cluster, "--etcd-ttl", "2",
                              "--server-id", sid))
    cfg = ClientConfig(timeout_s=10.0, connect_timeout_s=2.0)
    with Client(etcd=etcd.url, cluster=cluster, config=cfg) as client:
        assert wait_for(lambda: sorted(client.members) == ["alpha", "beta"], WAIT_S), client.members
        keys = [random.Random(i).randbytes(16) for i in range(200)]
        values = [_value(k, 2000 + 16 * k[0]) for k in keys]
        assert client.put(keys, values).stored == len(keys)
        assert wait_for(lambda: sum(_stats(s.address)["shared_writes"] for s in servers) == len(keys), WAIT_S)
        held_by_alpha = _stats(servers[0].address)["objects"]
        assert 0 < held_by_alpha < len(keys)
        servers[0].kill()  # SIGKILL alpha: it leaves the cluster when its lease expires
        assert wait_for(lambda: client.members == ("beta",), WAIT_S), client.members
        assert wait_for(lambda: client.get(keys) == values, WAIT_S), "beta did not serve alpha's keys"
        st = _stats(servers[1].address)
        assert st["shared_hits"] >= held_by_alpha and st["shared_corrupt"] == 0


def test_a_static_list_with_replicas_2_reads_the_second_owner_after_the_first_dies(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    keys = [random.Random(1000 + i).randbytes(16) for i in range(100)]
    values = [_value(k, 3000) for k in keys]
    # written with one copy: each key to its owner only
    with Client([a.address, b.address], config=ClientConfig(timeout_s=10.0)) as writer:
        assert writer.put(keys, values).stored == len(keys)
    assert wait_for(lambda: sum(_stats(s.address)["shared_writes"] for s in (a, b)) == len(keys), WAIT_S)
    a.kill()
    cfg = ClientConfig(timeout_s=10.0, connect_timeout_s=2.0, replicas=2)
    with Client([a.address, b.address], config=cfg) as reader:
        assert reader.get(keys) == values  # A's keys: A is dead, B (the second owner) reads them from DIR


def test_corrupt_torn_and_truncated_files_are_dropped_counted_and_never_served(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    objs = {k: _value(k, 50_000) for k in (b"flip-value", b"flip-header", b"truncated", b"grown", b"empty",
                                              b"good")}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
    assert wait_for(lambda: _written(a.address, len(objs)), WAIT_S)

    def damage(key: bytes, fn) -> None:
        path = _file_of(shared, key)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        with open(path, "wb") as f:
            f.write(fn(data))

    damage(b"flip-value", lambda d: d[:-100] + bytes([d[-100] ^ 1]) + d[-99:])
    damage(b"flip-header", lambda d: d[:20] + bytes([d[20] ^ 0x80]) + d[21:])  # the value size
    damage(b"truncated", lambda d: d[: len(d) // 2])  # torn: a crash before the bytes reached the disk
    damage(b"grown", lambda d: d + b"\0" * 4096)
    damage(b"empty", lambda d: b"")
    bad = [b"flip-value", b"flip-header", b"truncated", b"grown", b"empty"]
    assert _get(b.address, bad + [b"good"]) == [None] * len(bad) + [objs[b"good"]]
    st = _stats(b.address)
    assert st["shared_corrupt"] == len(bad) and st["shared_hits"] == 1
    assert [os.path.basename(f) for f in _files(shared)] == [b"good".hex() + ".kvf"]  # the bad ones are gone
    # once dropped, the key can be written again (by a server that holds it) and served
    c = _serve(shared)
    servers.append(c)
    assert _put(c.address, {b"truncated": objs[b"truncated"]}) == [p.PutStatus.STORED]
    assert wait_for(lambda: _stats(c.address)["shared_writes"] == 1, WAIT_S)
    d = _serve(shared)
    servers.append(d)
    assert _get(d.address, [b"truncated"]) == [objs[b"truncated"]]


def test_a_temporary_left_by_a_crashed_writer_is_never_served(shared, servers):
    a = _serve(shared)
    servers.append(a)
    objs = {b"half-written": _value(b"half-written", 70_000), b"complete-tmp": _value(b"complete-tmp", 70_000)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * 2
    assert wait_for(lambda: _written(a.address, 2), WAIT_S)
    a.kill()
    # What a writer that died before its rename leaves: its temporary, whole or torn, and no final name.
    for key, keep in ((b"half-written", 0.5), (b"complete-tmp", 1.0)):
        path = _file_of(shared, key)
        with open(path, "rb") as f:
            data = f.read()
        tmp = os.path.join(os.path.dirname(path), f".{key.hex()}.{'ab' * 8}.{0:016x}.tmp")
        with open(tmp, "wb") as f:
            f.write(data[: int(len(data) * keep)])
        os.unlink(path)
    b = _serve(shared)
    servers.append(b)
    assert _get(b.address, list(objs)) == [None, None]
    st = _stats(b.address)
    assert st["shared_misses"] == 2 and st["shared_hits"] == 0 and st["shared_corrupt"] == 0
    # a PUT of the same key writes its own file beside the stale temporary, and that one is served
    assert _put(b.address, {b"complete-tmp": objs[b"complete-tmp"]}) == [p.PutStatus.STORED]
    assert wait_for(lambda: _stats(b.address)["shared_writes"] == 1, WAIT_S)
    c = _serve(shared)
    servers.append(c)
    assert _get(c.address, [b"complete-tmp"]) == [objs[b"complete-tmp"]]


def _serve_fails(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfabric", "serve", "--port", "0", "--capacity", "4MiB", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_missing_or_unusable_directory_stops_the_server_with_a_clear_message(tmp_path):
    missing = _serve_fails("--shared-path", str(tmp_path / "not-there"))
    assert missing.returncode == 2 and "--shared-path" in missing.stderr and "no such directory" in missing.stderr
    a_file = tmp_path / "file"
    a_file.write_text("x")
    not_dir = _serve_fails("--shared-path", str(a_file))
    assert not_dir.returncode == 2 and "not a directory" in not_dir.stderr
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        unwritable = str(ro)
    else:  # root writes through mode bits; sysfs refuses new files even to root
        unwritable = "/sys"
    cannot = _serve_fails("--shared-path", unwritable)
    assert cannot.returncode == 2 and "cannot create files there" in cannot.stderr, cannot.stderr
    no_path = _serve_fails("--shared-fsync", "always")
    assert no_path.returncode == 2 and "--shared-fsync needs --shared-path" in no_path.stderr


def test_a_delete_removes_the_shared_file_so_the_key_does_not_come_back(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    objs = {b"keep": _value(b"keep", 9000), b"gone": _value(b"gone", 9000)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * 2
    assert wait_for(lambda: _written(a.address, 2), WAIT_S)
    with tcp.connect(a.address, timeout_s=30) as c:
        assert c.request(p.DeleteRequest([b"gone"])).msg.deleted == 1
    assert wait_for(lambda: len(_files(shared)) == 1, WAIT_S), _files(shared)
    assert _get(a.address, [b"gone", b"keep"]) == [None, objs[b"keep"]]
    assert _get(b.address, [b"gone", b"keep"]) == [None, objs[b"keep"]]


def test_a_full_arena_still_takes_shared_objects_in_by_evicting(shared, servers):
    a = _serve(shared)
    # B: 64 pages, evicting only when a slot is wanted, full of its own objects
    b = start_server(capacity=64 * 4096, extra_args=["--shared-path", shared, "--evict-watermarks", "0,0"])
    servers += [a, b]
    own = {b"own-%02d" % i: _value(b"own-%02d" % i, 4000) for i in range(64)}
    assert _put(b.address, own) == [p.PutStatus.STORED] * 64
    assert _stats(b.address)["free_bytes"] == 0
    objs = {b"far-%d" % i: _value(b"far-%d" % i, 8000) for i in range(6)}  # 48 KiB: within the 64 KiB cap
    assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
    assert wait_for(lambda: _written(a.address, len(objs)), WAIT_S)
    keys = list(objs)
    assert _get(b.address, keys) == [objs[k] for k in keys]  # each read parked for space, then promoted
    st = _stats(b.address)
    assert st["shared_hits"] == len(objs) and st["evictions"] > 0


def test_lookup_counts_and_promotes_keys_found_in_the_shared_tier(shared, servers):
    a, b = _serve(shared), _serve(shared)
    servers += [a, b]
    keys = [b"chain-%d" % i for i in range(8)]
    # the pool holds blocks 0-4 and 6-7 of the prompt; block 5 is missing, so the leading run is 5
    objs = {k: _value(k, 5000) for k in keys[:5] + keys[6:]}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * 7
    assert wait_for(lambda: _written(a.address, 7), WAIT_S)
    with tcp.connect(b.address, timeout_s=30) as c:
        assert c.request(p.LookupRequest(keys)).msg.count == 5
    st = _stats(b.address)
    assert st["objects"] == 5 and st["shared_hits"] == 5  # the GET that follows is a DRAM hit
    assert st["shared_misses"] == 1 and st["shared_reads"] == 5  # nothing read past the first miss
    assert _get(b.address, keys[:5]) == [objs[k] for k in keys[:5]]
    assert _stats(b.address)["shared_hits"] == 5


def test_writes_over_the_queue_bound_are_dropped_and_counted(shared, servers):
    # an 8 KiB write queue cannot hold a 16 KiB object: every write-through is a counted drop
    a = _serve(shared, "--ssd-write-queue", "8KiB")
    servers.append(a)
    objs = {b"big-%d" % i: _value(b"big-%d" % i, 16_384) for i in range(5)}
    small = {b"small": b"s" * 100}
    assert _put(a.address, {**objs, **small}) == [p.PutStatus.STORED] * 6
    assert wait_for(lambda: _stats(a.address)["shared_writes"] == 1, WAIT_S)
    st = _stats(a.address)
    assert st["shared_write_drops"] == 5 and st["shared_errors"] == 0
    assert [os.path.basename(f) for f in _files(shared)] == [b"small".hex() + ".kvf"]
    assert _get(a.address, list(objs)) == list(objs.values())  # DRAM serves them all the same


def test_objects_put_through_shm_are_written_through_too(shared, servers):
    from kvfabric import transport

    if "shm" not in transport.available():
        pytest.skip(f"shm unavailable here: {transport.unavailable().get('shm')}")
    a = _serve(shared, "--transports", "tcp,native,shm")
    b = _serve(shared)
    servers += [a, b]
    keys = [b"shm-%d" % i for i in range(20)]
    values = [_value(k, 30_000 + i) for i, k in enumerate(keys)]
    with Client([a.address], config=ClientConfig(transport="shm", timeout_s=10.0)) as client:
        assert client.put(keys, values).stored == len(keys)  # SHM_RESERVE, copy into the arena, SHM_COMMIT
    assert wait_for(lambda: _stats(a.address)["shared_writes"] == len(keys), WAIT_S), _stats(a.address)
    assert _get(b.address, keys) == values


def test_a_clean_stop_writes_everything_still_queued(shared):
    a = _serve(shared)
    objs = {b"q-%02d" % i: _value(b"q-%02d" % i, 200_000) for i in range(40)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
    assert a.stop(timeout_s=120) == 0  # SIGTERM straight after the PUT: the tier thread drains its queue first
    assert "shared: 0 hits, 40 writes, 0 drops, 0 errors, 0 corrupt" in a.stderr_text()
    assert len(_files(shared)) == len(objs)


def test_files_land_where_the_notes_say_in_format_1_and_writers_sweep_stale_temporaries(shared, servers):
    import struct
    import time

    import xxhash

    key, value = b"layout-key", _value(b"layout-key", 12_345)
    h = xxhash.xxh3_64_intdigest(key)
    d = os.path.join(shared, f"{h & 0xff:02x}", f"{(h >> 8) & 0xff:02x}")  # DIR/xx/yy: low bytes of xxh3_64(key)
    os.makedirs(d)
    stale = os.path.join(d, f".{'ab' * 16}.{'cd' * 8}.{0:016x}.tmp")  # a writer that died two hours ago
    fresh = os.path.join(d, f".{'ef' * 16}.{'cd' * 8}.{1:016x}.tmp")  # one still writing
    for path in (stale, fresh):
        with open(path, "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    a = _serve(shared)
    servers.append(a)
    assert _put(a.address, {key: value}) == [p.PutStatus.STORED]  # its first write also sweeps its directory
    assert wait_for(lambda: _stats(a.address)["shared_writes"] == 1, WAIT_S)
    assert not os.path.exists(stale) and os.path.exists(fresh)
    with open(os.path.join(d, key.hex() + ".kvf"), "rb") as f:
        data = f.read()
    k = len(key)
    assert data[:4] == b"KVFS" and struct.unpack_from("<HHB7s", data, 4) == (1, 40 + k, k, bytes(7))
    assert struct.unpack_from("<QQ", data, 16) == (len(value), p.checksum(key, value))
    assert data[32:32 + k] == key
    assert struct.unpack_from("<Q", data, 32 + k)[0] == xxhash.xxh3_64_intdigest(data[:32 + k])
    assert data[40 + k:] == value


def test_shared_reads_in_flight_stay_within_the_promotion_cap(shared, servers):
    a = _serve(shared)
    # B: a 16 MiB arena, so the promotion cap (a quarter of it) is 4 MiB of staging buffers
    b = _serve(shared)
    servers += [a, b]
    objs = {b"mib-%d" % i: _value(b"mib-%d" % i, 1 << 20) for i in range(8)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
    assert wait_for(lambda: _written(a.address, len(objs)), WAIT_S)
    keys = list(objs)
    first = _get(b.address, keys)  # one request: 4 MiB read from DIR, the rest are misses (never a wait)
    assert first == [objs[k] for k in keys[:4]] + [None] * 4
    assert _get(b.address, keys) == [objs[k] for k in keys]  # 4 from DRAM, 4 more from DIR: the cap was given back
    assert _stats(b.address)["shared_hits"] == 8
