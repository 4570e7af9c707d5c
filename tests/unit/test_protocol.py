"""The wire format: golden bytes, a round trip for every message, and every limit."""

import struct

import msgpack
import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, ProtocolError, RemoteError

KEY = bytes(range(16))

REQUESTS = [
    p.HelloRequest(client="kvfabric-py/0.1", transports=("tcp", "shm"), nonce=bytes(range(32))),
    p.HelloRequest(),
    p.AuthRequest(proof=b"\x07" * 32),
    p.PingRequest(),
    p.ExistsRequest(keys=[KEY, b"k2"]),
    p.LookupRequest(keys=[KEY], lease_ms=250),
    p.LookupRequest(keys=[KEY]),
    p.LookupRequest(keys=[KEY, b"k2"], lease_ms=9, media=True),
    p.GetRequest(keys=[KEY, b"x" * 64]),
    p.PutRequest(keys=[KEY, b"k2"], sizes=[3, 0], checksums=[p.checksum(KEY, b"abc"), p.checksum(b"k2", b"")]),
    p.PutRequest(keys=[KEY], sizes=[5], checksums=[1], parents=[b"parent"]),
    p.PutRequest(keys=[KEY, b"k2", b"k3"], sizes=[1, 2, 3], checksums=[1, 2, 3], groups=[b"g", b"g", b"h"],
                 group_parts=[2, 2, 1]),
    p.PutRequest(keys=[KEY], sizes=[3], checksums=[1], ns=b"\x11" * 16),
    p.DeleteRequest(keys=[KEY]),
    p.StatsRequest(),
    p.RetireRequest(ns=bytes(range(16, 32))),
]
REPLIES = [
    p.HelloReply(server="kvfabric/0.1", server_id="127.0.0.1:7070", transports=("tcp",), limits=p.DEFAULT_LIMITS,
                 capacity=1 << 30),
    p.HelloReply(server="kvfabric/0.1", server_id="pool-a", transports=("tcp",), limits=p.DEFAULT_LIMITS,
                 capacity=1 << 30, auth_required=True, nonce=b"\x01" * 32, proof=b"\x02" * 32),
    p.AuthReply(),
    p.PingReply(),
    p.ExistsReply(present=[True, False]),
    p.LookupReply(count=3),
    p.LookupReply(count=3, media=bytes([p.MEDIUM_DRAM, p.MEDIUM_SSD, p.MEDIUM_DRAM])),
    p.LookupReply(count=0, media=b""),
    p.GetReply(sizes=[3, -1, 0], checksums=[7, 0, 9]),
    p.PutReply(status=[int(s) for s in p.PutStatus]),
    p.DeleteReply(deleted=2),
    p.StatsReply(stats={"objects": 1, "errors": {"MALFORMED": 2}}),
    p.RetireReply(generation=3),
]


def split(frame):
    h = p.unpack_header(frame)
    return h, frame[p.HEADER_SIZE : p.HEADER_SIZE + h.meta_len]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    frame = p.encode_request(msg, 77)
    h, meta = split(frame)
    assert (h.opcode, h.request_id, h.is_reply, h.payload_len) == (msg.op, 77, False, msg.payload_len())
    assert len(frame) == p.HEADER_SIZE + h.meta_len
    back = p.decode_request(h, meta)
    assert type(back) is type(msg) and back.to_meta() == msg.to_meta()


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    h, meta = split(p.encode_reply(msg, 5))
    assert h.is_reply and not h.is_error and h.request_id == 5
    back = p.decode_reply(h, meta, msg.op)
    assert type(back) is type(msg) and back.to_meta() == msg.to_meta()


