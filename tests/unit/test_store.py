"""The store: exact eviction order through the store, pins, leases, delete-while-pinned, checksums;
and the transport-independent handlers over it (no sockets)."""

import pytest

from kvfabric import protocol as P
from kvfabric.errors import ErrorCode, ProtocolError
from kvfabric.protocol import PutStatus, checksum
from kvfabric.testing.reference.arena import PAGE_SIZE
from kvfabric.testing.reference.handlers import Handlers
from kvfabric.testing.reference.store import Slot, Store


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def obj(i: int, size: int = PAGE_SIZE) -> bytes:
    return bytes([i % 251]) * size


def key(i: int) -> bytes:
    return b"key-%04d" % i


def held(store: Store) -> list[int]:
    return [i for i in range(100) if key(i) in store]


def make(n_slots: int = 4, **kw) -> Store:
    return Store(n_slots * PAGE_SIZE, "lru", **kw)


def test_put_get_roundtrip_bytes_exact():
    s = make()
    data = bytes(range(256)) * 10
    assert s.put(b"a", data) == PutStatus.STORED
    got = s.acquire([b"a", b"missing"])
    assert got.sizes == [len(data), -1]
    assert got.checksums == [checksum(b"a", data), 0]
    assert bytes(got.views[0]) == data
    got.release()
    st = s.stats()
    assert (st["hits"], st["misses"], st["objects"], st["bytes_used"]) == (1, 1, 1, len(data))
    s.check()


def test_put_existing_key_is_exists_and_not_overwritten():
    s = make()
    assert s.put(b"a", obj(1)) == PutStatus.STORED
    assert s.put(b"a", obj(2)) == PutStatus.EXISTS
    got = s.acquire([b"a"])
    assert bytes(got.views[0]) == obj(1)
    got.release()


def test_lru_eviction_order_exact():
    s = make(4)
    for i in range(4):
        s.put(key(i), obj(i))
    a = s.acquire([key(0)])  # 0 becomes most recently used
    a.release()
    s.put(key(4), obj(4))  # evicts 1
    assert held(s) == [0, 2, 3, 4]
    s.lookup([key(2)])  # a LOOKUP hit is an access too
    s.put(key(5), obj(5))  # evicts 3
    s.put(key(6), obj(6))  # evicts 0
    assert held(s) == [2, 4, 5, 6]
    assert s.stats()["evictions"] == 3
    s.check()


def test_large_object_evicts_until_it_fits():
    s = make(4)
    for i in range(4):
        s.put(key(i), obj(i))
    assert s.put(key(9), obj(9, 3 * PAGE_SIZE)) == PutStatus.STORED
    assert held(s) == [3, 9]
    s.check()


def test_too_large_and_no_space():
    s = make(4)
    assert s.put(b"big", obj(0, 4 * PAGE_SIZE + 1)) == PutStatus.TOO_LARGE
    for i in range(4):
        s.put(key(i), obj(i))
    pins = s.acquire([key(i) for i in range(4)])
    assert s.put(key(5), obj(5)) == PutStatus.NO_SPACE  # everything pinned
    assert held(s) == [0, 1, 2, 3]
    pins.release()
    assert s.put(key(5), obj(5)) == PutStatus.STORED
    assert held(s) == [1, 2, 3, 5]
    st = s.stats()
    assert (st["put_too_large"], st["put_no_space"]) == (1, 1)
    s.check()


def test_pinned_object_is_skipped_and_keeps_its_place():
    s = make(3)
    for i in range(3):
        s.put(key(i), obj(i))
    pin = s.acquire([key(0)])  # 0 is most recent now, and pinned
    s.lookup([key(1), key(2)])  # order (cold->hot): 0, 1, 2
    # LRU would take 0, but it is pinned, so 1 goes and 0 stays the coldest
    s.put(key(3), obj(3))
    assert held(s) == [0, 2, 3]
    pin.release()
    s.put(key(4), obj(4))  # now 0, the coldest, goes
    assert held(s) == [2, 3, 4]
    s.check()


