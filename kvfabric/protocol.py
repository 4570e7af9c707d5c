"""THE kvfabric wire format (version 1). Nothing else packs or slices frame bytes.

A frame is a 32-byte little-endian header, ``meta_len`` bytes of msgpack
metadata (always a map), then ``payload_len`` raw payload bytes::

    offset size field
    0      4    magic        b"KVFB"
    4      2    version      1
    6      1    opcode       Op
    7      1    flags        bit0 REPLY, bit1 ERROR
    8      8    request_id   u64, echoed in the reply
    16     4    meta_len     u32
    20     8    payload_len  u64
    28     4    reserved     0

Payload bytes never pass through msgpack: a PUT request carries its objects
concatenated after the metadata, a GET reply the found objects, so both ends
can move them straight between sockets and registered memory.

Every limit in :class:`Limits` is checked on the header (before any buffer is
allocated) or on the decoded metadata (before any payload is read). Decoding
functions raise :class:`~kvfabric.errors.ProtocolError` carrying the wire
error code the server should answer with.

Message classes are plain frozen dataclasses with ``to_meta()`` and
``from_meta(meta, limits)``; :data:`REQUESTS` and :data:`REPLIES` map opcodes
to them. The C data plane mirrors the header in ``csrc/kvf_protocol.h``; a
test checks the two agree.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import xxhash

from .errors import ErrorCode, ProtocolError, RemoteError

MAGIC = b"KVFB"
VERSION = 1
HEADER = struct.Struct("<4sHBBQIQI")
HEADER_SIZE = HEADER.size  # 32
assert HEADER_SIZE == 32

FLAG_REPLY = 0x01
FLAG_ERROR = 0x02
_KNOWN_FLAGS = FLAG_REPLY | FLAG_ERROR

U64_MAX = (1 << 64) - 1

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class Op(enum.IntEnum):
    HELLO = 1
    PING = 2
    EXISTS = 3
    LOOKUP = 4
    GET = 5
    PUT = 6
    DELETE = 7
    STATS = 8


class ShmOp(enum.IntEnum):
    """Same-host control opcodes of the ``shm`` transport, valid only on the
    server's unix socket (whose name the native server's HELLO reply carries
    as ``shm_socket``). Their metadata is built and read by
    ``kvfabric.transport.shm`` and ``csrc/kvf_ops.c``; the numbers live here
    so that one module owns every opcode on the wire."""

    ATTACH = 32  # reply carries the arena memfd (SCM_RIGHTS)
    LEASE = 33  # keys -> offsets/sizes/checksums, pinned until RELEASE or disconnect
    RELEASE = 34  # drop a lease; no reply
    RESERVE = 35  # keys + sizes -> offsets of slots no index knows yet
    COMMIT = 36  # reservation + checksums -> status per key (verified by the server)


class PutStatus(enum.IntEnum):
    STORED = 0
    EXISTS = 1  # already held; keys are content addresses, so this is a no-op
    TOO_LARGE = 2  # larger than the server's object limit or its whole arena
    NO_SPACE = 3  # nothing evictable: everything is pinned
    CHECKSUM_MISMATCH = 4  # payload bytes do not match the checksum sent with them


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds every frame must respect; a server advertises its own at HELLO."""

    max_keys_per_batch: int = 4096
    max_key_bytes: int = 64
    max_meta_bytes: int = 1 * MiB
    max_payload_bytes: int = 1 * GiB
    max_object_bytes: int = 64 * MiB
    max_in_flight: int = 64

    def to_meta(self) -> dict[str, int]:
        return {
            "max_keys_per_batch": self.max_keys_per_batch,
            "max_key_bytes": self.max_key_bytes,
            "max_meta_bytes": self.max_meta_bytes,
            "max_payload_bytes": self.max_payload_bytes,
            "max_object_bytes": self.max_object_bytes,
            "max_in_flight": self.max_in_flight,
        }

    @classmethod
    def from_meta(cls, meta: Any) -> Limits:
        if not isinstance(meta, dict):
            raise ProtocolError(ErrorCode.MALFORMED, "limits must be a map")
        values = {}
        for name in cls.__dataclass_fields__:
            v = meta.get(name)
            if not _is_uint(v) or v == 0:
                raise ProtocolError(ErrorCode.MALFORMED, f"limits.{name} must be a positive int")
            values[name] = v
        return cls(**values)


