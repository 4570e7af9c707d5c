"""Issue 23, server-side groups on the reference store (kvfabric.testing.reference; the C store
keeps the same rules, tests/native/test_groups.py runs both): a PUT group is admitted whole or
refused whole, every policy sees ONE entry per group (its representative, the group's bytes) and
evicts it whole, an access to any part is an access to the group, a DELETE or a corrupt part drops
the whole group. Exact eviction orders for every policy, CPU only, no sockets."""

from __future__ import annotations

import pytest

from kvfabric import protocol as P
from kvfabric.protocol import PutStatus
from kvfabric.server.eviction import POLICIES, EvictionPolicy, make_policy
from kvfabric.testing.reference.arena import PAGE_SIZE
from kvfabric.testing.reference.handlers import Handlers
from kvfabric.testing.reference.store import Store


class Recording(EvictionPolicy):
    """A policy by name that records every victim it hands the store (and what it was told)."""

    name = "recording"
    summary = "test"

    def __init__(self, inner: str) -> None:
        self.inner = make_policy(inner)
        self.victims: list[bytes] = []
        self.inserts: list[tuple[bytes, int, bytes | None]] = []

    def on_insert(self, key, size, parent=None):
        self.inserts.append((key, size, parent))
        self.inner.on_insert(key, size, parent)

    def on_access(self, key):
        self.inner.on_access(key)

    def on_remove(self, key):
        self.inner.on_remove(key)

    def evict(self, is_pinned):
        v = self.inner.evict(is_pinned)
        if v is not None:
            self.victims.append(v)
        return v

    def __len__(self):
        return len(self.inner)

    def __contains__(self, key):
        return key in self.inner


def put(h: Handlers, keys, values=None, groups=None, parts=None, parents=None, corrupt=(), rid=1):
    """One PUT frame through the reference's ingest (as its TCP loop drives it): the statuses."""
    values = values or [bytes([i + 1]) * PAGE_SIZE for i in range(len(keys))]
    sums = [P.checksum(k, v) ^ (1 if k in corrupt else 0) for k, v in zip(keys, values)]
    msg = P.PutRequest(keys, [len(v) for v in values], sums, parents, groups, parts)
    head = P.encode_request(msg, rid)
    session = h.new_session("peer")
    header = h.parse_header(session, head[: P.HEADER_SIZE])
    msg = h.decode(session, header, head[P.HEADER_SIZE:])
    ingest = h.begin_put(session, header, msg)
    for i, v in enumerate(values):
        view = ingest.reserve(i)
        if view is not None:
            view[:] = v
            ingest.complete(i)
    return P.decode_meta(ingest.reply().head[P.HEADER_SIZE:])["status"]


def put_group(h: Handlers, name: str, n: int = 2, parent: bytes | None = None):
    keys = [f"{name}{i}".encode() for i in range(1, n + 1)]
    st = put(h, keys, groups=[name.encode()] * n, parts=[n] * n,
             parents=[parent] + [None] * (n - 1) if parent else None)
    assert st == [PutStatus.STORED] * n, (name, st)
    return keys


def call(h: Handlers, msg, rid: int = 9):
    """A request without payload through the reference's handlers: the Reply (release() a GET's)."""
    session = h.new_session("peer")
    head = P.encode_request(msg, rid)
    header = h.parse_header(session, head[: P.HEADER_SIZE])
    return h.handle(session, header, h.decode(session, header, head[P.HEADER_SIZE:]))


def get(h: Handlers, keys) -> list[int]:
    reply = call(h, P.GetRequest(keys))
    sizes = P.decode_meta(reply.head[P.HEADER_SIZE:])["sizes"]
    reply.release()
    return sizes


def make(pages: int, policy: str = "lru") -> tuple[Handlers, Recording]:
    rec = Recording(policy)
    return Handlers(Store(pages * PAGE_SIZE, rec), server_id="t"), rec


def whole_or_absent(store: Store, *groups: list[bytes]) -> list[str]:
    """Each group: 'whole' or 'absent'; a partial group fails the test with what it holds."""
    out = []
    for keys in groups:
        held = [k in store for k in keys]
        assert all(held) or not any(held), f"partial group: {dict(zip(keys, held))}"
        out.append("whole" if all(held) else "absent")
    return out


