"""THE kvfabric wire format (version 3). Nothing else packs or slices frame bytes.

A frame is a 32-byte little-endian header, ``meta_len`` bytes of msgpack
metadata (always a map), then ``payload_len`` raw payload bytes::

    offset size field
    0      4    magic        b"KVFB"
    4      2    version      3 (VERSION)
    6      1    opcode       Op
    7      1    flags        bit0 REPLY, bit1 ERROR
    8      8    request_id   u64, echoed in the reply
    16     4    meta_len     u32
    20     8    payload_len  u64
    28     4    reserved     0

Payload bytes never pass through msgpack: a PUT request carries its objects
concatenated after the metadata, a GET reply the found objects, so both ends
can move them straight between sockets and registered memory.

Every object travels with ``checksum(key, value) = xxh3_64(value,
seed=xxh3_64(key))`` (version 2; version 1 hashed the value alone): the
checksum binds the key, so a PUT whose checksum does not match its key and
bytes is refused (``CHECKSUM_MISMATCH``) and a GET reply's bytes verify only
under the key asked for. HELLO proves both sides hold the pool token
without sending it (version 3, :mod:`.auth`: nonces from both sides, an
HMAC proof each way, then ``AUTH``). The version is negotiated by exact match: the
client's HELLO metadata carries ``version: 3`` (and every header carries 3);
a server answers any other version with ``BAD_VERSION`` (and the message
:data:`BAD_VERSION_MESSAGE`), and a client refuses a server whose HELLO reply
or header carries another version.

Every limit in :class:`Limits` is checked on the header (before any buffer is
allocated) or on the decoded metadata (before any payload is read). Decoding
functions raise :class:`~kvfabric.errors.ProtocolError` carrying the wire
error code the server should answer with.

The package: ``wire`` holds the header, opcodes, limits, checksums and
metadata decoding; ``messages`` the typed messages (frozen dataclasses with
``to_meta()`` and ``from_meta(meta, limits)``; :data:`REQUESTS` and
:data:`REPLIES` map opcodes to them); this module encodes and decodes whole
frames and re-exports everything, so callers import ``kvfabric.protocol``
only. The C data plane mirrors the header in ``csrc/kvf_protocol.h``; a test
checks the two agree.
"""

from __future__ import annotations

from typing import Any

from ..errors import ErrorCode, ProtocolError, RemoteError
from . import auth
from .auth import NONCE_BYTES, PROOF_BYTES, check_token, client_proof, new_nonce, proof_ok, server_proof
from .messages import (
    REPLIES,
    REQUESTS,
    AuthReply,
    AuthRequest,
    DeleteReply,
    DeleteRequest,
    ErrorReply,
    ExistsReply,
    ExistsRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    KeysMessage,
    LookupReply,
    LookupRequest,
    Message,
    PingReply,
    PingRequest,
    PutReply,
    PutRequest,
    RetireReply,
    RetireRequest,
    ShmAttachReply,
    ShmAttachRequest,
    ShmCommitReply,
    ShmCommitRequest,
    ShmLeaseReply,
    ShmLeaseRequest,
    ShmReleaseRequest,
    ShmReserveReply,
    ShmReserveRequest,
    StatsReply,
    StatsRequest,
)
from .stats import SHARED_STATS_FIELDS, SSD_STATS_FIELDS, STATS_FIELDS, STATS_KEYS, STATS_OPTIONAL_KEYS
from .wire import (
    DEFAULT_LIMITS,
    FLAG_ERROR,
    FLAG_REPLY,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_IN_FLIGHT,
    MAX_LEASE_MS,
    MEDIUM_DRAM,
    MEDIUM_SSD,
    NS_TAG_BYTES,
    META_FIELDS,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_BATCH,
    MAX_META_BYTES,
    MAX_OBJECT_BYTES,
    MAX_PAYLOAD_BYTES,
    PRE_AUTH_LIMITS,
    U64_MAX,
    VERSION,
    BAD_VERSION_MESSAGE,
    GiB,
    Header,
    KiB,
    Limits,
    MiB,
    Op,
    PutStatus,
    ShmOp,
    check_request_opcode,
    checksum,
    checksum_parts,
    decode_meta,
    encode_meta,
    pack_header,
    unpack_header,
)

# ----------------------------------------------------------------------------- frames


def encode_request(msg: Message, request_id: int) -> bytes:
    """Header + metadata of a request frame; the caller sends the payload after it."""
    meta = encode_meta(msg.to_meta())
    return pack_header(msg.op, request_id, len(meta), msg.payload_len()) + meta