def test_pinned_bytes_are_never_overwritten():
    s = make(2)
    s.put(key(0), obj(0))
    s.put(key(1), obj(1))
    pin = s.acquire([key(0)])
    view = pin.views[0]
    for i in range(2, 20):  # heavy churn through the one free slot
        assert s.put(key(i), obj(i)) == PutStatus.STORED
    assert bytes(view) == obj(0)
    pin.release()
    s.check()


def test_lease_blocks_eviction_until_it_expires():
    clock = FakeClock()
    s = make(2, clock=clock)
    s.put(key(0), obj(0))
    s.put(key(1), obj(1))
    assert s.lookup([key(0), key(1), key(7)], lease_ms=500) == 2
    assert s.stats()["leased"] == 2
    assert s.put(key(2), obj(2)) == PutStatus.NO_SPACE
    clock.now += 0.499
    assert s.put(key(2), obj(2)) == PutStatus.NO_SPACE
    clock.now += 0.002  # both leases expired
    assert s.put(key(2), obj(2)) == PutStatus.STORED
    assert held(s) == [1, 2]
    s.check()


def test_lease_is_capped_and_lookup_counts_only_leading_run():
    clock = FakeClock()
    s = make(3, clock=clock, max_lease_ms=1000)
    for i in (0, 1, 3):
        s.put(key(i), obj(i))
    assert s.lookup([key(0), key(1), key(2), key(3)], lease_ms=3_600_000) == 2
    clock.now += 1.001
    assert s.stats()["leased"] == 0
    st = s.stats()
    assert (st["lookups"], st["lookup_keys"], st["lookup_hits"]) == (1, 4, 2)


def test_delete_while_pinned_frees_at_last_release():
    s = make(2)
    s.put(key(0), obj(0))
    a = s.acquire([key(0)])
    b = s.acquire([key(0)])
    assert s.delete([key(0), key(5)]) == 1
    assert key(0) not in s
    assert s.acquire([key(0)]).sizes == [-1]
    assert s.arena.used_bytes == PAGE_SIZE  # still held by the pins
    assert bytes(a.views[0]) == obj(0)
    a.release()
    assert s.arena.used_bytes == PAGE_SIZE
    b.release()
    b.release()  # second release is a no-op
    assert s.arena.used_bytes == 0
    s.check()


def test_delete_of_leased_object_is_immediate():
    s = make(2)
    s.put(key(0), obj(0))
    s.lookup([key(0)], lease_ms=10_000)
    assert s.delete([key(0)]) == 1
    assert s.arena.used_bytes == 0
    s.check()


def test_corrupt_bytes_are_a_miss_dropped_and_counted():
    s = make(4)
    s.put(key(0), obj(0))
    s.put(key(1), obj(1))
    e = s.entry(key(0))
    s.arena.buffer[e.offset + 17] ^= 0xFF  # flip bits in the arena directly
    got = s.acquire([key(0), key(1)])
    assert got.sizes == [-1, PAGE_SIZE]
    assert len(got.views) == 1 and bytes(got.views[0]) == obj(1)
    assert got.offsets == [s.entry(key(1)).offset]
    got.release()
    st = s.stats()
    assert (st["checksum_failures"], st["misses"], st["hits"], st["objects"]) == (1, 1, 1, 1)
    assert key(0) not in s
    s.check()


def test_put_with_wrong_checksum_is_rejected():
    s = make(2)
    assert s.put(b"a", obj(1), csum=checksum(b"a", obj(2))) == PutStatus.CHECKSUM_MISMATCH
    assert b"a" not in s and s.arena.used_bytes == 0
    assert s.stats()["checksum_rejects"] == 1