DEFAULT_LIMITS = Limits()
# Before a server that requires auth has seen a valid HELLO, a peer may send
# only a small HELLO: no keys, no payload.
PRE_AUTH_LIMITS = Limits(
    max_keys_per_batch=1,
    max_meta_bytes=4 * KiB,
    max_payload_bytes=1,
    max_object_bytes=1,
    max_in_flight=1,
)
# Convenience aliases for the defaults (documented in docs/ARCHITECTURE.md).
MAX_KEYS_PER_BATCH = DEFAULT_LIMITS.max_keys_per_batch
MAX_KEY_BYTES = DEFAULT_LIMITS.max_key_bytes
MAX_META_BYTES = DEFAULT_LIMITS.max_meta_bytes
MAX_PAYLOAD_BYTES = DEFAULT_LIMITS.max_payload_bytes
MAX_OBJECT_BYTES = DEFAULT_LIMITS.max_object_bytes
MAX_IN_FLIGHT = DEFAULT_LIMITS.max_in_flight


def checksum(data: Any) -> int:
    """The object checksum carried on the wire and stored with each object: xxh3_64."""
    return xxhash.xxh3_64_intdigest(data)


# ----------------------------------------------------------------------------- header


@dataclass(frozen=True, slots=True)
class Header:
    opcode: int
    flags: int
    request_id: int
    meta_len: int
    payload_len: int

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)

    def pack(self) -> bytes:
        return pack_header(self.opcode, self.request_id, self.meta_len, self.payload_len, self.flags)


def pack_header(opcode: int, request_id: int, meta_len: int, payload_len: int, flags: int = 0) -> bytes:
    """The 32 header bytes. Raises ``ValueError`` for out-of-range fields."""
    if not 0 <= request_id <= U64_MAX:
        raise ValueError(f"request_id out of range: {request_id}")
    return HEADER.pack(MAGIC, VERSION, opcode, flags, request_id, meta_len, payload_len, 0)


