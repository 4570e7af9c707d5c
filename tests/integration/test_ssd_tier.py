"""The SSD tier of ``kvfabric serve`` (``--ssd-path``), on real server processes.

Objects evicted from a small arena are written behind to the tier and come
back on GET with their exact bytes; a restart (SIGTERM or SIGKILL) serves
what reached the tier; corrupt records are dropped and counted, never served;
DELETE survives a restart; LOOKUP promotes; bad paths and a full disk give a
clear start-up error (exit 2); a disk that stops taking writes costs counted
drops while DRAM keeps serving. No timed assertions: every wait is a
generous ``wait_for`` on STATS.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvfabric import Client, ClientConfig, LookupRun
from kvfabric import protocol as p
from kvfabric.testing import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp

SZ = 256 * 1024
#: where tier files go (a filesystem with O_DIRECT); default: the system's temporary directory
TMP = os.environ.get("KVFABRIC_TIER_TEST_DIR") or None
TIER_FILE = "kvfabric-tier.v1"
REC_MAGIC = b"KVFTREC1"


def value(key: bytes, size: int = SZ) -> bytes:
    """Distinct bytes per key (and per offset): a wrong object can never look right."""
    block = (key + b"|") * (64 // (len(key) + 1) + 1)
    out = bytearray()
    i = 0
    while len(out) < size:
        out += block + struct.pack("<I", i)
        i += 1
    return bytes(out[:size])


def tier_args(d: str, cap: str = "64MiB", *extra: str) -> list[str]:
    # evictions on demand only: which objects leave DRAM is exact (LRU order)
    return ["--ssd-path", d, "--ssd-capacity", cap, "--evict-watermarks", "0,0", *extra]


def put_all(c, keys: list[bytes], size: int = SZ) -> None:
    for k in keys:
        v = value(k, size)
        assert c.request(p.PutRequest([k], [size], [p.checksum(k, v)]), [v]).msg.status == [p.PutStatus.STORED]


def stats(c) -> dict:
    return c.request(p.StatsRequest()).msg.stats


def settled(c) -> dict:
    """STATS once the write-behind queue is empty."""
    assert wait_for(lambda: stats(c)["ssd_queue_bytes"] == 0, timeout_s=60)
    return stats(c)


def get_one(c, k: bytes) -> bytes | None:
    r = c.request(p.GetRequest([k]))
    if r.msg.sizes[0] < 0:
        return None
    assert p.checksum(k, bytes(r.payload)) == r.msg.checksums[0]
    return bytes(r.payload)


def get_streamed_miss(c, address: str, k: bytes):
    """GET k whose SSD record is bad: a miss. The server streams an SSD object (its size is in the reply's
    metadata before the record is read), so a record that fails its check closes the connection before
    any of its bytes instead (what a Client counts as a miss): then a new connection. Returns
    (connection to go on with, closed?); fails if any bytes came back."""
    from kvfabric.errors import ConnectionClosed

    try:
        got = get_one(c, k)
    except ConnectionClosed:
        c.close()
        return tcp.connect(address, timeout_s=60), True
    assert got is None, f"a bad SSD record was served: {len(got)} bytes"
    return c, False


def record_offsets(path: str) -> dict[bytes, int]:
    """key -> file offset of its record header (scanning the 4 KiB blocks for the record magic)."""
    out: dict[bytes, int] = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = data.find(REC_MAGIC)
    while pos >= 0:
        if pos % 4096 == 0:
            klen = struct.unpack_from("<I", data, pos + 48)[0]
            if 0 < klen <= 64:
                out[data[pos + 56:pos + 56 + klen]] = pos
        pos = data.find(REC_MAGIC, pos + 1)
    return out


def flip(path: str, off: int, n: int = 8) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(n)
        f.seek(off)
        f.write(bytes(x ^ 0xFF for x in b))
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- read back


def test_evicted_objects_come_back_from_ssd_with_exact_bytes(tier_dir):
    keys = [b"obj%04d" % i for i in range(48)]  # 12 MiB through a 4 MiB arena (16 objects)
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys)
        st = settled(c)
        evicted = st["evictions"]
        assert evicted == 32 and st["objects"] == 16
        assert st["ssd_writes"] == 32 and st["ssd_objects"] == 32 and st["ssd_bytes"] == 32 * SZ
        assert st["ssd_write_bytes"] == 32 * (4096 + SZ) and st["ssd_write_drops"] == 0
        assert all(c.request(p.ExistsRequest(keys)).msg.present)  # EXISTS sees the tier without reading
        assert stats(c)["ssd_reads"] == 0
        for k in keys[:32]:  # the evicted ones, oldest first: each read back and promoted
            assert get_one(c, k) == value(k)
        st = settled(c)
        assert st["ssd_hits"] == 32 and st["ssd_promotions"] == 32 and st["ssd_reads"] == 32
        assert st["ssd_read_bytes"] == 32 * (4096 + SZ) and st["ssd_misses"] == 0 and st["ssd_corrupt"] == 0
        assert st["hits"] == 32 and st["misses"] == 0
        # promoted objects stayed on the tier: evicting them again writes nothing new
        assert st["ssd_admit_skips"] >= 16 and st["ssd_errors"] == 0
        # a batch GET mixing DRAM hits, tier hits and a true miss
        r = c.request(p.GetRequest([keys[40], keys[0], b"absent", keys[47]]))
        assert r.msg.sizes == [SZ, SZ, -1, SZ]
        assert bytes(r.payload) == value(keys[40]) + value(keys[0]) + value(keys[47])
        assert stats(c)["ssd_misses"] == 1


def test_admit_hit_writes_only_objects_read_in_dram(tier_dir):
    keys = [b"adm%04d" % i for i in range(24)]
    with start_server("4MiB", extra_args=tier_args(tier_dir, "64MiB", "--ssd-admit", "hit")) as srv, \
            tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys[:8])
        for k in keys[:4]:
            assert get_one(c, k) == value(k)
        put_all(c, keys[8:])
        st = settled(c)
        # LRU order after the reads: 4,5,6,7,0,1,2,3: the 8 evicted are those, 4 never read
        assert st["evictions"] == 8
        assert st["ssd_writes"] == 4 and st["ssd_admit_skips"] == 4
        assert get_one(c, keys[0]) == value(keys[0])
        assert get_one(c, keys[5]) is None


# ---------------------------------------------------------------- restarts


def _fill_and_settle(d: str, keys: list[bytes]) -> list[bytes]:
    """Start, put keys, wait for the write-behind; returns the evicted keys (on the tier)."""
    srv = start_server("4MiB", extra_args=tier_args(d))
    c = tcp.connect(srv.address, timeout_s=60)
    put_all(c, keys)
    st = settled(c)
    n = st["evictions"]
    assert st["ssd_objects"] == n and st["ssd_write_drops"] == 0
    return srv, c, keys[:n]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_restart_serves_what_reached_the_tier(tier_dir, how):
    keys = [b"rst%04d" % i for i in range(64)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    c.close()
    if how == "SIGKILL":
        srv.kill()
    else:
        assert srv.stop() == 0
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv2, tcp.connect(srv2.address, timeout_s=60) as c2:
        st = stats(c2)
        assert st["ssd_objects"] == len(on_tier) and st["ssd_corrupt"] == 0
        served = wrong = 0
        for k in on_tier:
            got = get_one(c2, k)
            if got is not None:
                served += 1
                wrong += got != value(k)
        assert wrong == 0
        assert served >= 0.99 * len(on_tier)
        assert served == len(on_tier)  # nothing was in flight: every record is whole


def test_restart_after_sigkill_mid_write_behind_never_serves_wrong_bytes(tier_dir):
    keys = [b"mid%04d" % i for i in range(96)]
    srv = start_server("4MiB", extra_args=tier_args(tier_dir))
    with tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys)
        written = stats(c)["ssd_writes"]  # some writes may still be queued or in flight now
    srv.kill()
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv2, tcp.connect(srv2.address, timeout_s=60) as c2:
        served = 0
        for k in keys[:80]:  # the evicted ones
            got = get_one(c2, k)
            if got is not None:
                assert got == value(k)
                served += 1
        assert served >= 0.99 * written  # what had been written before the kill is there


# ---------------------------------------------------------------- corruption


def test_corrupt_records_are_dropped_and_counted_never_served(tier_dir):
    keys = [b"cor%04d" % i for i in range(48)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    c.close()
    assert srv.stop() == 0
    path = os.path.join(tier_dir, TIER_FILE)
    offs = record_offsets(path)
    assert set(on_tier) <= set(offs)
    bad_value, bad_header = on_tier[3], on_tier[7]
    flip(path, offs[bad_value] + 4096 + 1000)  # value bytes: found on read
    flip(path, offs[bad_header] + 60)  # key bytes in the header: found by the start-up scan
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv2, tcp.connect(srv2.address, timeout_s=60) as c2:
        st = stats(c2)
        assert st["ssd_corrupt"] == 1 and st["ssd_objects"] == len(on_tier) - 1
        assert get_one(c2, bad_header) is None
        c2, _ = get_streamed_miss(c2, srv2.address, bad_value)  # read, failed its checksum: dropped, a miss
        st = stats(c2)
        assert st["ssd_corrupt"] == 2 and st["ssd_objects"] == len(on_tier) - 2
        assert get_one(c2, bad_value) is None and stats(c2)["ssd_reads"] == st["ssd_reads"]  # not read again
        for k in on_tier[8:16]:
            assert get_one(c2, k) == value(k)
        # and once while running: flip a value on disk under the live server
        offs = record_offsets(path)
        victim = on_tier[20]
        flip(path, offs[victim] + 4096 + 7)
        c2, closed = get_streamed_miss(c2, srv2.address, victim)
        st = stats(c2)
        assert st["ssd_corrupt"] == 3 and st["checksum_failures"] == 0, (closed, st)
        assert get_one(c2, victim) is None  # dropped: a plain miss now, not read again
        c2.close()


# ---------------------------------------------------------------- delete, lookup


def test_delete_removes_from_the_tier_and_does_not_resurrect(tier_dir):
    """Including a SIGKILL right after the DELETE was answered."""
    keys = [b"del%04d" % i for i in range(32)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    gone = on_tier[:5]
    writes = stats(c)["ssd_writes"]
    assert c.request(p.DeleteRequest(gone)).msg.deleted == 5
    # answered only once a tombstone per key was written: a SIGKILL right now cannot bring them back
    assert stats(c)["ssd_writes"] >= writes + 5
    srv.kill()
    c.close()
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv2, tcp.connect(srv2.address, timeout_s=60) as c2:
        assert stats(c2)["ssd_objects"] == len(on_tier) - 5
        assert not any(c2.request(p.ExistsRequest(gone)).msg.present)
        assert c2.request(p.DeleteRequest(gone)).msg.deleted == 0
        assert wait_for(lambda: stats(c2)["ssd_queue_bytes"] == 0)
        assert all(get_one(c2, k) is None for k in gone)
        assert get_one(c2, on_tier[5]) == value(on_tier[5])


def test_lookup_promotes_so_the_next_get_is_a_dram_hit(tier_dir):
    keys = [b"lku%04d" % i for i in range(32)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    with srv, c:
        run = on_tier[:3]  # (one request promotes at most a quarter of the 4 MiB arena: 4 objects)
        assert c.request(p.LookupRequest(run + [b"absent"] + on_tier[6:8])).msg.count == 3
        st = stats(c)
        assert st["ssd_promotions"] == 3 and st["ssd_reads"] == 3  # only the leading run is read
        r = c.request(p.GetRequest(run))
        assert bytes(r.payload) == b"".join(value(k) for k in run)
        assert stats(c)["ssd_reads"] == 3  # DRAM hits now
        assert c.request(p.LookupRequest(on_tier[8:16])).msg.count == 4  # the cap ends the run


def test_lookup_with_media_says_where_each_key_is_and_reads_nothing(tier_dir):
    """Issue 26 part 3: LOOKUP media counts SSD keys from the index (no read, no promotion) up to
    one request's promotion cap, as a GET could serve them, and names each counted key's medium;
    the GET that follows streams them."""
    keys = [b"lkm%04d" % i for i in range(32)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    with srv, c:
        in_dram = keys[len(on_tier):]
        run = [in_dram[0], *on_tier[:4], in_dram[1]]   # 4 SSD objects: one request's promotion cap
        r = c.request(p.LookupRequest(run + [b"absent", in_dram[2]], media=True)).msg
        assert (r.count, list(r.media)) == (6, [p.MEDIUM_DRAM] + [p.MEDIUM_SSD] * 4 + [p.MEDIUM_DRAM]), r
        r = c.request(p.LookupRequest(on_tier[10:16], media=True)).msg  # past the cap the run ends
        assert (r.count, list(r.media)) == (4, [p.MEDIUM_SSD] * 4), r
        st = stats(c)
        assert st["ssd_reads"] == 0 and st["ssd_promotions"] == 0, st
        # without media the reply has no media and the run is read and promoted, as before
        plain = c.request(p.LookupRequest(on_tier[6:8])).msg
        assert (plain.count, plain.media) == (2, None)
        assert stats(c)["ssd_reads"] == 2
        # what a media LOOKUP counted is served by GET, streamed from the disk
        got = c.request(p.GetRequest(on_tier[:4]))
        assert got.msg.sizes == [SZ] * 4 and bytes(got.payload) == b"".join(value(k) for k in on_tier[:4])
        # a key whose medium changed is said as it is now
        r = c.request(p.LookupRequest(on_tier[:2], media=True)).msg
        assert list(r.media) == [p.MEDIUM_DRAM] * 2, r
        # the Client's view: the run and how much of it only the SSD tier holds
        with Client([srv.address], config=ClientConfig(transport="native")) as cl:
            run = [in_dram[0], *on_tier[:6], in_dram[1]]
            assert cl.lookup_media(run + [b"absent"]) == LookupRun(8, 2)  # the GET promoted on_tier[:4]
            assert cl.lookup_media(run, media=False) == LookupRun(8, None)


def test_one_request_promotes_at_most_a_quarter_of_the_arena(tier_dir):
    keys = [b"cap%04d" % i for i in range(40)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    with srv, c:
        batch = on_tier[:8]  # 2 MiB asked, 1 MiB (4 objects) allowed
        r = c.request(p.GetRequest(batch))
        assert r.msg.sizes == [SZ] * 4 + [-1] * 4
        assert bytes(r.payload) == b"".join(value(k) for k in batch[:4])
        st = stats(c)
        assert st["ssd_promotions"] == 4 and st["ssd_misses"] == 4



@pytest.mark.parametrize("size, pages", [(1024, 1), (6000, 2)])
def test_the_promotion_cap_counts_arena_slots_not_bytes(tier_dir, size, pages):
    """Objects smaller than their slots: one request still promotes at most a quarter of the arena's
    slots (1 MiB of a 4 MiB arena = 256 pages), each object counting its whole pages, as the replay's
    simulator caps it (counting bytes let 1 KiB objects promote 1024, four times the model's 256)."""
    keys = [b"slot%05d" % i for i in range(2 * 1024 // pages + 300)]
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys, size)
        st = settled(c)
        on_tier = keys[:st["evictions"]]
        cap = (1 << 20) // (pages * 4096)
        assert len(on_tier) > cap + 10, (len(on_tier), cap, st)
        batch = on_tier[:cap + 10]
        r = c.request(p.GetRequest(batch))
        got = [s for s in r.msg.sizes if s >= 0]
        assert r.msg.sizes == [size] * cap + [-1] * 10, (got[:3], len(got), cap)
        assert bytes(r.payload) == b"".join(value(k, size) for k in batch[:cap])
        after = stats(c)
        assert after["ssd_promotions"] - st["ssd_promotions"] == cap, (after["ssd_promotions"], st["ssd_promotions"])


def test_the_index_grows_past_its_first_buckets_and_finds_every_key(tier_dir):
    """Over 1024 objects on the tier: the index's buckets double (at the same moment its entry array
    does) and every key stays findable and removable. MALLOC_PERTURB_ makes glibc fill fresh memory
    with a nonzero byte, so an entry read before it is initialised never looks free by luck: the
    index used to link such an entry under a garbage hash, which lost other keys (EXISTS false for a
    key on the tier) and crashed the server (a GP fault in kvf_tier_iremove) when one was removed."""
    keys = [b"grow%05d" % i for i in range(1024 + 1400)]
    env = dict(os.environ, MALLOC_PERTURB_="165")
    with start_server("4MiB", extra_args=tier_args(tier_dir), env=env) as srv, \
            tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys, 1024)
        st = settled(c)
        on_tier = keys[:st["evictions"]]
        assert st["ssd_objects"] == len(on_tier) > 1100, st
        present = c.request(p.ExistsRequest(on_tier)).msg.present
        lost = [k for k, here in zip(on_tier, present) if not here]
        assert not lost, f"{len(lost)} of {len(on_tier)} keys on the tier not found, first {lost[:3]}"
        deleted = c.request(p.DeleteRequest(keys)).msg.deleted
        assert deleted == len(keys), (deleted, len(keys))
        assert srv.alive and c.request(p.PingRequest()).msg is not None, srv.stderr_text()[-2000:]
        assert stats(c)["ssd_objects"] == 0


def test_multi_key_gets_during_write_behind_are_exact_and_traced(tier_dir):
    """4-key GETs from the tier while new PUTs keep the write-behind queue busy (a read posted during a
    write batch is submitted at once) on a full arena (each GET parks once for 4 slots): exact bytes,
    and KVFABRIC_TIER_TRACE writes one line per parked GET naming every stage."""
    old = [b"wbo%04d" % i for i in range(40)]
    new = [b"wbn%04d" % i for i in range(32)]
    trace = os.path.join(tier_dir, "trace.txt")
    env = dict(os.environ, KVFABRIC_TIER_TRACE=trace)
    with start_server("4MiB", extra_args=tier_args(tier_dir), env=env) as srv, \
            tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, old)
        settled(c)
        on_tier = old[:16]  # the first evicted (LRU), all written
        gets = 0
        for i, k in enumerate(new):
            put_all(c, [k])  # evicts one more object: a write-behind job
            if i % 8 == 0:
                batch = on_tier[(i // 8) * 4:(i // 8) * 4 + 4]
                r = c.request(p.GetRequest(batch))
                assert r.msg.sizes == [SZ] * 4
                assert bytes(r.payload) == b"".join(value(k) for k in batch)
                gets += 1
        st = settled(c)
        assert st["ssd_promotions"] == 4 * gets and st["ssd_corrupt"] == 0
    lines = [dict(kv.split("=") for kv in ln.split()) for ln in open(trace)]
    assert len([d for d in lines if d["n"] == "4"]) == gets
    for d in lines:
        assert {"space_us", "queue_us", "io_us", "verify_us", "back_us", "promote_us", "redispatch_us",
                "total_us"} <= d.keys()


# ---------------------------------------------------------------- streamed GETs


def test_pipelined_gets_mixing_dram_and_ssd_keys_are_exact_and_in_order(tier_dir):
    """A streamed GET's reply is queued before its reads are back and the connection reads on: requests
    pipelined behind it (GETs that need the tier again wait for its reads, DRAM GETs, a DELETE of a key
    it is reading, a miss) are answered in order with exact bytes, and every SSD object is promoted."""
    from kvfabric.transport import native as tn

    keys = [b"pip%04d" % i for i in range(40)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    with srv, c, tn.connect(srv.address, timeout_s=60) as nc:
        hot = keys[-1]  # the last PUT: in DRAM
        batches = [[on_tier[0], hot, on_tier[1]], on_tier[2:6], [hot], [on_tier[6], b"absent", on_tier[7]],
                   on_tier[8:10], [on_tier[10]]]
        reqs = [(p.GetRequest(b), (), None) for b in batches[:3]]
        reqs.append((p.DeleteRequest([on_tier[2]]), (), None))  # behind the GET still reading it
        reqs += [(p.GetRequest(b), (), None) for b in batches[3:]]
        replies = nc.pipeline(reqs, deadline=time.monotonic() + 60)
        gets = [r for r in replies if isinstance(r.msg, p.GetReply)]
        assert replies[3].msg.deleted == 1
        assert len(gets) == len(batches)
        for b, r in zip(batches, gets):
            want = [None if k == b"absent" else value(k) for k in b]
            assert list(r.msg.sizes) == [-1 if v is None else len(v) for v in want], (b, r.msg.sizes)
            assert bytes(r.payload) == b"".join(v for v in want if v is not None), b
        st = settled(c)
        assert st["ssd_corrupt"] == 0 and st["pinned"] == 0, st
        assert get_one(c, on_tier[2]) is None  # deleted after it was sent: from DRAM and the tier
        assert get_one(c, on_tier[0]) == value(on_tier[0])  # promoted: a DRAM hit now
        assert stats(c)["ssd_reads"] == st["ssd_reads"]


def test_large_objects_stream_chunk_by_chunk_and_a_bad_chunk_is_never_served(tier_dir):
    """Values over 512 KiB are read in chunks and sent as each is checked, the last one held back until
    the whole checksum matched: exact bytes alone and next to DRAM keys; a record flipped in its first,
    a middle or its last chunk is dropped and counted, the GET a miss (the connection closed before the
    object's last chunk), never wrong bytes."""
    big = 1536 * 1024 + 100  # not a multiple of a chunk or a page
    keys = [b"big%04d" % i for i in range(20)]
    with start_server("16MiB", extra_args=tier_args(tier_dir, "128MiB")) as srv, \
            tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys, big)
        st = settled(c)
        on_tier = keys[:st["evictions"]]
        assert len(on_tier) >= 9 and st["ssd_objects"] == len(on_tier), st
        hot = keys[-1]
        r = c.request(p.GetRequest([on_tier[0], hot, on_tier[1]]))
        assert list(r.msg.sizes) == [big] * 3
        assert bytes(r.payload) == value(on_tier[0], big) + value(hot, big) + value(on_tier[1], big)
        for k in on_tier[2:5]:
            assert get_one(c, k) == value(k, big)
        path = os.path.join(tier_dir, TIER_FILE)
        offs = record_offsets(path)
        bad = {on_tier[5]: 4096 + 10, on_tier[6]: 4096 + 700 * 1024, on_tier[7]: 4096 + big - 5}
        for k, at in bad.items():
            flip(path, offs[k] + at)
        for n, k in enumerate(bad, 1):
            c, _ = get_streamed_miss(c, srv.address, k)
            st = stats(c)
            assert st["ssd_corrupt"] == n and st["checksum_failures"] == 0, (k, st)
            assert get_one(c, k) is None  # dropped: a plain miss now
        assert get_one(c, on_tier[8]) == value(on_tier[8], big)
        c.close()


def test_a_reader_that_stops_holds_at_most_one_request_of_slots_and_gives_them_back(tier_dir):
    """A peer pipelines GETs of SSD keys and never reads: its streamed replies not yet sent (reads in
    flight, promoted objects pinned) stay within one request's promotion cap (a quarter of the arena),
    the later requests wait; the server keeps serving others from DRAM and SSD; once it disconnects,
    every pin and reserved slot comes back."""
    import socket

    import msgpack

    keys = [b"stp%04d" % i for i in range(48)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    with srv, c:
        host, _, port = srv.address.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            for i in range(6):
                m = msgpack.packb({"keys": on_tier[4 * i:4 * i + 4]}, use_bin_type=True)
                s.sendall(p.pack_header(p.Op.GET, i + 1, len(m), 0) + m)
            last, still = None, 0
            while still < 4:  # the server stopped moving: its replies wait for the peer
                st = stats(c)
                now = (st["hits"], st["ssd_reads"], st["pinned"], st["bytes_allocated"])
                still = still + 1 if now == last else 0
                last = now
                time.sleep(0.2)
            cap = st["capacity"]
            # slots reserved for reads plus promoted objects pinned by its unsent replies: one promotion cap
            held = st["bytes_allocated"] - st["bytes_used"] + st["pinned"] * SZ
            assert 0 < held <= cap // 4, st
            # others are still served: a DRAM hit and an SSD read on another connection
            put_all(c, [b"stp-new"])
            assert get_one(c, b"stp-new") == value(b"stp-new")
            assert len(on_tier) >= 32 and get_one(c, on_tier[30]) == value(on_tier[30])
        finally:
            s.close()
        assert wait_for(lambda: (lambda st: st["pinned"] == 0 and st["bytes_allocated"] == st["bytes_used"])(
            stats(c)), timeout_s=60), stats(c)
        for k in on_tier[:24]:
            assert get_one(c, k) == value(k)


# ---------------------------------------------------------------- start-up errors


def _serve(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfabric", "serve", "--port", "0", "--capacity", "4MiB", *args],
                          capture_output=True, text=True, timeout=120)


def test_missing_path_is_a_clear_startup_error(tier_dir):
    r = _serve(["--ssd-path", os.path.join(tier_dir, "nope"), "--ssd-capacity", "16MiB"])
    assert r.returncode == 2
    assert "no such directory" in r.stderr and "nope" in r.stderr


def test_ssd_options_are_checked():
    assert _serve(["--ssd-path", "/tmp"]).returncode == 2
    assert _serve(["--ssd-capacity", "1GiB"]).returncode == 2


def test_capacity_too_small_for_two_segments(tier_dir):
    r = _serve(["--ssd-path", tier_dir, "--ssd-capacity", "1MiB"])
    assert r.returncode == 2 and "too small" in r.stderr


def _need_root_mount() -> None:
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("needs root and mkfs.ext4 to loop-mount a small filesystem")


@pytest.fixture
def small_fs() -> Iterator[str]:
    """A loop-mounted 8 MiB ext4 (about 6 MiB free), unmounted afterwards."""
    _need_root_mount()
    base = tempfile.mkdtemp(prefix="kvf-smallfs-", dir=TMP)
    img, mnt = os.path.join(base, "img"), os.path.join(base, "mnt")
    os.mkdir(mnt)
    subprocess.run(["truncate", "-s", "8M", img], check=True)
    subprocess.run(["mkfs.ext4", "-q", img], check=True)
    r = subprocess.run(["mount", "-o", "loop", img, mnt], capture_output=True, text=True)
    if r.returncode:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"cannot loop-mount here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "-u", mnt], capture_output=True)
        subprocess.run(["umount", "-l", mnt], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_disk_too_small_for_the_capacity_is_a_clear_startup_error(small_fs):
    r = _serve(["--ssd-path", small_fs, "--ssd-capacity", "64MiB"])
    assert r.returncode == 2
    assert "not enough space" in r.stderr


def test_read_only_path_is_a_clear_startup_error(small_fs):
    subprocess.run(["mount", "-o", "remount,ro", small_fs], check=True)
    r = _serve(["--ssd-path", small_fs, "--ssd-capacity", "4MiB"])
    assert r.returncode == 2
    assert "cannot open" in r.stderr and "Read-only" in r.stderr


def test_a_full_filesystem_after_start_does_not_matter(small_fs):
    """The tier file is preallocated: filling the rest of the disk changes nothing."""
    keys = [b"ful%04d" % i for i in range(24)]
    with start_server("4MiB", extra_args=tier_args(small_fs, "4MiB")) as srv, \
            tcp.connect(srv.address, timeout_s=60) as c:
        with open(os.path.join(small_fs, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        put_all(c, keys[:20])
        st = settled(c)
        assert st["ssd_errors"] == 0 and st["ssd_writes"] == st["evictions"] - st["ssd_admit_skips"]
        assert get_one(c, keys[0]) == value(keys[0])


def test_a_disk_that_stops_writing_costs_counted_drops_and_dram_keeps_serving(small_fs):
    """fsfreeze: writes to the tier block in the kernel; the write queue fills, further evictions are dropped
    (counted), the loop never waits for the disk: PUTs and GETs from DRAM go on."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("needs fsfreeze")
    keys = [b"frz%04d" % i for i in range(40)]
    args = tier_args(small_fs, "4MiB", "--ssd-write-queue", "1MiB")
    with start_server("4MiB", extra_args=args) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        subprocess.run(["fsfreeze", "-f", small_fs], check=True)
        try:
            put_all(c, keys)  # 24 evictions; the queue holds 3 records of 260 KiB
            assert wait_for(lambda: stats(c)["ssd_write_drops"] >= 20, timeout_s=60)
            for k in keys[-16:]:  # DRAM serves throughout
                assert get_one(c, k) == value(k)
            st = stats(c)
            assert st["ssd_queue_bytes"] <= 1 << 20
        finally:
            subprocess.run(["fsfreeze", "-u", small_fs], check=True)
        st = settled(c)
        assert st["ssd_write_drops"] + st["ssd_writes"] == st["evictions"]
        assert st["ssd_errors"] == 0


def test_filesystem_without_o_direct_is_a_clear_startup_error():
    """tmpfs lacked O_DIRECT on older kernels; where it has it (6.6+), there is no such filesystem at hand."""
    d = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    if d is None:
        pytest.skip("no /dev/shm")
    try:
        try:
            fd = os.open(os.path.join(d, "probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
            os.close(fd)
            pytest.skip("tmpfs supports O_DIRECT on this kernel: no filesystem without it to test with")
        except OSError:
            pass
        r = _serve(["--ssd-path", d, "--ssd-capacity", "4MiB"])
        assert r.returncode == 2 and "O_DIRECT" in r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_stats_schema_has_the_ssd_keys_only_with_a_tier(tier_dir):
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        st = stats(c)
        assert set(p.SSD_STATS_FIELDS) <= set(st)
        assert st["ssd_capacity"] > 0
    with start_server("4MiB") as srv, tcp.connect(srv.address, timeout_s=60) as c:
        assert not any(k.startswith("ssd_") for k in stats(c))



# ---------------------------------------------------------------- a tier file someone else put there (issue 22)

NOBODY = 65534


@pytest.fixture
def victim(tier_dir) -> Iterator[str]:
    """A root-only file outside the tier directory that a planted tier file points at."""
    d = tempfile.mkdtemp(prefix="kvf-victim-", dir=TMP)
    path = os.path.join(d, "secret")
    with open(path, "wb") as f:
        f.write(b"root-only bytes " * 256)
    os.chmod(path, 0o600)
    try:
        yield path
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("plant", ["symlink", "hard link", "owned by uid 65534", "mode 0666"])
def test_a_planted_tier_file_stops_the_start_and_nothing_is_written_through_it(tier_dir, victim, plant):
    """On main a symlink made root fallocate and overwrite its target, and a 0666 file another uid made
    was adopted (that uid then read evicted KV and forged records)."""
    tier_file = os.path.join(tier_dir, TIER_FILE)
    target = victim
    if plant == "symlink":
        os.symlink(victim, tier_file)
    elif plant == "hard link":
        os.link(victim, tier_file)
    else:
        if "65534" in plant and os.geteuid() != 0:
            pytest.skip("needs root to give a file to another uid")
        with open(tier_file, "wb") as f:
            f.write(b"planted " * 512)
        os.chown(tier_file, NOBODY if "65534" in plant else os.geteuid(), -1)
        os.chmod(tier_file, 0o666 if "0666" in plant else 0o600)
        target = tier_file
    with open(target, "rb") as f:
        before = f.read()
    r = _serve(tier_args(tier_dir, "16MiB"))
    why = {"symlink": "is a symbolic link", "hard link": "has 2 links", "owned by uid 65534": "belongs to uid 65534",
           "mode 0666": "has mode 666"}[plant]
    assert r.returncode == 2 and "--ssd-path" in r.stderr and why in r.stderr, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    with open(target, "rb") as f:
        assert f.read() == before, f"{target} was written through the planted {plant}"
    assert os.stat(target).st_size == len(before)


def test_a_new_tier_file_is_0600_and_the_servers_own(tier_dir):
    with start_server("4MiB", extra_args=tier_args(tier_dir, "16MiB")):
        st = os.lstat(os.path.join(tier_dir, TIER_FILE))
    assert (st.st_mode & 0o7777, st.st_uid, st.st_nlink) == (0o600, os.geteuid(), 1)


def test_a_tier_file_serves_one_server_at_a_time(tier_dir):
    with start_server("4MiB", extra_args=tier_args(tier_dir)):
        r = _serve(tier_args(tier_dir))
        assert r.returncode == 2 and "in use by another server" in r.stderr


def test_two_paths_are_striped_and_both_survive_a_restart(tier_dir):
    d1, d2 = os.path.join(tier_dir, "a"), os.path.join(tier_dir, "b")
    os.mkdir(d1)
    os.mkdir(d2)
    args = ["--ssd-path", d1, "--ssd-path", d2, "--ssd-capacity", "64MiB", "--evict-watermarks", "0,0"]
    keys = [b"two%04d" % i for i in range(160)]  # 40 MiB: 144 records over 1 MiB segments of both files
    with start_server("4MiB", extra_args=args) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys)
        st = settled(c)
        on_tier = keys[:st["evictions"]]
        assert st["ssd_objects"] == len(on_tier)
        srv.kill()
    assert record_offsets(os.path.join(d1, TIER_FILE)) and record_offsets(os.path.join(d2, TIER_FILE))
    with start_server("4MiB", extra_args=args) as srv2, tcp.connect(srv2.address, timeout_s=60) as c2:
        assert stats(c2)["ssd_objects"] == len(on_tier)
        for k in on_tier[::7]:
            assert get_one(c2, k) == value(k)


def test_a_new_geometry_starts_an_empty_tier_never_old_bytes(tier_dir):
    keys = [b"geo%04d" % i for i in range(32)]
    srv, c, on_tier = _fill_and_settle(tier_dir, keys)
    c.close()
    assert srv.stop() == 0
    with start_server("4MiB", extra_args=tier_args(tier_dir, "32MiB")) as srv2, \
            tcp.connect(srv2.address, timeout_s=60) as c2:
        st = stats(c2)
        assert st["ssd_objects"] == 0 and st["ssd_corrupt"] == 0  # old records: another file id, not records
        assert all(get_one(c2, k) is None for k in on_tier)
        assert os.path.getsize(os.path.join(tier_dir, TIER_FILE)) <= 32 << 20


def test_the_tier_never_exceeds_its_capacity_and_reuses_the_oldest_segment(tier_dir):
    keys = [b"wrap%04d" % i for i in range(120)]  # 30 MiB through a 4 MiB tier: the log wraps many times
    with start_server("4MiB", extra_args=tier_args(tier_dir, "4MiB")) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        put_all(c, keys)
        st = settled(c)
        assert st["ssd_bytes"] <= st["ssd_capacity"] <= 4 << 20
        # no index entry outlives its record: at most 3 records of 260 KiB fit in each 1 MiB segment
        assert st["ssd_objects"] <= (st["ssd_capacity"] >> 20) * 3 and st["ssd_bytes"] == st["ssd_objects"] * SZ
        assert os.path.getsize(os.path.join(tier_dir, TIER_FILE)) <= 4 << 20
        evicted = keys[:st["evictions"]]
        newest = evicted[-st["ssd_objects"]:]  # FIFO: what is left on the tier is the newest
        oldest = evicted[:8]
        assert all(get_one(c, k) is None for k in oldest)
        assert get_one(c, newest[-1]) == value(newest[-1])
