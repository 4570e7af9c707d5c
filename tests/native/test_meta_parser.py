"""One metadata parser behaviour: both servers answer MALFORMED to the same bad metadata.

The Python reference (kvfabric.testing.reference, protocol.decode_meta) and the C
server (csrc/kvf_mpack.c kvf_mr_check_meta, called by kvf_ops_request) must agree:
metadata is exactly one msgpack map, nothing truncated, nothing after it, no map
that holds the same key twice, every str valid UTF-8. Either server answers an error frame with
MALFORMED and keeps the connection (the frame's length fields were sound).
"""

import msgpack
import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, ProtocolError

K = b"k" * 16

# (name, opcode, metadata bytes): each must be refused with MALFORMED
BAD = [
    # {"keys": [K], "keys": [K]}: msgpack-python would keep the last; both servers refuse
    ("duplicate_key", p.Op.EXISTS, b"\x82" + msgpack.packb("keys") + msgpack.packb([K])
     + msgpack.packb("keys") + msgpack.packb([K])),
    # the same key spelled as fixstr and as str8 is still the same key
    ("duplicate_key_other_encoding", p.Op.EXISTS, b"\x82" + msgpack.packb("keys") + msgpack.packb([K])
     + b"\xd9\x04keys" + msgpack.packb([K])),
    ("duplicate_key_nested", p.Op.EXISTS, b"\x82" + msgpack.packb("keys") + msgpack.packb([K])
     + msgpack.packb("x") + b"\x82\xa1a\x01\xa1a\x02"),
    ("trailing_byte", p.Op.EXISTS, msgpack.packb({"keys": [K]}) + b"\x00"),
    ("trailing_map", p.Op.PING, msgpack.packb({}) + msgpack.packb({})),
    ("truncated_map", p.Op.EXISTS, b"\x82" + msgpack.packb("keys") + msgpack.packb([K])),
    ("truncated_array", p.Op.EXISTS, b"\x81" + msgpack.packb("keys") + b"\x92" + msgpack.packb(K)),
    ("truncated_bin", p.Op.EXISTS, b"\x81" + msgpack.packb("keys") + b"\x91\xc4\x10" + K[:8]),
    ("not_a_map", p.Op.PING, msgpack.packb([1, 2])),
    ("empty", p.Op.PING, b""),
    ("int_map_key", p.Op.PING, b"\x81\x01\x01"),
    ("invalid_utf8_value", p.Op.EXISTS, b"\x82" + msgpack.packb("keys") + msgpack.packb([K])
     + msgpack.packb("x") + b"\xa2\xff\xfe"),
    ("surrogate_in_key", p.Op.PING, b"\x81\xa3\xed\xa0\x80\x01"),
    ("overlong_utf8", p.Op.PING, b"\x81\xa1x\xa2\xc0\xaf"),
]


def exchange(raw, opcode, meta, rid):
    raw.send(p.pack_header(opcode, rid, len(meta), 0) + meta)
    frame = raw.recv_frame()
    h = p.unpack_header(frame)
    return h, p.decode_meta(frame[p.HEADER_SIZE:])


@pytest.mark.parametrize("name,opcode,meta", BAD, ids=[b[0] for b in BAD])
def test_bad_metadata_is_malformed_on_both_servers(address, open_raw, name, opcode, meta):
    raw = open_raw(address)
    h, reply = exchange(raw, opcode, meta, 5)
    assert h.is_error and h.request_id == 5, (name, reply)
    assert reply["code"] == ErrorCode.MALFORMED, (name, reply)
    # the frame's lengths were sound: the connection goes on
    h, reply = exchange(raw, p.Op.PING, p.encode_meta({}), 6)
    assert not h.is_error and h.request_id == 6 and reply == {}


def test_the_same_metadata_without_the_defect_is_accepted(address, open_raw):
    raw = open_raw(address)
    h, reply = exchange(raw, p.Op.EXISTS, msgpack.packb({"keys": [K], "x": {"a": 1, "b": 2}}), 1)
    assert not h.is_error and reply == {"present": [False]}


