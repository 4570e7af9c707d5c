"""Wire primitives: the 32-byte header, opcodes, limits, checksums and metadata decoding.

Part of :mod:`kvfabric.protocol` (the package docstring describes the frame);
message classes are in :mod:`kvfabric.protocol.messages`.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from ..errors import ErrorCode, ProtocolError

MAGIC = b"KVFB"
# Version 3: HELLO proves both sides hold the pool token (challenge-response
# over fresh nonces, :mod:`.auth`; the token never crosses the wire). Object
# checksums bind keys as since version 2 (see :func:`checksum`). A peer speaks
# exactly one version; there is no fallback (the header and the HELLO both
# carry it, and either mismatch is BAD_VERSION).
VERSION = 3
BAD_VERSION_MESSAGE = f"this server speaks protocol {VERSION}: HELLO proves both sides hold the pool token"
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
    AUTH = 9  # the client's proof over the server's HELLO nonce (protocol 3, :mod:`.auth`)
    RETIRE = 10  # drop every object of a namespace tag, on every tier, at once (issue 27; an epoch, not a scan)


class ShmOp(enum.IntEnum):
    """Same-host control opcodes of the ``shm`` transport, valid only on the
    server's unix socket (whose path the native server's HELLO reply carries
    as ``shm_socket``). Their typed messages are ``Shm*Request``/``Shm*Reply``
    in :mod:`kvfabric.protocol.messages`; the server side is csrc/kvf_shm.c.
    The numbers live here so that one module owns every opcode on the wire."""

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
#: Cap on a LOOKUP (or shm) lease, ms: an hour. A lease pins arena space against eviction, so no
#: client may hold space longer than this however it asks; one that needs a block longer looks it
#: up again. The one constant: the client, the decoder, both servers' option checks and the
#: connectors' configs use it (csrc/kvf_protocol.h mirrors it as KVF_MAX_LEASE_MS).
MAX_LEASE_MS = 3_600_000
#: LOOKUP with ``media``: the medium of each counted key, one byte each (csrc/kvf_protocol.h KVF_MEDIUM_*).
MEDIUM_DRAM = 0
MEDIUM_SSD = 1
#: A namespace tag (PUT ``ns``, RETIRE ``ns``) is exactly this many bytes: a digest of the namespace
#: (:func:`kvfabric.keys.namespace_tag`), never the namespace itself.
NS_TAG_BYTES = 16
#: Every metadata field name a request or reply carries (STATS keys are :mod:`.stats`'s).
#: The one list of them: the messages here spell each as written, and the C data plane mirrors
#: those it reads or writes as ``KVF_F_<NAME>`` in csrc/kvf_protocol.h. tests/unit/test_meta_fields.py
#: checks both sides against it, and that no C file names a field with a bare string.
META_FIELDS: frozenset[str] = frozenset((
    # HELLO and its reply, AUTH (protocol 3: nonces and proofs, :mod:`.auth`)
    "version", "client", "transports", "nonce", "server", "server_id", "limits", "capacity", "shm_socket",
    "auth_required", "proof",
    # Limits (inside "limits")
    "max_keys_per_batch", "max_key_bytes", "max_meta_bytes", "max_payload_bytes", "max_object_bytes",
    "max_in_flight",
    # requests and replies
    "keys", "present", "lease_ms", "count", "media", "client_verifies", "sizes", "checksums", "parents", "status",
    "deleted", "code", "message",
    # PUT / SHM_RESERVE groups (issue 23): a chunk's parts admitted, evicted and tiered as one unit
    "groups", "group_parts",
    # PUT's namespace tag and RETIRE (issue 27): a namespace retired pool-wide by a generation bump
    "ns", "generation",
    # shm arena ops
    "lease", "offsets", "res",
    # SHM_ATTACH on a nixl (remote) connection: the NIXL agent that registered the arena, and where
    "nixl_agent", "arena_base",
))
# Before a server that requires auth has seen a valid AUTH, a peer may send
# only small HELLO and AUTH frames: no keys, no payload.
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


def checksum(key: bytes, value: Any) -> int:
    """The object checksum carried on the wire and stored with each object (protocol 2).

    ``xxh3_64(value, seed=xxh3_64(key))``: it binds the key to the bytes, so
    a value checksummed under one key does not verify under another (a key
    altered on the wire, or a client sending one key's bytes and checksum
    under another key, is refused with ``CHECKSUM_MISMATCH``). It is an
    integrity check, not authentication: anyone can compute it for bytes of
    their choosing. ``value`` is any contiguous buffer. The C data plane computes the same (``kvf_obj_hash`` in
    csrc/kvf_hash.c); a test pins them together.
    """
    return _xxh3_64(value, _xxh3_64(key))  # the second argument is the seed


_xxh3_64 = xxhash.xxh3_64_intdigest


def checksum_parts(key: bytes, parts: Any) -> int:
    """:func:`checksum` of the concatenation of the buffers ``parts`` (an object received
    scattered over several buffers), without joining them."""
    h = xxhash.xxh3_64(seed=_xxh3_64(key))
    for p in parts:
        h.update(p)
    return h.intdigest()


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
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"peer speaks protocol {version}, this side protocol {VERSION} "
            "(since protocol 3 HELLO proves both sides hold the pool token)",
        )
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


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("a map holds the same key twice")
    return d


def decode_meta(buf: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode a metadata section; raises ProtocolError(MALFORMED) unless it is exactly one msgpack map.

    MALFORMED too: truncated bytes, any byte after the map, a map (at any
    depth) that holds the same key twice, a map key that is not str or bytes, a str that is not UTF-8.
    The C data plane applies the same rule (csrc/kvf_mpack.c kvf_mr_check_meta).
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
            object_pairs_hook=_unique_map,
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