# Protocol 3: every header carries 0300 at offset 4; HELLO carries a bin(32) nonce, its reply
# auth_required (+ nonce and proof with a token), AUTH (opcode 9) a bin(32) proof.
GOLDEN = {
    "put": (
        p.encode_request(p.PutRequest(keys=[KEY], sizes=[3], checksums=[p.checksum(KEY, b"abc")], parents=[None]),
                         0x0102030405060708),
        "4b5646420300060008070605040302013f00000003000000000000000000000084a46b65797391c410000102030405060708"
        "090a0b0c0d0e0fa573697a65739103a9636865636b73756d7391cfe9c45c35ea12b664a7706172656e747391c0",
    ),
    "get_reply": (
        p.encode_reply(p.GetReply(sizes=[3, -1], checksums=[p.checksum(KEY, b"abc"), 0]), 1),
        "4b5646420300050101000000000000001f00000003000000000000000000000082a573697a65739203ffa9636865636b7375"
        "6d7392cfe9c45c35ea12b66400",
    ),
    "error": (
        p.encode_error(5, 42, ErrorCode.TOO_MANY_KEYS, "too many"),
        "4b564642030005032a000000000000001800000000000000000000000000000082a4636f646505a76d657373616765a8746f"
        "6f206d616e79",
    ),
    "lookup": (
        p.encode_request(p.LookupRequest(keys=[b"k1", b"k2"], lease_ms=500), 3),
        "4b5646420300040003000000000000001b00000000000000000000000000000082a46b65797392c4026b31c4026b32a86c65"
        "6173655f6d73cd01f4",
    ),
    "hello": (
        p.encode_request(p.HelloRequest(client="kvfabric-py/0.1", transports=("tcp", "shm"), nonce=bytes(range(32))), 0),
        "4b5646420300010000000000000000005d00000000000000000000000000000084a776657273696f6e03a6636c69656e74af"
        "6b766661627269632d70792f302e31aa7472616e73706f72747392a3746370a373686da56e6f6e6365c42000010203040506"
        "0708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
    ),
    "hello_reply": (
        p.encode_reply(p.HelloReply(server="kvfabric/0.1", server_id="pool-a", transports=("tcp",), limits=p.DEFAULT_LIMITS,
                                 capacity=1 << 30, auth_required=True, nonce=b"\x01" * 32, proof=b"\x02" * 32), 2),
        "4b5646420300010102000000000000002901000000000000000000000000000089a776657273696f6e03a6736572766572ac"
        "6b766661627269632f302e31a97365727665725f6964a6706f6f6c2d61aa7472616e73706f72747391a3746370a66c696d69"
        "747386b26d61785f6b6579735f7065725f6261746368cd1000ad6d61785f6b65795f627974657340ae6d61785f6d6574615f"
        "6279746573ce00100000b16d61785f7061796c6f61645f6279746573ce40000000b06d61785f6f626a6563745f6279746573"
        "ce04000000ad6d61785f696e5f666c6967687440a86361706163697479ce40000000ad617574685f7265717569726564c3a5"
        "6e6f6e6365c4200101010101010101010101010101010101010101010101010101010101010101a570726f6f66c420020202"
        "0202020202020202020202020202020202020202020202020202020202",
    ),
    # issue 27: RETIRE (opcode 10) carries a bin(16) namespace tag, its reply the tag's generation;
    # PUT's optional ns is a bin(16) after the other fields
    "retire": (
        p.encode_request(p.RetireRequest(ns=bytes(range(16, 32))), 4),
        "4b56464203000a0004000000000000001600000000000000000000000000000081a26e73c410101112131415161718191a1b1c"
        "1d1e1f",
    ),
    "retire_reply": (
        p.encode_reply(p.RetireReply(generation=3), 4),
        "4b56464203000a0104000000000000000d00000000000000000000000000000081aa67656e65726174696f6e03",
    ),
    "put_ns": (
        p.encode_request(p.PutRequest(keys=[KEY], sizes=[3], checksums=[p.checksum(KEY, b"abc")], ns=b"\x11" * 16), 5),
        "4b5646420300060005000000000000004a00000003000000000000000000000084a46b65797391c410000102030405060708"
        "090a0b0c0d0e0fa573697a65739103a9636865636b73756d7391cfe9c45c35ea12b664a26e73c41011111111111111111111"
        "111111111111",
    ),
    "auth": (
        p.encode_request(p.AuthRequest(proof=b"\x07" * 32), 3),
        "4b5646420300090003000000000000002900000000000000000000000000000081a570726f6f66c420070707070707070707"
        "0707070707070707070707070707070707070707070707",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    frame, hexbytes = GOLDEN[name]
    assert frame.hex() == hexbytes


def test_checksum_binds_the_key():
    """Protocol 2: xxh3_64(value, seed=xxh3_64(key)); the same bytes under two keys differ."""
    assert p.checksum(KEY, b"abc") == 16844689892902614628 == 0xE9C45C35EA12B664
    assert p.checksum(b"k", b"abc") == 13987658807790559195
    assert p.checksum(KEY, b"abc") != p.checksum(b"k", b"abc")
    # and differs from the version-1 checksum (xxh3_64 of the value alone)
    assert p.checksum(KEY, b"abc") != 8696274497037089104
    assert p.checksum(KEY, memoryview(b"abc")) == p.checksum(KEY, bytearray(b"abc"))  # any buffer


def test_version_is_3_and_says_why():
    assert p.VERSION == 3
    assert p.BAD_VERSION_MESSAGE == "this server speaks protocol 3: HELLO proves both sides hold the pool token"
    assert p.HelloRequest().to_meta()["version"] == 3
    assert p.Op.AUTH == 9


# (token, client nonce, server nonce, server id, server proof, client proof): fixed vectors of
# kvfabric.protocol.auth, also checked against the C server (tests/native/test_auth.py)
PROOF_VECTORS = [
    ("s3cret", bytes(range(32)), bytes(range(32, 64)), "127.0.0.1:7070",
     "7ae2b217cc5a6d189b76bbf36f56a2b2ab3fdc3d5d11345642510be435d11c72",
     "b7e2ecd2a2cbe7fe0a1811aca5d9d452736859736556d2bd6c0087d1f50f9a5e"),
    ("pool token \u00e9", b"\x00" * 32, b"\xff" * 32, "pool-a",
     "6d9af40e3a6f98095088b19174cd9a83ea267f962ffc76e67973389eb2e78205",
     "3d99db511c57d6743093f08e70b9920ee85dbc3224ef49a77e0047e718bc2180"),
]


@pytest.mark.parametrize("vec", PROOF_VECTORS, ids=lambda v: v[3])
def test_proofs_match_fixed_vectors(vec):
    import hashlib
    import hmac

    token, nc, ns, sid, server_hex, client_hex = vec
    assert p.server_proof(token, nc, ns, sid).hex() == server_hex
    assert p.client_proof(token, ns, nc).hex() == client_hex
    # the spec spelled out: HMAC-SHA256 keyed by the token's UTF-8 bytes over label || nonces (|| id)
    key = token.encode("utf-8")
    assert hmac.new(key, b"kvfabric-hello-server-v3" + nc + ns + sid.encode(), hashlib.sha256).hexdigest() == server_hex
    assert hmac.new(key, b"kvfabric-hello-client-v3" + ns + nc, hashlib.sha256).hexdigest() == client_hex


def test_proofs_depend_on_every_input():
    token, nc, ns, sid = "s3cret", bytes(range(32)), bytes(range(32, 64)), "a:1"
    base = p.server_proof(token, nc, ns, sid)
    assert len(base) == p.PROOF_BYTES == 32 and len(p.new_nonce()) == p.NONCE_BYTES == 32
    assert base not in {p.server_proof("s3creT", nc, ns, sid), p.server_proof(token, ns, nc, sid),
                        p.server_proof(token, nc, ns, "a:2"), p.client_proof(token, ns, nc)}
    assert p.new_nonce() != p.new_nonce()
    assert p.proof_ok(base, base) and not p.proof_ok(base, None) and not p.proof_ok(base, b"\0" * 32)


@pytest.mark.parametrize("meta,code", [
    ({"version": 3, "client": "x", "transports": []}, ErrorCode.MALFORMED),  # no nonce
    ({"version": 3, "client": "x", "transports": [], "nonce": b"\0" * 31}, ErrorCode.MALFORMED),
    ({"version": 3, "client": "x", "transports": [], "nonce": "\0" * 32}, ErrorCode.MALFORMED),  # str, not bin
    ({"version": 2, "client": "x", "transports": [], "auth": "tok"}, ErrorCode.BAD_VERSION),  # a protocol-2 HELLO
])
def test_hello_request_needs_a_32_byte_nonce(meta, code):
    with pytest.raises(ProtocolError) as ei:
        p.HelloRequest.from_meta(meta)
    assert ei.value.code == code, ei.value


@pytest.mark.parametrize("meta", [{}, {"proof": b"\0" * 31}, {"proof": "x" * 32}])
def test_auth_request_needs_a_32_byte_proof(meta):
    with pytest.raises(ProtocolError) as ei:
        p.AuthRequest.from_meta(meta)
    assert ei.value.code == ErrorCode.AUTH_FAILED, ei.value


def test_header_layout():
    assert p.HEADER_SIZE == 32
    raw = p.pack_header(p.Op.GET, 9, 10, 11, p.FLAG_REPLY)
    assert raw[:4] == b"KVFB"
    assert struct.unpack_from("<H", raw, 4)[0] == 3
    assert raw[6] == p.Op.GET and raw[7] == p.FLAG_REPLY
    assert struct.unpack_from("<QIQI", raw, 8) == (9, 10, 11, 0)


def bad_header(**kw):
    fields = dict(magic=b"KVFB", version=3, opcode=2, flags=0, rid=1, meta=0, payload=0, reserved=0)
    fields.update(kw)
    return p.HEADER.pack(*fields.values())


@pytest.mark.parametrize(
    "kw,code",
    [
        (dict(magic=b"HTTP"), ErrorCode.BAD_MAGIC),
        (dict(version=1), ErrorCode.BAD_VERSION),
        (dict(version=2), ErrorCode.BAD_VERSION),
        (dict(version=4), ErrorCode.BAD_VERSION),
        (dict(flags=0x80), ErrorCode.MALFORMED),
        (dict(reserved=1), ErrorCode.MALFORMED),
        (dict(meta=p.MAX_META_BYTES + 1), ErrorCode.META_TOO_LARGE),
        (dict(payload=p.MAX_PAYLOAD_BYTES + 1), ErrorCode.PAYLOAD_TOO_LARGE),
        (dict(payload=2**64 - 1), ErrorCode.PAYLOAD_TOO_LARGE),
    ],
)
def test_header_limits_are_checked_before_allocation(kw, code):
    with pytest.raises(ProtocolError) as ei:
        p.unpack_header(bad_header(**kw))
    assert ei.value.code == code


def test_short_header():
    with pytest.raises(ProtocolError) as ei:
        p.unpack_header(b"KVFB")
    assert ei.value.code == ErrorCode.LENGTH_MISMATCH


def test_pre_auth_limits_are_tiny():
    with pytest.raises(ProtocolError) as ei:
        p.unpack_header(bad_header(meta=5000), p.PRE_AUTH_LIMITS)
    assert ei.value.code == ErrorCode.META_TOO_LARGE


def test_unknown_opcode():
    h = p.unpack_header(bad_header(opcode=200))
    with pytest.raises(ProtocolError) as ei:
        p.decode_request(h, p.encode_meta({}))
    assert ei.value.code == ErrorCode.UNKNOWN_OPCODE and not ei.value.fatal


def decode(op, meta, payload_len=0, limits=p.DEFAULT_LIMITS):
    raw = msgpack.packb(meta, use_bin_type=True)
    h = p.unpack_header(p.pack_header(op, 1, len(raw), payload_len))
    return p.decode_request(h, raw, limits)


@pytest.mark.parametrize(
    "op,meta,payload_len,code",
    [
        (p.Op.GET, {"keys": [b"k"] * (p.MAX_KEYS_PER_BATCH + 1)}, 0, ErrorCode.TOO_MANY_KEYS),
        (p.Op.GET, {"keys": [b""]}, 0, ErrorCode.BAD_KEY),
        (p.Op.GET, {"keys": [b"k" * 65]}, 0, ErrorCode.BAD_KEY),
        (p.Op.GET, {"keys": ["text"]}, 0, ErrorCode.BAD_KEY),
        (p.Op.GET, {}, 0, ErrorCode.MALFORMED),
        (p.Op.GET, {"keys": [b"k"]}, 5, ErrorCode.LENGTH_MISMATCH),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [4], "checksums": [1]}, 3, ErrorCode.LENGTH_MISMATCH),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [4, 4], "checksums": [1]}, 8, ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [-4], "checksums": [1]}, 0, ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [p.MAX_OBJECT_BYTES + 1], "checksums": [1]}, p.MAX_OBJECT_BYTES + 1,
         ErrorCode.PAYLOAD_TOO_LARGE),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "parents": [b"a", b"b"]}, 1, ErrorCode.MALFORMED),
        # groups (issue 23): both or neither, as long as keys, keys, 1..max_keys parts, every part, consecutive
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b"g"]}, 1, ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "group_parts": [1]}, 1, ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b"g", b"g"], "group_parts": [1, 1]},
         1, ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b""], "group_parts": [1]}, 1,
         ErrorCode.BAD_KEY),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b"g" * 65], "group_parts": [1]}, 1,
         ErrorCode.BAD_KEY),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": ["g"], "group_parts": [1]}, 1,
         ErrorCode.BAD_KEY),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b"g"], "group_parts": [0]}, 1,
         ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b"g"],
                    "group_parts": [p.MAX_KEYS_PER_BATCH + 1]}, 1, ErrorCode.MALFORMED),
        (p.Op.PUT, {"keys": [b"k"], "sizes": [1], "checksums": [1], "groups": [b"g"], "group_parts": [2]}, 1,
         ErrorCode.MALFORMED),  # a part missing from the frame
        (p.Op.PUT, {"keys": [b"a", b"b"], "sizes": [1, 1], "checksums": [1, 1], "groups": [b"g", b"g"],
                    "group_parts": [2, 1]}, 2, ErrorCode.MALFORMED),  # parts disagree on the count
        (p.Op.PUT, {"keys": [b"a", b"b", b"c"], "sizes": [1, 1, 1], "checksums": [1, 1, 1],
                    "groups": [b"g", b"h", b"g"], "group_parts": [2, 1, 2]}, 3, ErrorCode.MALFORMED),  # not consecutive
        (p.Op.PUT, {"keys": [b"a", b"b", b"c"], "sizes": [1, 1, 1], "checksums": [1, 1, 1],
                    "groups": [b"g", b"h", b"g"], "group_parts": [1, 1, 1]}, 3, ErrorCode.MALFORMED),  # named twice
        (p.Op.LOOKUP, {"keys": [b"k"], "lease_ms": -1}, 0, ErrorCode.MALFORMED),
        (p.Op.GET, {"keys": [b"k"], "client_verifies": 1}, 0, ErrorCode.MALFORMED),
        (p.Op.HELLO, {"client": "x"}, 0, ErrorCode.MALFORMED),
    ],
)
def test_bad_metadata(op, meta, payload_len, code):
    with pytest.raises(ProtocolError) as ei:
        decode(op, meta, payload_len)
    assert ei.value.code == code


