"""Issue 27 part 2, retire a namespace pool-wide, on real ``kvfabric serve`` processes.

Objects PUT with a namespace tag (``Client.put(..., ns_tag=)``) are dropped by
``Client.retire(tag)`` on every server: from the RETIRE's reply on they miss on GET, EXISTS
and LOOKUP, in DRAM and on the SSD tier, while other tags and untagged objects are untouched;
a restart keeps them retired (the retirements file beside the tier); a retire while another
thread GETs in a loop never yields wrong bytes; bad RETIRE frames and a full tag table are
clear errors. The same assertions run on the native server and the Python reference (and on
every client transport of the conformance pairs). No timed assertions: every wait is on a
condition.
"""

from __future__ import annotations

import os
import struct
import threading

import pytest

from kvfabric import RetireError, namespace_tag
from kvfabric import protocol as P
from kvfabric.errors import ErrorCode, RemoteError
from kvfabric.testing import wait_for
from kvfabric.testing.servers import start_server
from kvfabric.transport import tcp

MODULES = {"native": "kvfabric", "reference": "kvfabric.testing.reference"}
A, B = namespace_tag(b"policy step 1"), namespace_tag(b"policy step 2")


def value(key: bytes, size: int) -> bytes:
    """Distinct bytes per key and offset: a wrong object never looks right."""
    block = key + b"|"
    return (block * (size // len(block) + 1))[:size]


def server_stats(client) -> dict[str, dict]:
    return client.stats()["servers"]


# ---------------------------------------------------------------- every pair: DRAM


def test_retire_drops_one_namespace_everywhere_and_leaves_the_rest(make_pool, make_client):
    pool = make_pool(2)
    c = make_client(pool.addresses)
    ka = [b"a-%03d" % i for i in range(40)]
    kb = [b"b-%03d" % i for i in range(40)]
    ku = [b"u-%03d" % i for i in range(10)]
    assert c.put(ka, [value(k, 3000) for k in ka], ns_tag=A).stored == 40
    assert c.put(kb, [value(k, 3000) for k in kb], ns_tag=B).stored == 40
    assert c.put(ku, [value(k, 3000) for k in ku]).stored == 10
    assert c.exists(ka) == [True] * 40 and c.lookup(ka) == 40

    gens = c.retire(A)
    assert gens == {a: 1 for a in pool.addresses}, gens

    # GET, EXISTS and LOOKUP all miss for A at once; B and the untagged keys are whole and exact
    assert c.get(ka) == [None] * 40
    assert c.exists(ka) == [False] * 40
    assert c.lookup(ka) == 0
    for keys in (kb, ku):
        got = c.get(keys)
        bad = [k for k, g in zip(keys, got) if g is None or bytes(g) != value(k, 3000)]
        assert not bad, f"{len(bad)} objects of another namespace lost or wrong after the retire: {bad[:4]}"
    st = server_stats(c)
    assert sum(s["retires"] for s in st.values()) == 2, st  # one per server
    assert sum(s["retired_objects_freed"] for s in st.values()) == 40, st
    assert sum(s["objects"] for s in st.values()) == 50, st
    assert all(s["namespaces"] == 2 for s in st.values()), st

    # the tag is usable again: new PUTs under it are live (a new generation) until the next retire
    assert c.put(ka[:5], [value(k, 3000) for k in ka[:5]], ns_tag=A).stored == 5
    assert c.exists(ka[:5]) == [True] * 5
    assert c.retire(A) == {a: 2 for a in pool.addresses}
    assert c.exists(ka[:5]) == [False] * 5
    assert c.exists(kb) == [True] * 40


def test_a_retire_that_misses_a_server_raises_with_every_result(make_pool, make_client):
    pool = make_pool(2)
    c = make_client(pool.addresses)
    keys = [b"k-%03d" % i for i in range(30)]
    assert c.put(keys, [value(k, 1000) for k in keys], ns_tag=A).stored == 30
    pool[1].kill()
    with pytest.raises(RetireError) as ei:
        c.retire(A)
    res = ei.value.results
    assert res[pool[0].address] == 1, res
    assert isinstance(res[pool[1].address], str) and res[pool[1].address], res
    assert pool[1].address in str(ei.value)
    # the live server did retire: its keys of A miss
    assert not any(c.exists(keys))


def test_put_ns_tag_is_checked_by_the_client():
    from kvfabric import Client

    c = Client(["127.0.0.1:9"], allow_rejects=True)
    try:
        with pytest.raises(ValueError, match="ns_tag must be 16 bytes"):
            c.put([b"k"], [b"v"], ns_tag=b"short")
    finally:
        c.close()


# ---------------------------------------------------------------- both servers: raw frames


@pytest.fixture(params=sorted(MODULES))
def server(request):
    if request.param == "native":
        pytest.importorskip("kvfabric._native", reason="the native server needs the C extension")
    with start_server(capacity="8MiB", module=MODULES[request.param],
                      extra_args=("--max-namespaces", "2")) as srv:
        yield srv


def put_small(c, keys: list[bytes], ns: object) -> list[int]:
    """PUT 100-byte objects under ``ns`` (any value: the encoder sends it as given, good or bad)."""
    vals = [value(k, 100) for k in keys]
    msg = P.PutRequest(keys=keys, sizes=[100] * len(keys), checksums=[P.checksum(k, v) for k, v in zip(keys, vals)],
                       ns=ns)
    return c.request(msg, vals).msg.status


def refused(call, code: ErrorCode, *words: str) -> None:
    with pytest.raises(RemoteError) as ei:
        call()
    assert ei.value.code == code and all(w in ei.value.message for w in words), (code, words, ei.value)


def test_malformed_retire_and_bad_tags_are_clear_errors_and_change_nothing(server):
    with tcp.connect(server.address, timeout_s=30) as c:
        for bad in (None, b"x" * 17, b"x" * 15, b"", "a string tag....", 7):  # nil, oversize, short, not bin
            refused(lambda: c.request(P.RetireRequest(ns=bad)), ErrorCode.MALFORMED, "ns must be", "16")
        refused(lambda: put_small(c, [b"k1"], b"y" * 17), ErrorCode.MALFORMED, "ns must be", "16")
        assert c.request(P.ExistsRequest([b"k1"])).msg.present == [False]  # the refused PUT stored nothing
        c.request(P.PingRequest())  # the connection goes on
        st = c.request(P.StatsRequest()).msg.stats
        assert st["retires"] == 0 and st["namespaces"] == 0 and st["objects"] == 0, st
        assert st["errors"].get("MALFORMED") == 7, st["errors"]


def test_a_full_tag_table_refuses_new_tags_clearly_and_keeps_the_known_ones(server):
    t1, t2, t3 = (namespace_tag(b"t%d" % i) for i in range(3))
    with tcp.connect(server.address, timeout_s=30) as c:
        assert put_small(c, [b"one"], t1) == [0]
        assert put_small(c, [b"two"], t2) == [0]
        # --max-namespaces 2: a third tag is refused for PUT and RETIRE alike
        refused(lambda: put_small(c, [b"three"], t3), ErrorCode.BUSY, "namespace tag table full", "nothing stored")
        refused(lambda: c.request(P.RetireRequest(ns=t3)), ErrorCode.BUSY, "namespace tag table full",
                "nothing retired")
        assert c.request(P.ExistsRequest([b"one", b"two", b"three"])).msg.present == [True, True, False]
        assert c.request(P.RetireRequest(ns=t1)).msg.generation == 1  # a known tag still retires
        assert c.request(P.RetireRequest(ns=t1)).msg.generation == 2  # and again: safe to repeat
        assert c.request(P.ExistsRequest([b"one", b"two"])).msg.present == [False, True]
        assert put_small(c, [b"untagged"], None) == [0]  # untagged PUTs never need the table
    from kvfabric import Client

    with Client([server.address]) as client:  # the client says why, in RetireError
        with pytest.raises(RetireError, match="namespace tag table full") as ei:
            client.retire(t3)
        assert "namespace tag table full" in ei.value.results[server.address]
        assert client.retire(t2) == {server.address: 1}  # and the server is not taken for down


def test_retire_while_another_thread_gets_in_a_loop(server):
    """A reader GETs a namespace's keys in a loop while it is retired: every answer is a miss or the
    exact object (checksums verified by the client), nothing raises, and once the RETIRE is answered
    every later GET misses."""
    from kvfabric import Client

    keys = [b"loop-%03d" % i for i in range(64)]
    c = Client([server.address])
    reader = Client([server.address])
    try:
        assert c.put(keys, [value(k, 8192) for k in keys], ns_tag=A).stored == 64
        rounds = [0]
        wrong: list[bytes] = []
        errors: list[BaseException] = []
        retired = threading.Event()
        after: list[int] = []  # hits in rounds that started after the RETIRE was answered
        stop = threading.Event()

        def loop() -> None:
            try:
                while not stop.is_set():
                    started_after = retired.is_set()
                    got = reader.get(keys)
                    hits = 0
                    for k, g in zip(keys, got):
                        if g is not None:
                            hits += 1
                            if bytes(g) != value(k, 8192):
                                wrong.append(k)
                    if started_after:
                        after.append(hits)
                    rounds[0] += 1
            except BaseException as e:  # reported below with the assertion
                errors.append(e)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        assert wait_for(lambda: rounds[0] >= 3 or errors, timeout_s=60), "the reader never got going"
        assert c.retire(A) == {server.address: 1}
        retired.set()
        assert wait_for(lambda: len(after) >= 3 or errors, timeout_s=60), "the reader stopped"
        stop.set()
        t.join(60)
        assert not errors, errors
        assert not wrong, f"wrong bytes served for {wrong[:4]}"
        assert after and all(h == 0 for h in after), after
        st = c.stats()["servers"][server.address]
        assert st["retired_objects_freed"] == 64 and st["objects"] == 0, st
    finally:
        c.close()
        reader.close()


# ---------------------------------------------------------------- native: the SSD tier and restarts

SZ = 256 * 1024


def tier_args(d: str) -> list[str]:
    return ["--ssd-path", d, "--ssd-capacity", "64MiB", "--evict-watermarks", "0,0"]


def put_tagged(c, keys: list[bytes], ns: bytes | None) -> None:
    for k in keys:
        v = value(k, SZ)
        r = c.request(P.PutRequest([k], [SZ], [P.checksum(k, v)], ns=ns), [v])
        assert r.msg.status == [P.PutStatus.STORED], (k, r.msg.status)


def st(c) -> dict:
    return c.request(P.StatsRequest()).msg.stats


def get_one(c, k: bytes) -> bytes | None:
    r = c.request(P.GetRequest([k]))
    if r.msg.sizes[0] < 0:
        return None
    assert P.checksum(k, bytes(r.payload)) == r.msg.checksums[0]
    return bytes(r.payload)


def test_retire_covers_the_ssd_tier_and_a_restart_keeps_it_retired(tier_dir):
    pytest.importorskip("kvfabric._native", reason="the SSD tier is the native server's")
    # 48 objects of 256 KiB through a 4 MiB arena: the first 32 put go to the SSD tier
    ka = [b"ssd-a-%03d" % i for i in range(24)]
    kb = [b"ssd-b-%03d" % i for i in range(24)]
    order = [k for pair in zip(ka, kb) for k in pair]  # both tags in DRAM and on the SSD
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv:
        with tcp.connect(srv.address, timeout_s=60) as c:
            for k in order:
                put_tagged(c, [k], A if k in ka else B)
            assert wait_for(lambda: st(c)["ssd_queue_bytes"] == 0, timeout_s=60)
            s = st(c)
            assert s["ssd_objects"] == 32 and s["objects"] == 16, s
            assert c.request(P.RetireRequest(ns=A)).msg.generation == 1
            present = c.request(P.ExistsRequest(ka + kb)).msg.present
            assert present == [False] * 24 + [True] * 24, present
            for k in ka:
                assert get_one(c, k) is None, k
            for k in kb:  # DRAM and SSD objects of the other tag, promoted where needed
                assert get_one(c, k) == value(k, SZ), k
            s = st(c)
            assert s["retired_objects_freed"] == 24 and s["retires"] == 1, s
        assert srv.stop() == 0
    assert os.path.getsize(os.path.join(tier_dir, "kvfabric-retired.v1")) == 32  # one record

    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv2, tcp.connect(srv2.address, timeout_s=60) as c2:
        s = st(c2)
        assert s["namespaces"] == 2 and s["ssd_corrupt"] == 0, s
        assert c2.request(P.ExistsRequest(ka)).msg.present == [False] * 24
        assert [get_one(c2, k) for k in ka] == [None] * 24
        on_ssd = [k for k in kb if c2.request(P.ExistsRequest([k])).msg.present[0]]
        assert on_ssd, "nothing of the live tag survived the restart on the SSD tier"
        for k in on_ssd:
            assert get_one(c2, k) == value(k, SZ), k
        # the generation went on from the file: the next retire is 2, and drops B's promoted objects too
        assert c2.request(P.RetireRequest(ns=A)).msg.generation == 2
        assert c2.request(P.RetireRequest(ns=B)).msg.generation == 1
        assert c2.request(P.ExistsRequest(kb)).msg.present == [False] * 24


def test_a_torn_last_retirement_record_is_ignored_and_an_earlier_bad_one_stops_the_start(tier_dir):
    pytest.importorskip("kvfabric._native", reason="the SSD tier is the native server's")
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        put_tagged(c, [b"x"], A)
        assert c.request(P.RetireRequest(ns=A)).msg.generation == 1
        assert c.request(P.RetireRequest(ns=B)).msg.generation == 1
    path = os.path.join(tier_dir, "kvfabric-retired.v1")
    with open(path, "ab") as f:  # a crash mid-append: half a record
        f.write(b"\x01" * 16)
    with start_server("4MiB", extra_args=tier_args(tier_dir)) as srv, tcp.connect(srv.address, timeout_s=60) as c:
        assert c.request(P.RetireRequest(ns=A)).msg.generation == 2  # the file's record was kept
    assert os.path.getsize(path) == 3 * 32  # the torn tail was cut, the new record appended whole
    with open(path, "r+b") as f:  # a bit flipped in the first record: not a torn tail
        f.seek(17)
        b = f.read(1)
        f.seek(17)
        f.write(struct.pack("B", b[0] ^ 1))
    with pytest.raises(RuntimeError, match="retirements file"):
        start_server("4MiB", extra_args=tier_args(tier_dir), timeout_s=30)


def test_a_retired_group_leaves_whole(server):
    """Grouped objects tagged in one PUT frame: the retire drops every part of the group (one
    policy entry), on both servers."""
    keys = [b"grp-%d" % i for i in range(4)]
    vals = [value(k, 500) for k in keys]
    msg = P.PutRequest(keys=keys, sizes=[500] * 4, checksums=[P.checksum(k, v) for k, v in zip(keys, vals)],
                       groups=[b"g1"] * 3 + [b"g2"], group_parts=[3, 3, 3, 1], ns=A)
    with tcp.connect(server.address, timeout_s=30) as c:
        assert c.request(msg, vals).msg.status == [0, 0, 0, 0]
        assert c.request(P.StatsRequest()).msg.stats["groups"] == 2
        assert c.request(P.RetireRequest(ns=A)).msg.generation == 1
        assert c.request(P.LookupRequest([keys[1]])).msg.count == 0  # one part found stale takes its group
        st = c.request(P.StatsRequest()).msg.stats
        assert st["retired_objects_freed"] >= 3 and st["groups"] <= 1, st
        assert c.request(P.ExistsRequest(keys)).msg.present == [False] * 4
        st = c.request(P.StatsRequest()).msg.stats
        assert (st["groups"], st["group_objects"], st["objects"], st["retired_objects_freed"]) == (0, 0, 0, 4), st


def test_the_native_server_frees_retired_objects_without_a_lookup():
    """The control thread's bounded sweep gives a retired namespace's space back even if nobody
    asks for its keys again (the reference server frees them on lookup or eviction only)."""
    pytest.importorskip("kvfabric._native", reason="the sweep is the native server's")
    keys = [b"sw-%04d" % i for i in range(300)]
    with start_server(capacity="16MiB") as srv, tcp.connect(srv.address, timeout_s=30) as c:
        for i in range(0, 300, 100):
            chunk = keys[i:i + 100]
            vals = [value(k, 4000) for k in chunk]
            sums = [P.checksum(k, v) for k, v in zip(chunk, vals)]
            msg = P.PutRequest(keys=chunk, sizes=[4000] * 100, checksums=sums, ns=A)
            assert c.request(msg, vals).msg.status == [0] * 100
        assert put_small(c, [b"keep"], B) == [0]
        assert c.request(P.RetireRequest(ns=A)).msg.generation == 1

        def swept():
            st = c.request(P.StatsRequest()).msg.stats
            return st if st["objects"] == 1 else None

        st = wait_for(swept, timeout_s=60)
        assert st, c.request(P.StatsRequest()).msg.stats
        assert st["retired_objects_freed"] == 300 and st["bytes_used"] == 100, st
        assert c.request(P.ExistsRequest([b"keep"])).msg.present == [True]


def test_retires_under_concurrent_puts_and_gets_keep_the_server_consistent(server):
    """Writers PUT under the tag and a reader GETs while the tag is retired five times: nothing
    raises, nothing wrong is read, and afterwards the server's count matches what EXISTS sees and
    a last retire leaves none of the tag."""
    from kvfabric import Client

    clients = [Client([server.address]) for _ in range(3)]
    stop = threading.Event()
    errors: list[BaseException] = []
    wrong: list[bytes] = []
    puts = [0]
    written: set[bytes] = set()

    def writer(c, prefix: bytes) -> None:
        i = 0
        try:
            while not stop.is_set():
                ks = [prefix + b"-%05d" % (i + j) for j in range(8)]
                c.put(ks, [value(k, 2048) for k in ks], ns_tag=A)
                written.update(ks)
                puts[0] += 1
                i += 8
        except BaseException as e:
            errors.append(e)

    def reader(c) -> None:
        try:
            while not stop.is_set():
                ks = sorted(written)[:64]
                for k, g in zip(ks, c.get(ks)):
                    if g is not None and bytes(g) != value(k, 2048):
                        wrong.append(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(clients[0], b"w0"), daemon=True),
               threading.Thread(target=writer, args=(clients[1], b"w1"), daemon=True),
               threading.Thread(target=reader, args=(clients[2],), daemon=True)]
    admin = Client([server.address])
    try:
        for t in threads:
            t.start()
        for gen in range(1, 6):
            target = puts[0] + 4
            assert wait_for(lambda: puts[0] >= target or errors, timeout_s=60), "the writers stopped"
            assert admin.retire(A) == {server.address: gen}
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert not wrong, f"wrong bytes read for {wrong[:4]}"
        keys = sorted(written)
        held = sum(admin.exists(keys))
        assert admin.stats()["servers"][server.address]["objects"] == held
        admin.retire(A)
        assert not any(admin.exists(keys))
        st = admin.stats()["servers"][server.address]
        assert st["objects"] == 0 and st["retires"] == 6, st
    finally:
        stop.set()
        admin.close()
        for c in clients:
            c.close()
