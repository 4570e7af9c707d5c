"""Issue 23's PUT groups on the wire: both servers (the Python reference and the C data plane)
refuse the same bad ``groups``/``group_parts`` with the same code as kvfabric.protocol's decoder,
drain the frame's payload and keep the connection."""

import msgpack
import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, ProtocolError

G, H = b"g" * 16, b"h" * 16


def put_meta(keys, groups, parts, **extra):
    m = {"keys": keys, "sizes": [1] * len(keys), "checksums": [p.checksum(k, b"x") for k in keys]}
    if groups is not None:
        m["groups"] = groups
    if parts is not None:
        m["group_parts"] = parts
    m.update(extra)
    return m


A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
BAD = [
    ("groups_without_parts", put_meta([A], [G], None)),
    ("parts_without_groups", put_meta([A], None, [1])),
    ("groups_too_short", put_meta([A, B], [G], [2, 2])),
    ("parts_too_long", put_meta([A], [G], [1, 1])),
    ("empty_group_key", put_meta([A], [b""], [1])),
    ("group_key_too_long", put_meta([A], [b"g" * 65], [1])),
    ("group_key_str", put_meta([A], ["g"], [1])),
    ("zero_parts", put_meta([A], [G], [0])),
    ("too_many_parts", put_meta([A], [G], [p.MAX_KEYS_PER_BATCH + 1])),
    ("negative_parts", put_meta([A], [G], [-1])),
    ("part_missing", put_meta([A], [G], [2])),
    ("parts_disagree", put_meta([A, B], [G, G], [2, 1])),
    ("not_consecutive", put_meta([A, B, C], [G, H, G], [2, 1, 2])),
    ("named_twice", put_meta([A, B, C], [G, H, G], [1, 1, 1])),
    # bad parents and bad groups: parents are checked first on both sides (BAD_KEY)
    ("bad_parents_and_groups", put_meta([A], [G], [2], parents=[b""])),
]


def python_code(meta) -> ErrorCode:
    raw = msgpack.packb(meta, use_bin_type=True)
    h = p.unpack_header(p.pack_header(p.Op.PUT, 1, len(raw), len(meta["keys"])))
    with pytest.raises(ProtocolError) as ei:
        p.decode_request(h, raw)
    return ei.value.code


@pytest.mark.parametrize("name,meta", BAD, ids=[b[0] for b in BAD])
def test_bad_groups_are_refused_alike(address, open_raw, name, meta):
    want = python_code(meta)
    assert want in (ErrorCode.MALFORMED, ErrorCode.BAD_KEY), (name, want)
    r = open_raw(address)
    raw = msgpack.packb(meta, use_bin_type=True)
    payload = b"x" * len(meta["keys"])
    r.send(p.pack_header(p.Op.PUT, 9, len(raw), len(payload)) + raw + payload)
    frame = r.recv_frame()
    h = p.unpack_header(frame)
    reply = p.decode_meta(frame[p.HEADER_SIZE:])
    assert h.is_error and h.request_id == 9 and reply["code"] == want, (name, reply)
    # the payload was drained: the connection goes on, and nothing of the refused frame was stored
    ex = p.encode_request(p.ExistsRequest(keys=meta["keys"]), 10)
    r.send(ex)
    frame = r.recv_frame()
    h = p.unpack_header(frame)
    assert not h.is_error and h.request_id == 10, (name, frame)
    assert p.decode_meta(frame[p.HEADER_SIZE:]) == {"present": [False] * len(meta["keys"])}, name


def test_a_valid_group_frame_is_stored_by_both(address, open_raw):
    r = open_raw(address)
    keys = [A + b"1", B + b"1", C + b"1"]
    msg = p.PutRequest(keys=keys, sizes=[1, 1, 1], checksums=[p.checksum(k, b"x") for k in keys],
                       groups=[G, G, H], group_parts=[2, 2, 1])
    r.send(p.encode_request(msg, 3) + b"xxx")
    frame = r.recv_frame()
    assert p.decode_meta(frame[p.HEADER_SIZE:]) == {"status": [0, 0, 0]}, frame