def unpack_header(buf: Any, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and check a header; ``buf`` holds at least HEADER_SIZE bytes.

    Raises ProtocolError with BAD_MAGIC, BAD_VERSION, MALFORMED (flags or the
    reserved field), META_TOO_LARGE or PAYLOAD_TOO_LARGE. The opcode is not
    checked here (a reply to an unknown opcode must echo the request id);
    see :func:`check_request_opcode`.
    """
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"header needs {HEADER_SIZE} bytes, got {len(buf)}")
    magic, version, opcode, flags, request_id, meta_len, payload_len, reserved = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"unsupported protocol version {version} (this side speaks {VERSION})")
    if flags & ~_KNOWN_FLAGS or reserved != 0:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown flags {flags:#x} or nonzero reserved field")
    if meta_len > limits.max_meta_bytes:
        raise ProtocolError(ErrorCode.META_TOO_LARGE, f"metadata of {meta_len} bytes exceeds {limits.max_meta_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise ProtocolError(ErrorCode.PAYLOAD_TOO_LARGE, f"payload of {payload_len} bytes exceeds {limits.max_payload_bytes}")
    return Header(opcode, flags, request_id, meta_len, payload_len)


def check_request_opcode(header: Header) -> Op:
    try:
        return Op(header.opcode)
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_OPCODE, f"unknown opcode {header.opcode}") from None


# ----------------------------------------------------------------------------- metadata


def encode_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def decode_meta(buf: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode a metadata section; raises ProtocolError(MALFORMED) unless it is one msgpack map.

    Container and string sizes are capped inside the decoder by the metadata
    size (every element takes at least one byte), so a hostile length prefix
    cannot make it allocate; the per-message checks then apply the key limits.
    """
    n = limits.max_meta_bytes
    try:
        meta = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_meta_bytes,
            max_str_len=limits.max_meta_bytes,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(ErrorCode.MALFORMED, f"metadata is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "metadata must be a map")
    return meta


def _is_uint(v: Any) -> bool:
    return type(v) is int and v >= 0


def _field(meta: dict, name: str, kind: type, *, default: Any = ..., ) -> Any:
    v = meta.get(name, default)
    if v is ...:
        raise ProtocolError(ErrorCode.MALFORMED, f"missing field {name!r}")
    if kind is int:
        ok = type(v) is int
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be {kind.__name__}")
    return v


def _keys(meta: dict, limits: Limits, name: str = "keys") -> list[bytes]:
    keys = _field(meta, name, list)
    if len(keys) > limits.max_keys_per_batch:
        raise ProtocolError(ErrorCode.TOO_MANY_KEYS, f"{len(keys)} keys exceed {limits.max_keys_per_batch}")
    for k in keys:
        if type(k) is not bytes or not 1 <= len(k) <= limits.max_key_bytes:
            raise ProtocolError(ErrorCode.BAD_KEY, f"keys must be 1..{limits.max_key_bytes} bytes")
    return keys


def _uint_list(meta: dict, name: str, n: int, *, allow_minus_one: bool = False, maximum: int = U64_MAX) -> list[int]:
    values = _field(meta, name, list)
    if len(values) != n:
        raise ProtocolError(ErrorCode.MALFORMED, f"{name!r} has {len(values)} entries for {n} keys")
    for v in values:
        if type(v) is not int or v > maximum or (v < 0 and not (allow_minus_one and v == -1)):
            raise ProtocolError(ErrorCode.MALFORMED, f"bad value in {name!r}: {v!r}")
    return values


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Message:
    op: ClassVar[Op]

    def to_meta(self) -> dict[str, Any]:
        return {}

    def payload_len(self) -> int:
        return 0

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS):  # pragma: no cover - overridden
        return cls()


@dataclass(frozen=True, slots=True)
class HelloRequest(Message):
    op: ClassVar[Op] = Op.HELLO
    client: str = "kvfabric"
    transports: tuple[str, ...] = ("tcp",)
    auth: str | None = None
    version: int = VERSION

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"version": self.version, "client": self.client, "transports": list(self.transports)}
        if self.auth is not None:
            m["auth"] = self.auth
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HelloRequest:
        version = _field(meta, "version", int)
        transports = _field(meta, "transports", list, default=[])
        if not all(isinstance(t, str) for t in transports):
            raise ProtocolError(ErrorCode.MALFORMED, "transports must be strings")
        auth = meta.get("auth")
        if auth is not None and not isinstance(auth, str):
            raise ProtocolError(ErrorCode.MALFORMED, "auth must be a string")
        return cls(client=_field(meta, "client", str, default=""), transports=tuple(transports), auth=auth, version=version)


@dataclass(frozen=True, slots=True)
class HelloReply(Message):
    op: ClassVar[Op] = Op.HELLO
    server: str
    server_id: str
    transports: tuple[str, ...]
    limits: Limits
    capacity: int
    version: int = VERSION

    def to_meta(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "server": self.server,
            "server_id": self.server_id,
            "transports": list(self.transports),
            "limits": self.limits.to_meta(),
            "capacity": self.capacity,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HelloReply:
        transports = _field(meta, "transports", list)
        if not all(isinstance(t, str) for t in transports):
            raise ProtocolError(ErrorCode.MALFORMED, "transports must be strings")
        capacity = _field(meta, "capacity", int)
        if capacity < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "capacity must be >= 0")
        return cls(
            server=_field(meta, "server", str),
            server_id=_field(meta, "server_id", str),
            transports=tuple(transports),
            limits=Limits.from_meta(_field(meta, "limits", dict)),
            capacity=capacity,
            version=_field(meta, "version", int),
        )