def test_too_many_keys_under_a_smaller_limit():
    small = p.Limits(max_keys_per_batch=2)
    with pytest.raises(ProtocolError) as ei:
        decode(p.Op.EXISTS, {"keys": [b"a", b"b", b"c"]}, limits=small)
    assert ei.value.code == ErrorCode.TOO_MANY_KEYS
    exact = p.Limits(max_keys_per_batch=100)
    with pytest.raises(ProtocolError) as ei:
        decode(p.Op.EXISTS, {"keys": [b"a"] * 50}, limits=p.Limits(max_keys_per_batch=20))
    assert ei.value.code == ErrorCode.TOO_MANY_KEYS
    assert len(decode(p.Op.EXISTS, {"keys": [b"a"] * 100}, limits=exact).keys) == 100


def test_garbage_metadata():
    h = p.unpack_header(p.pack_header(p.Op.GET, 1, 3, 0))
    for raw in (b"\xc1\xc1\xc1", b"\x93\x01\x02\x03", b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError) as ei:
            p.decode_request(h, raw)
        assert ei.value.code == ErrorCode.MALFORMED


def test_error_reply_raises_remote_error():
    h, meta = split(p.encode_error(p.Op.GET, 3, ErrorCode.BUSY, "later"))
    assert h.is_error and h.is_reply
    with pytest.raises(RemoteError) as ei:
        p.decode_reply(h, meta, p.Op.GET)
    assert ei.value.code == ErrorCode.BUSY and "later" in str(ei.value)


