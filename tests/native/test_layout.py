"""The C mirror of the wire format (csrc/kvf_protocol.h) agrees with kvfabric/protocol/."""

import struct

import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode

native = pytest.importorskip("kvfabric._native")


def test_header_layout_matches_the_python_struct():
    lay = native.layout()
    assert lay["size"] == p.HEADER_SIZE == p.HEADER.size == 32
    # protocol.HEADER is "<4sHBBQIQI": compute each field's offset from the format
    fmt = p.HEADER.format.lstrip("<")
    names = ["magic", "version", "opcode", "flags", "request_id", "meta_len", "payload_len", "reserved"]
    codes = ["4s", "H", "B", "B", "Q", "I", "Q", "I"]
    assert fmt == "".join(codes)
    off = 0
    for name, code in zip(names, codes):
        size = struct.calcsize("<" + code)
        assert lay[name] == (off, size), name
        off += size
    assert lay["MAGIC"] == p.MAGIC and lay["VERSION"] == p.VERSION == 3
    assert (lay["FLAG_REPLY"], lay["FLAG_ERROR"]) == (p.FLAG_REPLY, p.FLAG_ERROR)


def test_constants_match():
    c = native.constants()
    assert c["ops"] == {op.name: int(op) for op in p.Op}
    assert c["errors"] == {e.name: int(e) for e in ErrorCode}
    assert c["put_status"] == {s.name: int(s) for s in p.PutStatus}
    assert c["limits"] == p.DEFAULT_LIMITS.to_meta()
    assert c["shm_ops"] == {op.name: int(op) for op in p.ShmOp}
    assert c["max_lease_ms"] == p.MAX_LEASE_MS


def test_mirrored_constants_match_both_ways():
    """Each constant Python keeps a copy of, against C's (a change on either side fails here)."""
    from kvfabric import metrics
    from kvfabric.errors import FATAL_CODES
    from kvfabric.testing.reference import arena

    c = native.constants()
    assert c["version"] == p.VERSION, (c["version"], p.VERSION)
    assert set(c["fatal_errors"]) == {int(e) for e in FATAL_CODES}, (
        sorted(ErrorCode(x).name for x in c["fatal_errors"]), sorted(e.name for e in FATAL_CODES))
    assert c["lat_buckets"] == metrics.LAT_BUCKETS, (c["lat_buckets"], metrics.LAT_BUCKETS)
    assert c["lat_ops"] == metrics.LAT_OPS, (c["lat_ops"], metrics.LAT_OPS)
    assert c["page_bytes"] == arena.PAGE_SIZE, (c["page_bytes"], arena.PAGE_SIZE)
    assert (c["medium_dram"], c["medium_ssd"]) == (p.MEDIUM_DRAM, p.MEDIUM_SSD), (c["medium_dram"], c["medium_ssd"])
    # HELLO's proofs (kvfabric.protocol.auth)
    assert (c["nonce_bytes"], c["proof_bytes"]) == (p.NONCE_BYTES, p.PROOF_BYTES), (c["nonce_bytes"], c["proof_bytes"])
    assert (c["hello_server_label"], c["hello_client_label"]) == (p.auth.SERVER_LABEL, p.auth.CLIENT_LABEL)


@pytest.mark.parametrize(
    "fields",
    [(1, 0, 0, 0, 0), (6, 0, 2**64 - 1, 125, 3), (5, 1, 77, 2**32 - 1, 2**63), (8, 3, 123456789, 0, 1 << 30)],
)
def test_c_packs_the_same_bytes(fields):
    opcode, flags, rid, mlen, plen = fields
    assert native.pack_header(opcode, flags, rid, mlen, plen) == p.pack_header(opcode, rid, mlen, plen, flags)


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda b: b"XXXX" + b[4:], ErrorCode.BAD_MAGIC),
        (lambda b: b[:4] + struct.pack("<H", 1) + b[6:], ErrorCode.BAD_VERSION),  # a protocol-1 peer
        (lambda b: b[:4] + struct.pack("<H", 2) + b[6:], ErrorCode.BAD_VERSION),  # a protocol-2 peer
        (lambda b: b[:7] + b"\x04" + b[8:], ErrorCode.MALFORMED),
        (lambda b: b[:28] + b"\x01\x00\x00\x00", ErrorCode.MALFORMED),
        (lambda b: b[:16] + struct.pack("<I", p.MAX_META_BYTES + 1) + b[20:], ErrorCode.META_TOO_LARGE),
        (lambda b: b[:20] + struct.pack("<Q", p.MAX_PAYLOAD_BYTES + 1) + b[28:], ErrorCode.PAYLOAD_TOO_LARGE),
    ],
)
def test_c_rejects_headers_like_python(mutate, code):
    bad = mutate(p.pack_header(5, 9, 10, 0))
    with pytest.raises(p.ProtocolError) as exc:
        p.unpack_header(bad)
    assert exc.value.code == code
    assert native.check_header(bad, p.MAX_META_BYTES, p.MAX_PAYLOAD_BYTES) == int(code)


def test_c_accepts_what_python_accepts():
    good = p.pack_header(6, 1, p.MAX_META_BYTES, p.MAX_PAYLOAD_BYTES, p.FLAG_REPLY)
    p.unpack_header(good)
    assert native.check_header(good, p.MAX_META_BYTES, p.MAX_PAYLOAD_BYTES) == 0


def test_c_reads_get_reply_sizes_like_python():
    reply = p.GetReply(sizes=[3, -1, 0, 2**26, 127, 128, 65536], checksums=[0] * 7)
    meta = p.encode_meta(reply.to_meta())
    assert native.parse_sizes(meta, 7) == list(reply.sizes)
    with pytest.raises(p.ProtocolError):
        native.parse_sizes(meta, 6)  # count mismatch
    with pytest.raises(p.ProtocolError):
        native.parse_sizes(p.encode_meta({"checksums": []}), 0)