@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    op: ClassVar[Op] = Op.PING


@dataclass(frozen=True, slots=True)
class PingReply(Message):
    op: ClassVar[Op] = Op.PING


@dataclass(frozen=True, slots=True)
class KeysMessage(Message):
    """Base for requests that carry only a key list."""

    keys: Sequence[bytes] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"keys": list(self.keys)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS):
        return cls(keys=_keys(meta, limits))


@dataclass(frozen=True, slots=True)
class ExistsRequest(KeysMessage):
    op: ClassVar[Op] = Op.EXISTS


@dataclass(frozen=True, slots=True)
class ExistsReply(Message):
    op: ClassVar[Op] = Op.EXISTS
    present: Sequence[bool] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"present": [bool(p) for p in self.present]}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ExistsReply:
        present = _field(meta, "present", list)
        if not all(type(p) is bool for p in present):
            raise ProtocolError(ErrorCode.MALFORMED, "present must be booleans")
        return cls(present=present)


@dataclass(frozen=True, slots=True)
class LookupRequest(Message):
    """How many leading keys of ``keys`` does this server hold?

    ``lease_ms`` > 0 pins the found objects against eviction for that long.
    """

    op: ClassVar[Op] = Op.LOOKUP
    keys: Sequence[bytes] = ()
    lease_ms: int = 0

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"keys": list(self.keys)}
        if self.lease_ms:
            m["lease_ms"] = self.lease_ms
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> LookupRequest:
        lease_ms = _field(meta, "lease_ms", int, default=0)
        if not 0 <= lease_ms <= 3_600_000:
            raise ProtocolError(ErrorCode.MALFORMED, "lease_ms must be in 0..3600000")
        return cls(keys=_keys(meta, limits), lease_ms=lease_ms)


@dataclass(frozen=True, slots=True)
class LookupReply(Message):
    op: ClassVar[Op] = Op.LOOKUP
    count: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {"count": self.count}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> LookupReply:
        count = _field(meta, "count", int)
        if count < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "count must be >= 0")
        return cls(count=count)


@dataclass(frozen=True, slots=True)
class GetRequest(KeysMessage):
    op: ClassVar[Op] = Op.GET


@dataclass(frozen=True, slots=True)
class GetReply(Message):
    """``sizes[i]`` is -1 for a miss; found objects follow in key order as payload."""

    op: ClassVar[Op] = Op.GET
    sizes: Sequence[int] = ()
    checksums: Sequence[int] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "checksums": list(self.checksums)}

    def payload_len(self) -> int:
        return sum(s for s in self.sizes if s > 0)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> GetReply:
        sizes = _field(meta, "sizes", list)
        if len(sizes) > limits.max_keys_per_batch:
            raise ProtocolError(ErrorCode.TOO_MANY_KEYS, "too many sizes")
        sizes = _uint_list(meta, "sizes", len(sizes), allow_minus_one=True, maximum=limits.max_object_bytes)
        checksums = _uint_list(meta, "checksums", len(sizes))
        return cls(sizes=sizes, checksums=checksums)


@dataclass(frozen=True, slots=True)
class PutRequest(Message):
    """Objects ``keys[i]`` of ``sizes[i]`` bytes follow, concatenated, as payload.

    ``parents[i]`` (optional) is the key of the previous block of the same
    prompt, so prefix-aware eviction can keep a chain's head before its tail.
    """

    op: ClassVar[Op] = Op.PUT
    keys: Sequence[bytes] = ()
    sizes: Sequence[int] = ()
    checksums: Sequence[int] = ()
    parents: Sequence[bytes | None] | None = None

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"keys": list(self.keys), "sizes": list(self.sizes), "checksums": list(self.checksums)}
        if self.parents is not None:
            m["parents"] = list(self.parents)
        return m

    def payload_len(self) -> int:
        return sum(self.sizes)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> PutRequest:
        keys = _keys(meta, limits)
        sizes = _uint_list(meta, "sizes", len(keys), maximum=U64_MAX)
        checksums = _uint_list(meta, "checksums", len(keys))
        parents = meta.get("parents")
        if parents is not None:
            if not isinstance(parents, list) or len(parents) != len(keys):
                raise ProtocolError(ErrorCode.MALFORMED, "parents must be a list as long as keys")
            for p in parents:
                if p is not None and (type(p) is not bytes or not 1 <= len(p) <= limits.max_key_bytes):
                    raise ProtocolError(ErrorCode.BAD_KEY, "parents must be keys or nil")
        return cls(keys=keys, sizes=sizes, checksums=checksums, parents=parents)