def encode_reply(msg: Message, request_id: int) -> bytes:
    """Header + metadata of a reply frame; the payload (GET) follows separately."""
    meta = encode_meta(msg.to_meta())
    return pack_header(msg.op, request_id, len(meta), msg.payload_len(), FLAG_REPLY) + meta


def encode_error(opcode: int, request_id: int, code: ErrorCode, message: str) -> bytes:
    """A complete error reply frame (no payload). ``opcode`` echoes the request's, known or not."""
    meta = encode_meta(ErrorReply(int(code), message[:1024]).to_meta())
    return pack_header(opcode & 0xFF, request_id, len(meta), 0, FLAG_REPLY | FLAG_ERROR) + meta


def decode_request(header: Header, meta_buf: Any, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Turn a request header + metadata into a message, checking it against the payload length.

    Raises ProtocolError: UNKNOWN_OPCODE, MALFORMED, TOO_MANY_KEYS, BAD_KEY,
    or LENGTH_MISMATCH when the announced payload does not match the sizes.
    """
    if header.is_reply:
        raise ProtocolError(ErrorCode.MALFORMED, "a request must not have the REPLY flag")
    op = check_request_opcode(header)
    msg = REQUESTS[op].from_meta(decode_meta(meta_buf, limits), limits)
    if isinstance(msg, PutRequest):
        for s in msg.sizes:
            if s > limits.max_object_bytes:
                raise ProtocolError(ErrorCode.PAYLOAD_TOO_LARGE, f"object of {s} bytes exceeds {limits.max_object_bytes}")
    if msg.payload_len() != header.payload_len:
        raise ProtocolError(
            ErrorCode.LENGTH_MISMATCH,
            f"{op.name} announces {header.payload_len} payload bytes but its sizes add up to {msg.payload_len()}",
        )
    return msg


def decode_reply(header: Header, meta_buf: Any, expected: Op, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Turn a reply header + metadata into a message.

    An error reply raises :class:`RemoteError`; a reply to another opcode or a
    payload length that disagrees with the metadata raises ProtocolError.
    """
    if not header.is_reply:
        raise ProtocolError(ErrorCode.MALFORMED, "expected a reply frame")
    meta = decode_meta(meta_buf, limits)
    if header.is_error:
        err = ErrorReply.from_meta(meta)
        raise RemoteError(err.code, err.message)
    if header.opcode != expected:
        raise ProtocolError(ErrorCode.MALFORMED, f"reply opcode {header.opcode} does not answer {expected.name}")
    msg = REPLIES[expected].from_meta(meta, limits)
    if msg.payload_len() != header.payload_len:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"{expected.name} reply payload length disagrees with its sizes")
    return msg


__all__ = [
    "MAGIC", "VERSION", "BAD_VERSION_MESSAGE", "HEADER", "HEADER_SIZE", "FLAG_REPLY", "FLAG_ERROR", "Op", "ShmOp", "PutStatus",
    "Limits", "DEFAULT_LIMITS", "PRE_AUTH_LIMITS", "MAX_KEYS_PER_BATCH", "MAX_KEY_BYTES",
    "MAX_META_BYTES", "MAX_PAYLOAD_BYTES", "MAX_OBJECT_BYTES", "MAX_IN_FLIGHT", "MAX_LEASE_MS", "MEDIUM_DRAM", "MEDIUM_SSD", "META_FIELDS", "checksum",
    "checksum_parts",
    "Header", "pack_header", "unpack_header", "check_request_opcode", "encode_meta", "decode_meta",
    "Message", "HelloRequest", "HelloReply", "PingRequest", "PingReply", "ExistsRequest",
    "ExistsReply", "LookupRequest", "LookupReply", "GetRequest", "GetReply", "PutRequest",
    "PutReply", "DeleteRequest", "DeleteReply", "StatsRequest", "StatsReply", "ErrorReply",
    "REQUESTS", "REPLIES", "encode_request", "encode_reply", "encode_error", "decode_request",
    "decode_reply", "ErrorCode", "KeysMessage", "ShmAttachRequest", "ShmAttachReply", "ShmLeaseRequest",
    "ShmLeaseReply", "ShmReleaseRequest", "ShmReserveRequest", "ShmReserveReply", "ShmCommitRequest",
    "ShmCommitReply", "AuthRequest", "AuthReply", "auth", "NONCE_BYTES", "PROOF_BYTES", "new_nonce", "server_proof",
    "client_proof", "proof_ok", "check_token", "RetireRequest", "RetireReply", "NS_TAG_BYTES",
]
