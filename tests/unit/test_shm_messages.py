"""The typed shm messages (protocol.Shm*): a round trip for each, and what from_meta refuses."""

import pytest

from kvfabric import protocol as p
from kvfabric.errors import ErrorCode, ProtocolError

K = bytes(range(16))

MESSAGES = [
    p.ShmAttachRequest(),
    p.ShmAttachReply(capacity=16 << 20),
    p.ShmLeaseRequest(keys=[K, b"x" * 64]),
    p.ShmLeaseReply(lease=3, offsets=[0, -1], sizes=[10, -1], checksums=[p.checksum(K, b"0123456789"), 0]),
    p.ShmReleaseRequest(lease=3),
    p.ShmReserveRequest(keys=[K, b"k2"], sizes=[3, 0]),
    p.ShmReserveRequest(keys=[K, b"k2"], sizes=[3, 0], parents=[None, K]),
    p.ShmReserveRequest(keys=[K, b"k2"], sizes=[3, 0], groups=[K, K], group_parts=[2, 2]),
    p.ShmReserveReply(res=1, offsets=[4096, -1], status=[0, 1]),
    p.ShmCommitRequest(res=1, checksums=[p.checksum(K, b"abc"), 0]),
    p.ShmCommitReply(status=[0, 4]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    reply = type(msg).__name__.endswith("Reply")
    frame = p.encode_reply(msg, 9) if reply else p.encode_request(msg, 9)
    h = p.unpack_header(frame)
    assert h.opcode == msg.op and h.is_reply == reply and h.payload_len == 0
    meta = frame[p.HEADER_SIZE:]
    back = p.decode_reply(h, meta, msg.op) if reply else p.REQUESTS[h.opcode].from_meta(p.decode_meta(meta))
    assert type(back) is type(msg) and back == msg


def test_every_shm_opcode_has_its_messages():
    for op in p.ShmOp:
        assert p.REQUESTS[op].op == op
        if op != p.ShmOp.RELEASE:  # RELEASE has no reply
            assert p.REPLIES[op].op == op


@pytest.mark.parametrize("cls,meta,code", [
    (p.ShmReserveRequest, {"keys": [K], "sizes": [1], "parents": [b""]}, ErrorCode.BAD_KEY),
    (p.ShmReserveRequest, {"keys": [K], "sizes": [1], "parents": [K, K]}, ErrorCode.MALFORMED),
    (p.ShmReserveRequest, {"keys": [K], "sizes": [-1]}, ErrorCode.MALFORMED),
    (p.ShmReleaseRequest, {"lease": -1}, ErrorCode.MALFORMED),
    (p.ShmCommitRequest, {"res": 1}, ErrorCode.MALFORMED),
    (p.ShmLeaseReply, {"lease": 1, "offsets": [0], "sizes": [], "checksums": [0]}, ErrorCode.MALFORMED),
    (p.ShmReserveReply, {"res": 1, "offsets": [0, 1], "status": [0]}, ErrorCode.MALFORMED),
    (p.ShmReserveReply, {"res": 1, "offsets": [0], "status": [9]}, ErrorCode.MALFORMED),
    (p.ShmAttachReply, {"capacity": 0}, ErrorCode.MALFORMED),
])
def test_from_meta_refuses(cls, meta, code):
    with pytest.raises(ProtocolError) as e:
        cls.from_meta(meta)
    assert e.value.code == code


def test_hello_reply_carries_shm_socket_only_when_set():
    base = dict(server="s", server_id="i", transports=("shm", "tcp"), limits=p.DEFAULT_LIMITS, capacity=1)
    assert "shm_socket" not in p.HelloReply(**base).to_meta()
    meta = p.HelloReply(**base, shm_socket="/run/kvfabric/shm-7070.sock").to_meta()
    assert p.HelloReply.from_meta(meta).shm_socket == "/run/kvfabric/shm-7070.sock"
    with pytest.raises(ProtocolError):
        p.HelloReply.from_meta({**meta, "shm_socket": 5})