def test_python_decode_meta_refuses_what_the_servers_refuse():
    for name, _, meta in BAD:
        with pytest.raises(ProtocolError) as e:
            p.decode_meta(meta)
        assert e.value.code == ErrorCode.MALFORMED, name


def test_a_large_map_with_one_duplicate_is_refused_by_the_c_server(server, open_raw):
    pairs = b"".join(msgpack.packb(f"f{i}") + b"\x00" for i in range(200))
    meta = b"\xde" + (202).to_bytes(2, "big") + pairs + msgpack.packb("keys") + msgpack.packb([K]) + \
        msgpack.packb("f77") + b"\x01"
    raw = open_raw(server.address)
    h, reply = exchange(raw, p.Op.EXISTS, meta, 3)
    assert h.is_error and reply["code"] == ErrorCode.MALFORMED
    with pytest.raises(ProtocolError) as e:
        p.decode_meta(meta)
    assert e.value.code == ErrorCode.MALFORMED
    ok = b"\xde" + (201).to_bytes(2, "big") + pairs + msgpack.packb("keys") + msgpack.packb([K])
    h, reply = exchange(raw, p.Op.EXISTS, ok, 4)
    assert not h.is_error and reply["present"] == [False]


def _random_meta(rng):
    """Valid metadata, then (most of the time) one defect: a flipped byte, a cut, a byte after the map."""
    def value(depth):
        kind = rng.randrange(7 if depth < 3 else 4)
        if kind == 0:
            return rng.randrange(-(1 << 40), 1 << 63)
        if kind == 1:
            return rng.randbytes(rng.randrange(0, 40))
        if kind == 2:
            return "".join(rng.choice("ab\u00e9\u4e2d") for _ in range(rng.randrange(0, 8)))
        if kind == 3:
            return rng.choice([None, True, False, 1.5])
        if kind in (4, 5):
            return [value(depth + 1) for _ in range(rng.randrange(0, 5))]
        return {f"f{rng.randrange(6)}": value(depth + 1) for _ in range(rng.randrange(0, 5))}

    meta = bytearray(msgpack.packb({f"k{rng.randrange(20)}": value(0) for _ in range(rng.randrange(0, 6))}))
    defect = rng.randrange(5)
    if defect == 0 and meta:
        meta[rng.randrange(len(meta))] = rng.randrange(256)
    elif defect == 1 and len(meta) > 1:
        del meta[rng.randrange(1, len(meta)):]
    elif defect == 2:
        meta += bytes([rng.randrange(256)])
    return bytes(meta)


def test_random_metadata_gets_the_same_verdict_from_both_servers_and_decode_meta(address, open_raw):
    """PING takes any map, so its answer is the metadata parser's verdict alone."""
    import random

    rng = random.Random(1414)
    raw = open_raw(address)
    disagree = []
    for rid in range(1, 301):
        meta = _random_meta(rng)
        try:
            p.decode_meta(meta)
            python_ok = True
        except ProtocolError:
            python_ok = False
        h, reply = exchange(raw, p.Op.PING, meta, rid)
        server_ok = not h.is_error
        if not server_ok:
            assert reply["code"] == ErrorCode.MALFORMED, reply
        if server_ok != python_ok:
            disagree.append((meta.hex(), python_ok, reply))
    assert not disagree, disagree[:3]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_get_whose_client_verifies_is_not_a_bool_is_malformed_on_both_servers(address, open_raw, value):
    raw = open_raw(address)
    h, reply = exchange(raw, p.Op.GET, msgpack.packb({"keys": [K], "client_verifies": value}), 4)
    assert h.is_error and reply["code"] == ErrorCode.MALFORMED, reply
    h, reply = exchange(raw, p.Op.GET, msgpack.packb({"keys": [K], "client_verifies": True}), 5)
    assert not h.is_error and reply["sizes"] == [-1]