def test_the_native_policy_sees_one_entry_per_group(make_server, open_raw):
    """The control thread's policy gets one INSERT per group (its first part, the group's bytes);
    evicting that entry evicts every part."""
    from kvfabric.testing.poll import wait_for

    srv = make_server(capacity=1 << 20)
    r = open_raw(srv.address)
    for g in range(3):
        keys = [b"g%d/%d" % (g, i) for i in range(4)]
        vals = [bytes([i]) * 4096 for i in range(4)]
        msg = p.PutRequest(keys=keys, sizes=[4096] * 4, checksums=[p.checksum(k, v) for k, v in zip(keys, vals)],
                           groups=[b"group-%d" % g] * 4, group_parts=[4] * 4)
        r.send(p.encode_request(msg, g + 1) + b"".join(vals))
        assert p.decode_meta(r.recv_frame()[p.HEADER_SIZE:]) == {"status": [0] * 4}
    assert wait_for(lambda: len(srv.policy) == 3), len(srv.policy)
    assert {k: srv._sizes[k] for k in (b"g0/0", b"g1/0", b"g2/0")} == dict.fromkeys((b"g0/0", b"g1/0", b"g2/0"),
                                                                                     4 * 4096)
    assert srv._srv.evict(b"g1/0") == 4 * 4096  # the whole group, named by its representative
    r.send(p.encode_request(p.ExistsRequest(keys=[b"g1/%d" % i for i in range(4)] + [b"g0/3"]), 9))
    assert p.decode_meta(r.recv_frame()[p.HEADER_SIZE:]) == {"present": [False] * 4 + [True]}


def test_groups_over_shm_are_admitted_and_refused_whole(make_server):
    """The same-host path (SHM_RESERVE + COMMIT) keeps the PUT's group rules."""
    from kvfabric.transport import shm, tcp

    srv = make_server(capacity=1 << 20)
    c = shm.connect(srv.address, timeout_s=5)
    other = tcp.connect(srv.address, timeout_s=5)
    keys = [b"s/%d" % i for i in range(3)]
    vals = [bytes([i + 1]) * 5000 for i in range(3)]
    sums = [p.checksum(k, v) for k, v in zip(keys, vals)]
    msg = p.PutRequest(keys, [5000] * 3, sums, groups=[b"S"] * 3, group_parts=[3] * 3)
    assert c.request(msg, vals).msg.status == [0, 0, 0]
    s = srv.stats()
    assert (s["groups"], s["group_objects"], s["groups_stored"]) == (1, 3, 1), s
    # a part written wrong: the whole group is refused at COMMIT, its slots given back
    keys2 = [b"t/%d" % i for i in range(2)]
    res = c._control(p.ShmReserveRequest(keys=keys2, sizes=[10, 10], groups=[b"T"] * 2, group_parts=[2, 2]), None)
    assert res.status == [0, 0] and min(res.offsets) >= 0, res
    for off in res.offsets:
        c._view[off:off + 10] = b"0123456789"
    done = c._control(p.ShmCommitRequest(res=res.res, checksums=[p.checksum(keys2[0], b"0123456789"), 1]), None)
    assert done.status == [p.PutStatus.CHECKSUM_MISMATCH] * 2
    assert other.request(p.ExistsRequest(keys2)).msg.present == [False, False]
    # a group larger than the arena: no slot handed out for any part
    res = c._control(p.ShmReserveRequest(keys=[b"u/0", b"u/1"], sizes=[600 << 10] * 2, groups=[b"U"] * 2,
                                         group_parts=[2, 2]), None)
    assert res.status == [p.PutStatus.TOO_LARGE] * 2 and res.offsets == [-1, -1], res
    s = srv.stats()
    assert (s["groups"], s["groups_refused"], s["objects"]) == (1, 2, 3), s
    c.close()
    other.close()


