"""STATS of the native server: O(1) counters that stay exact, and one schema for both servers.

The store keeps every STATS figure as it changes (no walk over the objects
under the lock), so the numbers must match a count kept by the test through
puts, GETs (pins taken and dropped), deletes and evictions. Both servers
report exactly the keys of ``kvfabric.protocol.stats.STATS_KEYS``, plus only
their documented implementation-specific extras.
"""

from __future__ import annotations

from kvfabric import protocol as p
from kvfabric.testing import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp


def test_stats_stay_exact_through_puts_gets_deletes_and_evictions():
    page = 4096
    # 64 pages, evictions on demand only (no watermarks): the model below is exact
    with start_server(capacity=64 * page, extra_args=["--evict-watermarks", "0,0"]) as srv:
        with tcp.connect(srv.address, timeout_s=30) as c:
            held: dict[bytes, int] = {}  # key -> size, in LRU order
            puts = evictions = hits = misses = 0

            def put(key: bytes, size: int) -> None:
                nonlocal puts, evictions
                v = key[:1] * size
                st = c.request(p.PutRequest([key], [size], [p.checksum(key, v)]), [v]).msg.status
                assert st == [p.PutStatus.STORED]
                need = -(-size // page)
                while sum(-(-s // page) for s in held.values()) + need > 64:
                    held.pop(next(iter(held)))  # the LRU victim
                    evictions += 1
                held[key] = size
                puts += 1

            for i in range(48):
                put(b"a%03d" % i, 1000 + 61 * i)
            for i in range(0, 48, 3):  # GETs: hits refresh the LRU order, misses count
                key = b"a%03d" % i
                got = c.request(p.GetRequest([key, b"nope%d" % i])).msg.sizes
                assert got[0] == held[key] and got[1] == -1
                held[key] = held.pop(key)
                hits, misses = hits + 1, misses + 1
            deleted = [k for k in list(held)[:10]]
            assert c.request(p.DeleteRequest(deleted)).msg.deleted == 10
            for k in deleted:
                del held[k]
            for i in range(40):  # 4-page objects: evicts in LRU order
                put(b"b%03d" % i, 3 * page + 5)
            st = c.request(p.StatsRequest()).msg.stats
            assert st["objects"] == len(held)
            assert st["bytes_used"] == sum(held.values())
            assert st["bytes_allocated"] == sum(-(-s // page) for s in held.values()) * page
            assert st["free_bytes"] == 64 * page - st["bytes_allocated"]
            assert (st["puts"], st["evictions"], st["hits"], st["misses"]) == (puts, evictions, hits, misses)
            assert wait_for(lambda: c.request(p.StatsRequest()).msg.stats["pinned"] == 0)
            present = c.request(p.ExistsRequest(list(held))).msg.present
            assert all(present)


def test_both_servers_report_the_stats_schema():
    reported = {}
    for impl, module in (("native", "kvfabric"), ("reference", "kvfabric.testing.reference")):
        with start_server(capacity="4MiB", module=module) as srv:
            with tcp.connect(srv.address, timeout_s=30) as c:
                v = b"x" * 100
                c.request(p.PutRequest([b"k"], [100], [p.checksum(b"k", v)]), [v])
                c.request(p.GetRequest([b"k", b"missing"]))
                reported[impl] = c.request(p.StatsRequest()).msg.stats
    for impl, st in reported.items():
        missing = set(p.STATS_KEYS) - set(st)
        extra = set(st) - set(p.STATS_KEYS) - set(p.STATS_OPTIONAL_KEYS[impl])
        assert not missing and not extra, (impl, sorted(missing), sorted(extra))
    native, ref = reported["native"], reported["reference"]
    # the same keys, and the same figures for the same traffic
    for key in ("objects", "bytes_used", "bytes_allocated", "capacity", "free_bytes", "hits", "misses", "puts"):
        assert native[key] == ref[key], (key, native[key], ref[key])


def test_the_in_process_stats_are_the_wire_stats(server):
    """/metrics reads NativeServer.stats(); STATS answers on the wire: one map, built by one C function
    (csrc/kvf_stats.c), so the two cannot drift. Only zerocopy/fixed_buffers are added in Python (read
    off data_plane) and uptime_s may tick between the two reads."""
    with tcp.connect(server.address, timeout_s=30) as c:
        v = b"y" * 5000
        c.request(p.PutRequest([b"k"], [5000], [p.checksum(b"k", v)]), [v])
        c.request(p.GetRequest([b"k", b"missing"]))
        wire = c.request(p.StatsRequest()).msg.stats
        local = server.stats()
    assert set(local) ^ set(wire) == {"zerocopy", "fixed_buffers"}, sorted(set(local) ^ set(wire))
    assert local["zerocopy"] == ("send_zc" in wire["data_plane"])
    drift = {k: (wire[k], local[k]) for k in wire if k != "uptime_s" and wire[k] != local[k]}
    # between the two reads the STATS reply itself was being sent: only the send counters may differ
    sending = {"bytes_out", "reply_bytes", "copy_sends", "zc_sends", "zc_copied_notifs", "lat_stats_us_buckets",
               "lat_stats_us_sum"}
    assert set(drift) <= sending, drift
    for key in ("objects", "bytes_used", "hits", "misses", "puts", "policy", "server_id", "transports"):
        assert local[key] == wire[key], key