def test_two_phase_put_abort_and_race():
    s = make(4)
    slot = s.begin_put(b"a", 100)
    assert isinstance(slot, Slot)
    assert s.exists([b"a"]) == [False]  # a reserved slot is not readable
    s.abort_put(slot)
    with pytest.raises(RuntimeError):
        s.abort_put(slot)
    assert s.arena.used_bytes == 0
    # two writers of the same key: the second commit reports EXISTS and frees its slot
    s1, s2 = s.begin_put(b"k", 10), s.begin_put(b"k", 10)
    s1.view[:] = b"x" * 10
    s2.view[:] = b"x" * 10
    assert s.commit_put(b"k", s1, checksum(b"k", b"x" * 10)) == PutStatus.STORED
    assert s.commit_put(b"k", s2, checksum(b"k", b"x" * 10)) == PutStatus.EXISTS
    assert s.arena.used_bytes == PAGE_SIZE
    s.check()


def test_reserved_space_is_not_evictable_and_reports_no_space_without_evicting():
    s = make(2)
    s.put(key(0), obj(0))
    slot = s.begin_put(key(1), PAGE_SIZE)  # second page reserved by an in-progress PUT
    assert s.put(key(2), obj(2, 2 * PAGE_SIZE)) == PutStatus.NO_SPACE
    assert key(0) in s  # nothing was evicted for a request that could not fit
    s.abort_put(slot)
    s.check()


def test_parent_is_passed_to_policy():
    seen = []

    class Recorder(type(make().policy)):
        def on_insert(self, key, size, parent=None):
            seen.append((key, size, parent))
            super().on_insert(key, size, parent)

    s = Store(4 * PAGE_SIZE, Recorder())
    s.put(b"b1", b"x", parent=None)
    s.put(b"b2", b"yy", parent=b"b1")
    assert seen == [(b"b1", 1, None), (b"b2", 2, b"b1")]


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        Store(4 * PAGE_SIZE, "nope")


# ---------------------------------------------------------------- handlers over a store (no sockets)


def _request(h, session, msg, rid=1):
    head = P.encode_request(msg, rid)
    header = h.parse_header(session, head[: P.HEADER_SIZE])
    return header, h.decode(session, header, head[P.HEADER_SIZE :])


def _reply_meta(reply):
    header = P.unpack_header(reply.head[: P.HEADER_SIZE])
    return header, P.decode_meta(reply.head[P.HEADER_SIZE :])


def test_handlers_put_ingest_fills_slots_then_get_serves_views():
    h = Handlers(make(8), server_id="test")
    session = h.new_session("peer")
    vals = [b"a" * 5000, b"b" * 7000, b"a" * 5000]
    keys = [b"k1", b"k2", b"k1"]  # duplicate key inside one batch
    header, msg = _request(h, session, P.PutRequest(keys, [len(v) for v in vals], [P.checksum(k, v) for k, v in zip(keys, vals)]))
    ingest = h.begin_put(session, header, msg)
    for i, v in enumerate(vals):
        view = ingest.reserve(i)
        if view is not None:
            view[:] = v
            ingest.complete(i)
    rheader, meta = _reply_meta(ingest.reply())
    assert rheader.request_id == 1 and meta["status"] == [P.PutStatus.STORED, P.PutStatus.STORED, P.PutStatus.EXISTS]
    header, msg = _request(h, session, P.GetRequest([b"k2", b"zz", b"k1"]), rid=2)
    reply = h.handle(session, header, msg)
    _, meta = _reply_meta(reply)
    assert meta["sizes"] == [7000, -1, 5000]
    assert [bytes(v) for v in reply.payload] == [vals[1], vals[0]]
    assert h.store.stats()["pinned"] == 2
    reply.release()
    assert h.store.stats()["pinned"] == 0
    h.store.check()