def test_reply_to_wrong_opcode_is_rejected():
    h, meta = split(p.encode_reply(p.PingReply(), 1))
    with pytest.raises(ProtocolError):
        p.decode_reply(h, meta, p.Op.GET)


def test_get_reply_payload_must_match_sizes():
    raw = p.encode_meta(p.GetReply(sizes=[10], checksums=[0]).to_meta())
    h = p.unpack_header(p.pack_header(p.Op.GET, 1, len(raw), 9, p.FLAG_REPLY))
    with pytest.raises(ProtocolError) as ei:
        p.decode_reply(h, raw, p.Op.GET)
    assert ei.value.code == ErrorCode.LENGTH_MISMATCH


def test_fatal_codes():
    assert ProtocolError(ErrorCode.BAD_MAGIC, "x").fatal
    assert not ProtocolError(ErrorCode.TOO_MANY_KEYS, "x").fatal


@pytest.mark.parametrize("ns", [b"", b"x" * 15, b"x" * 17, "a str tag of 16b", 7, None])
def test_retire_needs_a_16_byte_tag(ns):
    """Issue 27: RETIRE's ns is exactly NS_TAG_BYTES of bin (MALFORMED otherwise, nil and absent too)."""
    meta = {} if ns is None else {"ns": ns}
    with pytest.raises(ProtocolError) as ei:
        p.RetireRequest.from_meta(meta)
    assert ei.value.code == ErrorCode.MALFORMED and "ns must be 16 bytes" in ei.value.message