def _scenario(call):
    """Groups A, B (chained under A), an ungrouped x, group C in 8 pages; GETs of A's second part and
    of x; then 1-page fillers. Returns the units in the order they left (a unit leaves whole or the
    scenario fails), as both servers must agree on it. ``call(msg, payload) -> reply meta``."""
    page = 4096

    def put(keys, groups, parts, parents):
        vals = [bytes([len(k)]) * page for k in keys]
        msg = p.PutRequest(keys, [page] * len(keys), [p.checksum(k, v) for k, v in zip(keys, vals)], parents, groups,
                           parts)
        return call(msg, b"".join(vals))["status"]

    def get(keys):
        return call(p.GetRequest(keys), b"")["sizes"]

    def present(keys):
        return call(p.ExistsRequest(keys), b"")["present"]

    units = {b"A": [b"A1", b"A2"], b"B": [b"B1", b"B2"], b"x": [b"x"], b"C": [b"C1", b"C2"]}
    groups = {b"A": None, b"B": b"A1", b"C": None}
    for name, keys in units.items():
        n = len(keys)
        if name in groups:
            parents = [groups[name]] + [None] * (n - 1) if groups[name] else None
            assert put(keys, [name] * n, [n] * n, parents) == [0] * n, name
        else:
            assert put(keys, None, None, None) == [0], name
    assert get([b"A2"]) == [page] and get([b"x"]) == [page]
    gone: list[bytes] = []
    for i in range(1, 9):
        f = b"f%d" % i
        assert put([f], None, None, None) == [0], f
        units[f] = [f]
        for name, keys in units.items():
            held = present(keys)
            assert all(held) or not any(held), f"partial unit {name}: {dict(zip(keys, held))}"
            if not any(held) and name not in gone:
                gone.append(name)
    return gone


@pytest.mark.parametrize("policy", ["lru", "prefix-lfu", "s3fifo", "tail-lru"])
def test_both_servers_evict_groups_in_the_same_order_for_every_policy(make_server, open_raw, policy):
    """The C store (events mapped to one policy entry per group, the Python control thread's
    policy) and the reference store evict the same units in the same order."""
    from kvfabric.testing.reference.handlers import Handlers
    from kvfabric.testing.reference.store import Store

    srv = make_server(capacity=8 * 4096, policy=policy)
    r = open_raw(srv.address)
    rid = [0]

    def call(msg, payload=b""):
        rid[0] += 1
        r.send(p.encode_request(msg, rid[0]) + payload)
        frame = r.recv_frame()
        return p.decode_meta(frame[p.HEADER_SIZE:p.HEADER_SIZE + p.unpack_header(frame).meta_len])

    native_order = _scenario(call)

    h = Handlers(Store(8 * 4096, policy), server_id="ref")

    def handle(msg, payload=b""):
        session = h.new_session("peer")
        head = p.encode_request(msg, 1)
        header = h.parse_header(session, head[: p.HEADER_SIZE])
        msg = h.decode(session, header, head[p.HEADER_SIZE:])
        if isinstance(msg, p.PutRequest):
            ingest = h.begin_put(session, header, msg)
            for i in range(len(msg.keys)):
                view = ingest.reserve(i)
                if view is not None:
                    view[:] = payload[4096 * i:4096 * (i + 1)]
                    ingest.complete(i)
            reply = ingest.reply()
        else:
            reply = h.handle(session, header, msg)
        out = p.decode_meta(reply.head[p.HEADER_SIZE:])
        reply.release()
        return out

    ref_order = _scenario(handle)
    assert native_order == ref_order, (native_order, ref_order)
    # the orders tests/unit/test_groups.py explains policy by policy (there by representative key)
    assert native_order == {"lru": [b"B", b"C", b"A", b"x"], "tail-lru": [b"B", b"C", b"A", b"x"],
                            "s3fifo": [b"B", b"C", b"f1", b"f2", b"f3"],
                            "prefix-lfu": [b"B", b"C", b"f1", b"A"]}[policy], native_order
    s = srv.stats()
    assert s["groups_incomplete"] == 0 and s["group_objects"] == 2 * s["groups"], s