def test_handlers_abort_returns_the_reserved_slot():
    h = Handlers(make(8), server_id="test")
    session = h.new_session("peer")
    header, msg = _request(h, session, P.PutRequest([b"x"], [9000], [0]))
    ingest = h.begin_put(session, header, msg)
    assert ingest.reserve(0) is not None
    assert h.store.arena.used_bytes == 3 * PAGE_SIZE
    ingest.abort()  # the stream broke mid-payload
    assert h.store.arena.used_bytes == 0 and len(h.store) == 0


def test_handlers_require_auth_before_anything_but_hello_and_auth():
    h = Handlers(make(8), server_id="test", auth_token="tok")
    session = h.new_session("peer")
    with pytest.raises(ProtocolError) as e:
        _request(h, session, P.PingRequest())
    assert e.value.code == ErrorCode.AUTH_FAILED and e.value.fatal
    big = P.ExistsRequest([b"k" * 16] * 400)  # metadata over the pre-auth 4 KiB
    with pytest.raises(ProtocolError) as e:
        _request(h, session, big)
    assert e.value.code == ErrorCode.META_TOO_LARGE
    header, msg = _request(h, session, P.AuthRequest(proof=b"\0" * 32))
    with pytest.raises(ProtocolError) as e:  # AUTH with no HELLO to answer
        h.handle(session, header, msg)
    assert e.value.code == ErrorCode.AUTH_FAILED
    nonce = P.new_nonce()
    header, msg = _request(h, session, P.HelloRequest(nonce=nonce))
    _, meta = _reply_meta(h.handle(session, header, msg))
    assert meta["server_id"] == "test" and meta["capacity"] == 8 * PAGE_SIZE and meta["auth_required"] is True
    assert meta["proof"] == P.server_proof("tok", nonce, meta["nonce"], "test")  # the server proved it
    assert not session.authenticated
    wrong = P.client_proof("wrong", meta["nonce"], nonce)
    header, msg = _request(h, session, P.AuthRequest(proof=wrong))
    with pytest.raises(ProtocolError) as e:
        h.handle(session, header, msg)
    assert e.value.code == ErrorCode.AUTH_FAILED and e.value.fatal and not session.authenticated
    header, msg = _request(h, session, P.AuthRequest(proof=P.client_proof("tok", meta["nonce"], nonce)))
    with pytest.raises(ProtocolError) as e:  # one AUTH per HELLO: the right proof is too late now
        h.handle(session, header, msg)
    assert e.value.code == ErrorCode.AUTH_FAILED
    header, msg = _request(h, session, P.HelloRequest(nonce=nonce))
    _, meta = _reply_meta(h.handle(session, header, msg))
    header, msg = _request(h, session, P.AuthRequest(proof=P.client_proof("tok", meta["nonce"], nonce)))
    _, meta = _reply_meta(h.handle(session, header, msg))
    assert meta == {} and session.authenticated
    header, msg = _request(h, session, big)  # full limits once authenticated
    _, meta = _reply_meta(h.handle(session, header, msg))
    assert meta["present"] == [False] * 400


def test_handlers_error_reply_counts_and_marks_fatal_codes():
    h = Handlers(make(8), server_id="test")
    r = h.error_reply(None, 99, 5, ProtocolError(ErrorCode.UNKNOWN_OPCODE, "nope"))
    header, meta = _reply_meta(r)
    assert header.is_error and header.request_id == 5 and meta["code"] == ErrorCode.UNKNOWN_OPCODE and not r.close
    assert h.error_reply(None, 1, 6, ProtocolError(ErrorCode.BAD_MAGIC, "x")).close
    assert h.stats()["errors"] == {"UNKNOWN_OPCODE": 1, "BAD_MAGIC": 1}


def test_get_reply_is_capped_at_the_payload_limit():
    s = make(8)
    for i in range(4):
        s.put(key(i), obj(i))
    got = s.acquire([key(i) for i in range(4)], max_bytes=2 * PAGE_SIZE + 1)
    assert got.sizes == [PAGE_SIZE, PAGE_SIZE, -1, -1]
    got.release()
    assert s.stats()["pinned"] == 0