# Every policy, one scenario: groups A (2 parts), B (2 parts, chained under A), an ungrouped x,
# group C (2 parts); a GET of A's second part, of x; then 1-page fillers f1..f8 push everything out.
# The victims are units (a group's representative = its first part, or an ungrouped key), in the
# policy's order over those units: the same order the bare policy gives for the same unit events.
# Pages: 7 of 8 used after the set-up; f1 fills the arena, then every second filler needs one unit
# to go while the units are 2-page groups, every filler once only 1-page units remain.
EXPECTED = {
    # LRU over units: B, C (never read), then A and x in the order they were read
    "lru": [b"B1", b"C1", b"A1", b"x"],
    # tail-lru: B is A's child, so A is no leaf until B is gone; the leaves B, C go first, then A
    # (read before x) and x
    "tail-lru": [b"B1", b"C1", b"A1", b"x"],
    # s3fifo: every unit enters the small FIFO; A and x were read (moved to main as they reach the
    # head), B and C were not (victims); then the fillers, still in the small FIFO, in FIFO order
    "s3fifo": [b"B1", b"C1", b"f1", b"f2", b"f3"],
    # prefix-lfu: priority = aging + frequency (A and x were read: 2, the rest 1), leaves only (A is
    # B's parent): B, C, then f1 (it entered at aging 0: priority 1); after that the
    # fillers enter at aging 1 + 1 = 2, tying A (2, touched earlier), which goes first on the tie
    "prefix-lfu": [b"B1", b"C1", b"f1", b"A1"],
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_evicts_groups_whole_in_its_exact_order(policy):
    h, rec = make(8, policy)
    a = put_group(h, "A")
    b = put_group(h, "B", parent=b"A1")
    assert put(h, [b"x"]) == [PutStatus.STORED]
    c = put_group(h, "C")
    # one policy entry per group, of the group's bytes; B's parent is A's representative
    assert rec.inserts == [(b"A1", 2 * PAGE_SIZE, None), (b"B1", 2 * PAGE_SIZE, b"A1"), (b"x", PAGE_SIZE, None),
                           (b"C1", 2 * PAGE_SIZE, None)]
    assert len(rec) == 4
    assert get(h, [b"A2"]) == [PAGE_SIZE]  # an access of a part is an access of its group
    assert get(h, [b"x"]) == [PAGE_SIZE]
    for i in range(1, 9):
        assert put(h, [b"f%d" % i]) == [PutStatus.STORED], i
        whole_or_absent(h.store, a, b, c)
        h.store.check()
    assert rec.victims == EXPECTED[policy], rec.victims
    # the same unit events on the bare policy give the same order: a group is one unit of its pages
    bare = make_policy(policy)
    pages = {b"A1": 2, b"B1": 2, b"x": 1, b"C1": 2}
    for k, size, parent in rec.inserts[:4]:
        bare.on_insert(k, size, parent)
    bare.on_access(b"A1")
    bare.on_access(b"x")
    used, order = 7, []
    for i in range(1, 9):
        while used + 1 > 8:  # the store evicts until the new object fits, then inserts it
            v = bare.evict(lambda k: False)
            order.append(v)
            used -= pages.pop(v)
        bare.on_insert(b"f%d" % i, PAGE_SIZE, None)
        pages[b"f%d" % i] = 1
        used += 1
    assert order == rec.victims
    s = h.store.stats()
    assert s["groups_incomplete"] == 0 and s["group_objects"] == 2 * s["groups"], s


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_pinned_part_pins_its_group_for_every_policy(policy):
    h, rec = make(4, policy)
    a = put_group(h, "A")
    b = put_group(h, "B")
    held = call(h, P.GetRequest([b"A2"]))  # A2 pinned until release
    assert put(h, [b"y"]) == [PutStatus.STORED]
    assert whole_or_absent(h.store, a, b) == ["whole", "absent"], rec.victims  # B went, all of it; A stayed
    assert rec.victims == [b"B1"]
    held.release()
    h.store.check()


def test_a_group_is_refused_whole_on_a_checksum_mismatch():
    h, _ = make(8)
    st = put(h, [b"a", b"b", b"c"], groups=[b"G"] * 3, parts=[3] * 3, corrupt={b"b"})
    assert st == [PutStatus.CHECKSUM_MISMATCH] * 3
    assert [k in h.store for k in (b"a", b"b", b"c")] == [False] * 3
    s = h.store.stats()
    assert (s["groups"], s["groups_refused"], s["checksum_rejects"], s["objects"]) == (0, 1, 1, 0), s
    assert h.store.arena.used_bytes == 0  # every kept slot given back
    h.store.check()


def test_a_group_that_cannot_fit_whole_is_refused_whole_and_evicts_nothing():
    h, rec = make(4)
    put_group(h, "A")
    st = put(h, [b"g1", b"g2", b"g3", b"g4", b"g5"], groups=[b"G"] * 5, parts=[5] * 5)
    assert st == [PutStatus.TOO_LARGE] * 5
    assert rec.victims == [] and b"A1" in h.store and b"g1" not in h.store
    # a group that fits only by evicting: evicted whole, admitted whole
    st = put(h, [b"g1", b"g2", b"g3"], groups=[b"G"] * 3, parts=[3] * 3)
    assert st == [PutStatus.STORED] * 3 and rec.victims == [b"A1"] and b"A2" not in h.store
    h.store.check()


def test_no_space_for_one_part_refuses_the_group_and_gives_back_its_slots():
    h, _ = make(4)
    put(h, [b"p1", b"p2"])
    held = call(h, P.GetRequest([b"p1", b"p2"]))  # 2 of 4 pages pinned
    st = put(h, [b"g1", b"g2", b"g3"], groups=[b"G"] * 3, parts=[3] * 3)
    assert st == [PutStatus.NO_SPACE] * 3
    assert not any(k in h.store for k in (b"g1", b"g2", b"g3"))
    held.release()
    assert h.store.arena.used_bytes == 2 * PAGE_SIZE
    h.store.check()


def test_delete_or_a_corrupt_part_drops_the_whole_group():
    h, rec = make(8)
    a = put_group(h, "A", 3)
    b = put_group(h, "B", 3)
    reply = call(h, P.DeleteRequest([b"A2"]))
    assert P.decode_meta(reply.head[P.HEADER_SIZE:]) == {"deleted": 3}  # objects removed
    assert whole_or_absent(h.store, a, b) == ["absent", "whole"]
    e = h.store.entry(b"B3")
    h.store.arena.view(e.offset, e.size)[0] ^= 0xFF  # rot one part's bytes
    assert get(h, [b"B1", b"B3"]) == [PAGE_SIZE, -1]  # B1 was sent before B3 failed; then the group goes
    assert whole_or_absent(h.store, b) == ["absent"]
    s = h.store.stats()
    assert (s["groups"], s["objects"], s["checksum_failures"], len(rec)) == (0, 0, 1, 0), s
    h.store.check()


def test_parts_already_held_stay_where_they_are():
    h, _ = make(8)
    assert put(h, [b"k1"]) == [PutStatus.STORED]
    st = put(h, [b"k1", b"k2"], groups=[b"G"] * 2, parts=[2] * 2)
    assert st == [PutStatus.EXISTS, PutStatus.STORED]
    s = h.store.stats()
    assert (s["groups"], s["group_objects"], s["groups_incomplete"]) == (1, 1, 1), s
    assert put(h, [b"k1", b"k2"], groups=[b"G"] * 2, parts=[2] * 2) == [PutStatus.EXISTS] * 2
    h.store.check()


def test_a_broken_stream_mid_group_leaves_nothing_and_is_counted():
    h, _ = make(8)
    keys = [b"a", b"b", b"c"]
    vals = [b"v" * PAGE_SIZE] * 3
    msg = P.PutRequest(keys, [PAGE_SIZE] * 3, [P.checksum(k, v) for k, v in zip(keys, vals)], None, [b"G"] * 3, [3] * 3)
    head = P.encode_request(msg, 1)
    session = h.new_session("peer")
    header = h.parse_header(session, head[: P.HEADER_SIZE])
    ingest = h.begin_put(session, header, h.decode(session, header, head[P.HEADER_SIZE:]))
    for i in range(2):  # two parts in, then the connection breaks
        ingest.reserve(i)[:] = vals[i]
        ingest.complete(i)
    ingest.abort()
    assert not any(k in h.store for k in keys) and h.store.arena.used_bytes == 0
    assert h.store.stats()["groups_torn"] == 1
    h.store.check()