@dataclass(frozen=True, slots=True)
class PutReply(Message):
    op: ClassVar[Op] = Op.PUT
    status: Sequence[int] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"status": [int(s) for s in self.status]}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> PutReply:
        status = _field(meta, "status", list)
        if not all(type(s) is int and s in PutStatus._value2member_map_ for s in status):
            raise ProtocolError(ErrorCode.MALFORMED, "unknown put status")
        return cls(status=status)


@dataclass(frozen=True, slots=True)
class DeleteRequest(KeysMessage):
    op: ClassVar[Op] = Op.DELETE


@dataclass(frozen=True, slots=True)
class DeleteReply(Message):
    op: ClassVar[Op] = Op.DELETE
    deleted: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {"deleted": self.deleted}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> DeleteReply:
        deleted = _field(meta, "deleted", int)
        if deleted < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "deleted must be >= 0")
        return cls(deleted=deleted)


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    op: ClassVar[Op] = Op.STATS


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    op: ClassVar[Op] = Op.STATS
    stats: dict[str, Any] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return dict(self.stats)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> StatsReply:
        return cls(stats=meta)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    code: int
    message: str

    def to_meta(self) -> dict[str, Any]:
        return {"code": int(self.code), "message": self.message}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ErrorReply:
        return cls(code=_field(meta, "code", int), message=_field(meta, "message", str, default=""))


REQUESTS: dict[Op, type[Message]] = {
    Op.HELLO: HelloRequest,
    Op.PING: PingRequest,
    Op.EXISTS: ExistsRequest,
    Op.LOOKUP: LookupRequest,
    Op.GET: GetRequest,
    Op.PUT: PutRequest,
    Op.DELETE: DeleteRequest,
    Op.STATS: StatsRequest,
}
REPLIES: dict[Op, type[Message]] = {
    Op.HELLO: HelloReply,
    Op.PING: PingReply,
    Op.EXISTS: ExistsReply,
    Op.LOOKUP: LookupReply,
    Op.GET: GetReply,
    Op.PUT: PutReply,
    Op.DELETE: DeleteReply,
    Op.STATS: StatsReply,
}


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
    "MAGIC", "VERSION", "HEADER", "HEADER_SIZE", "FLAG_REPLY", "FLAG_ERROR", "Op", "ShmOp", "PutStatus",
    "Limits", "DEFAULT_LIMITS", "PRE_AUTH_LIMITS", "MAX_KEYS_PER_BATCH", "MAX_KEY_BYTES",
    "MAX_META_BYTES", "MAX_PAYLOAD_BYTES", "MAX_OBJECT_BYTES", "MAX_IN_FLIGHT", "checksum",
    "Header", "pack_header", "unpack_header", "check_request_opcode", "encode_meta", "decode_meta",
    "Message", "HelloRequest", "HelloReply", "PingRequest", "PingReply", "ExistsRequest",
    "ExistsReply", "LookupRequest", "LookupReply", "GetRequest", "GetReply", "PutRequest",
    "PutReply", "DeleteRequest", "DeleteReply", "StatsRequest", "StatsReply", "ErrorReply",
    "REQUESTS", "REPLIES", "encode_request", "encode_reply", "encode_error", "decode_request",
    "decode_reply",
]