@pytest.mark.parametrize("ns", [b"", b"x" * 15, b"x" * 17, "a str tag of 16b", 7])
def test_put_ns_is_a_16_byte_tag_or_nil(ns):
    meta = {"keys": [KEY], "sizes": [1], "checksums": [1], "ns": ns}
    with pytest.raises(ProtocolError) as ei:
        p.PutRequest.from_meta(meta)
    assert ei.value.code == ErrorCode.MALFORMED
    assert p.PutRequest.from_meta({**meta, "ns": None}).ns is None
    assert p.PutRequest.from_meta({**meta, "ns": b"t" * 16}).ns == b"t" * 16


@pytest.mark.parametrize("gen", [0, -1, "1", None])
def test_retire_reply_generation_is_positive(gen):
    with pytest.raises(ProtocolError):
        p.RetireReply.from_meta({} if gen is None else {"generation": gen})


@pytest.mark.parametrize("meta", [{"count": 2, "media": b"\x00"}, {"count": 1, "media": b"\x02"},
                                  {"count": 1, "media": [0]}, {"count": 1, "media": None}])
def test_lookup_reply_media_is_one_known_byte_per_counted_key(meta):
    with pytest.raises(p.ProtocolError) as e:
        p.LookupReply.from_meta(meta)
    assert e.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize("media", [1, None, b"x", "yes"])
def test_lookup_request_media_is_a_bool(media):
    with pytest.raises(p.ProtocolError) as e:
        p.LookupRequest.from_meta({"keys": [KEY], "media": media})
    assert e.value.code == ErrorCode.MALFORMED
