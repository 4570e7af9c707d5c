"""Typed protocol messages: one frozen dataclass per request and reply.

Each has ``to_meta()`` (the msgpack map it sends) and ``from_meta(meta,
limits)`` (validation of a received map: types, key sizes and counts; raises
:class:`~kvfabric.errors.ProtocolError` with the wire code). :data:`REQUESTS`
and :data:`REPLIES` map opcodes to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ErrorCode, ProtocolError
from .auth import NONCE_BYTES, PROOF_BYTES, new_nonce
from .wire import BAD_VERSION_MESSAGE, DEFAULT_LIMITS, MAX_LEASE_MS, MEDIUM_DRAM, MEDIUM_SSD, NS_TAG_BYTES, U64_MAX, VERSION, Limits, Op, PutStatus, ShmOp, _field, _keys, _uint_list


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


def _bin(meta: dict[str, Any], name: str, n: int, *, required: bool,
         code: ErrorCode = ErrorCode.MALFORMED) -> bytes | None:
    """Field ``name`` as exactly ``n`` bytes (bin), or None when absent and not ``required``;
    ProtocolError(``code``) otherwise."""
    v = meta.get(name)
    if v is None and not required:
        return None
    if type(v) is not bytes or len(v) != n:
        raise ProtocolError(code, f"{name} must be {n} bytes (bin)")
    return v


@dataclass(frozen=True, slots=True)
class HelloRequest(Message):
    """``nonce``: the client's fresh challenge (protocol 3, :mod:`.auth`); a new one for every HELLO."""

    op: ClassVar[Op] = Op.HELLO
    client: str = "kvfabric"
    transports: tuple[str, ...] = ("tcp",)
    nonce: bytes = field(default_factory=new_nonce)
    version: int = VERSION

    def to_meta(self) -> dict[str, Any]:
        return {"version": self.version, "client": self.client, "transports": list(self.transports),
                "nonce": self.nonce}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HelloRequest:
        version = _field(meta, "version", int)
        transports = _field(meta, "transports", list, default=[])
        if not all(isinstance(t, str) for t in transports):
            raise ProtocolError(ErrorCode.MALFORMED, "transports must be strings")
        if version != VERSION:  # before the nonce: an older peer's HELLO has none, and BAD_VERSION says why
            raise ProtocolError(ErrorCode.BAD_VERSION, BAD_VERSION_MESSAGE)
        return cls(client=_field(meta, "client", str, default=""), transports=tuple(transports),
                   nonce=_bin(meta, "nonce", NONCE_BYTES, required=True), version=version)


@dataclass(frozen=True, slots=True)
class HelloReply(Message):
    op: ClassVar[Op] = Op.HELLO
    server: str
    server_id: str
    transports: tuple[str, ...]
    limits: Limits
    capacity: int
    version: int = VERSION
    #: path of the unix socket same-host clients attach through (servers that offer ``shm``)
    shm_socket: str | None = None
    #: protocol 3 (:mod:`.auth`): whether the server has a pool token; with one, its fresh ``nonce``
    #: for this connection and its ``proof`` over both nonces and ``server_id``
    auth_required: bool = False
    nonce: bytes | None = None
    proof: bytes | None = None

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "version": self.version,
            "server": self.server,
            "server_id": self.server_id,
            "transports": list(self.transports),
            "limits": self.limits.to_meta(),
            "capacity": self.capacity,
        }
        if self.shm_socket is not None:
            m["shm_socket"] = self.shm_socket
        m["auth_required"] = self.auth_required
        if self.nonce is not None:
            m["nonce"] = self.nonce
        if self.proof is not None:
            m["proof"] = self.proof
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HelloReply:
        transports = _field(meta, "transports", list)
        if not all(isinstance(t, str) for t in transports):
            raise ProtocolError(ErrorCode.MALFORMED, "transports must be strings")
        capacity = _field(meta, "capacity", int)
        if capacity < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "capacity must be >= 0")
        shm_socket = meta.get("shm_socket")
        if shm_socket is not None and (not isinstance(shm_socket, str) or not shm_socket):
            raise ProtocolError(ErrorCode.MALFORMED, "shm_socket must be a non-empty string")
        return cls(
            server=_field(meta, "server", str),
            server_id=_field(meta, "server_id", str),
            transports=tuple(transports),
            limits=Limits.from_meta(_field(meta, "limits", dict)),
            capacity=capacity,
            version=_field(meta, "version", int),
            shm_socket=shm_socket,
            auth_required=_field(meta, "auth_required", bool, default=False),
            nonce=_bin(meta, "nonce", NONCE_BYTES, required=False),
            proof=_bin(meta, "proof", PROOF_BYTES, required=False),
        )


@dataclass(frozen=True, slots=True)
class AuthRequest(Message):
    """The client's proof over the server's HELLO nonce (protocol 3, :mod:`.auth`)."""

    op: ClassVar[Op] = Op.AUTH
    proof: bytes = b""

    def to_meta(self) -> dict[str, Any]:
        return {"proof": self.proof}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> AuthRequest:
        # a missing or malformed proof is a failed proof, answered as one (AUTH_FAILED, then closed)
        return cls(proof=_bin(meta, "proof", PROOF_BYTES, required=True, code=ErrorCode.AUTH_FAILED))


@dataclass(frozen=True, slots=True)
class AuthReply(Message):
    op: ClassVar[Op] = Op.AUTH


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

    ``media``: the reply says where each counted key is (:attr:`LookupReply.media`) and the
    server reads nothing from a tier for it: a key only on its SSD tier counts from the tier's
    index (up to one request's promotion cap, as many as one GET could serve), without a lease
    and without being promoted to DRAM (without ``media`` such keys are
    read back and promoted before the reply: a prefetch for the GET that follows). A caller that
    weighs a load against recomputing asks this way, then GETs what it chose to load (the SSD
    objects then stream from the disk). The shared tier is not consulted with ``media``: a key
    only there ends the run.
    """

    op: ClassVar[Op] = Op.LOOKUP
    keys: Sequence[bytes] = ()
    lease_ms: int = 0
    media: bool = False

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"keys": list(self.keys)}
        if self.lease_ms:
            m["lease_ms"] = self.lease_ms
        if self.media:
            m["media"] = True
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> LookupRequest:
        lease_ms = _field(meta, "lease_ms", int, default=0)
        if not 0 <= lease_ms <= MAX_LEASE_MS:
            raise ProtocolError(ErrorCode.MALFORMED, f"lease_ms must be in 0..{MAX_LEASE_MS}")
        media = _field(meta, "media", bool, default=False)
        return cls(keys=_keys(meta, limits), lease_ms=lease_ms, media=media)


@dataclass(frozen=True, slots=True)
class LookupReply(Message):
    """``count``: the leading keys held. ``media`` (only when the request asked for it): one byte
    per counted key, :data:`MEDIUM_DRAM` or :data:`MEDIUM_SSD`; None otherwise."""

    op: ClassVar[Op] = Op.LOOKUP
    count: int = 0
    media: bytes | None = None

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"count": self.count}
        if self.media is not None:
            m["media"] = bytes(self.media)
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> LookupReply:
        count = _field(meta, "count", int)
        if count < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "count must be >= 0")
        media = _field(meta, "media", bytes) if "media" in meta else None
        if media is not None and (len(media) != count or any(b not in (MEDIUM_DRAM, MEDIUM_SSD) for b in media)):
            raise ProtocolError(ErrorCode.MALFORMED, "media must be one known medium byte per counted key")
        return cls(count=count, media=media)


@dataclass(frozen=True, slots=True)
class GetRequest(Message):
    """The objects stored under ``keys``.

    ``client_verifies``: the client checks every object it receives against
    the reply's checksum itself, so the server may send the objects without
    checking them first (one pass over the bytes fewer on the server). A
    client that then finds a mismatch asks for those keys again without the
    flag: the server checks them, drops a corrupt object and answers a miss.
    """

    op: ClassVar[Op] = Op.GET
    keys: Sequence[bytes] = ()
    client_verifies: bool = False

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"keys": list(self.keys)}
        if self.client_verifies:
            m["client_verifies"] = True
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> GetRequest:
        return cls(keys=_keys(meta, limits), client_verifies=_field(meta, "client_verifies", bool, default=False))


@dataclass(frozen=True, slots=True)
class GetReply(Message):
    """``sizes[i]`` is -1 for a miss; found objects follow in key order as payload.

    ``checksums[i]`` is ``checksum(keys[i], object)`` (0 for a miss): it
    verifies only under the key the request asked for.
    """

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

    ``checksums[i]`` is ``checksum(keys[i], object)``: the server refuses an
    object whose checksum does not match its key and bytes (``CHECKSUM_MISMATCH``).

    ``parents[i]`` (optional) is the key of the previous block of the same
    prompt, so prefix-aware eviction can keep a chain's head before its tail.

    ``groups[i]`` / ``group_parts[i]`` (optional, together or not at all): the
    group (placement) key of ``keys[i]`` and how many parts its group has. The
    server admits, evicts, leases, deletes and tiers a group as one unit; a
    frame carries every part of each group it names, consecutively (see
    :func:`_groups`), and every part of a refused group gets the same status.

    ``ns`` (optional, issue 27): the namespace tag (:data:`NS_TAG_BYTES` bytes) of
    every object of the frame; :class:`RetireRequest` of that tag drops them all.
    Absent or nil: untagged (never retired).
    """

    op: ClassVar[Op] = Op.PUT
    keys: Sequence[bytes] = ()
    sizes: Sequence[int] = ()
    checksums: Sequence[int] = ()
    parents: Sequence[bytes | None] | None = None
    groups: Sequence[bytes] | None = None
    group_parts: Sequence[int] | None = None
    ns: bytes | None = None

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"keys": list(self.keys), "sizes": list(self.sizes), "checksums": list(self.checksums)}
        if self.parents is not None:
            m["parents"] = list(self.parents)
        if self.groups is not None:
            m["groups"] = list(self.groups)
            m["group_parts"] = list(self.group_parts if self.group_parts is not None else ())
        if self.ns is not None:
            m["ns"] = self.ns
        return m

    def payload_len(self) -> int:
        return sum(self.sizes)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> PutRequest:
        keys = _keys(meta, limits)
        sizes = _uint_list(meta, "sizes", len(keys), maximum=U64_MAX)
        checksums = _uint_list(meta, "checksums", len(keys))
        parents = _parents(meta, len(keys), limits)  # before groups, as the C data plane checks them
        groups, group_parts = _groups(meta, len(keys), limits)
        ns = _bin(meta, "ns", NS_TAG_BYTES, required=False)  # after groups, as the C data plane checks it
        return cls(keys=keys, sizes=sizes, checksums=checksums, parents=parents, groups=groups,
                   group_parts=group_parts, ns=ns)


def _groups(meta: dict[str, Any], n: int, limits: Limits) -> tuple[list[bytes] | None, list[int] | None]:
    """The optional ``groups`` and ``group_parts`` fields of PUT and SHM_RESERVE (issue 23).

    Both nil/absent (no groups), or both lists as long as keys (MALFORMED otherwise):
    ``groups[i]`` a key (1..max_key_bytes bytes, BAD_KEY otherwise), ``group_parts[i]``
    in 1..max_keys_per_batch. The parts of one group are consecutive, their number is
    the run's length and every part states it, and no group key names two runs:
    a frame carries every part of each group it names (MALFORMED otherwise). Every
    check is on the decoded lists' lengths and values before anything is built.
    """
    groups, parts = meta.get("groups"), meta.get("group_parts")
    if groups is None and parts is None:
        return None, None
    if not isinstance(groups, list) or not isinstance(parts, list) or len(groups) != n or len(parts) != n:
        raise ProtocolError(ErrorCode.MALFORMED, "groups and group_parts must both be lists as long as keys")
    for g in groups:
        if type(g) is not bytes or not 1 <= len(g) <= limits.max_key_bytes:
            raise ProtocolError(ErrorCode.BAD_KEY, f"groups must be keys of 1..{limits.max_key_bytes} bytes")
    parts = _uint_list(meta, "group_parts", n, maximum=limits.max_keys_per_batch)
    seen: set[bytes] = set()
    i = 0
    while i < n:
        g, want = groups[i], parts[i]
        j = i
        while j < n and groups[j] == g:
            if parts[j] != want:
                raise ProtocolError(ErrorCode.MALFORMED, "every part of a group must state the same group_parts")
            j += 1
        if want != j - i or g in seen:
            raise ProtocolError(ErrorCode.MALFORMED,
                                "a frame must carry every part of each group it names, consecutively "
                                f"(a run of {j - i} parts states group_parts {want})")
        seen.add(g)
        i = j
    return groups, parts


def _parents(meta: dict[str, Any], n: int, limits: Limits) -> list[bytes | None] | None:
    """The optional ``parents`` field of PUT and SHM_RESERVE: nil, or a list of n keys-or-nil."""
    parents = meta.get("parents")
    if parents is not None:
        if not isinstance(parents, list) or len(parents) != n:
            raise ProtocolError(ErrorCode.MALFORMED, "parents must be a list as long as keys")
        for p in parents:
            if p is not None and (type(p) is not bytes or not 1 <= len(p) <= limits.max_key_bytes):
                raise ProtocolError(ErrorCode.BAD_KEY, "parents must be keys or nil")
    return parents


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
class RetireRequest(Message):
    """Retire the namespace tag ``ns`` (issue 27): every object a PUT stored under it before
    this request, on every tier of the server, is a miss from the reply on (a generation bump
    per tag, O(1); the objects are freed lazily). Idempotent in effect: a second RETIRE of the
    same tag bumps the generation again and drops only what was stored in between.
    ``ns`` not :data:`NS_TAG_BYTES` bytes: MALFORMED. A server whose tag table is full
    answers BUSY and retires nothing."""

    op: ClassVar[Op] = Op.RETIRE
    ns: bytes = b""

    def to_meta(self) -> dict[str, Any]:
        return {"ns": self.ns}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> RetireRequest:
        return cls(ns=_bin(meta, "ns", NS_TAG_BYTES, required=True))


@dataclass(frozen=True, slots=True)
class RetireReply(Message):
    """``generation``: the tag's generation now (objects of older ones are retired)."""

    op: ClassVar[Op] = Op.RETIRE
    generation: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {"generation": self.generation}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> RetireReply:
        g = _field(meta, "generation", int)
        if not 0 < g <= U64_MAX:
            raise ProtocolError(ErrorCode.MALFORMED, "generation must be a positive integer")
        return cls(generation=g)


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


# ----------------------------------------------------------------------------- same-host (shm)
#
# Valid only on the server's unix socket (HelloReply.shm_socket); see
# kvfabric/transport/shm.py for the conversation and csrc/kvf_shm.c for the
# server side. Field order in to_meta() is the order the C server writes.


@dataclass(frozen=True, slots=True)
class ShmAttachRequest(Message):
    """Ask for the arena; the reply carries its memfd (SCM_RIGHTS)."""

    op: ClassVar[ShmOp] = ShmOp.ATTACH


@dataclass(frozen=True, slots=True)
class ShmAttachReply(Message):
    """On the unix socket the frame carries the memfd; on a nixl connection (a TCP connection whose
    HELLO listed ``nixl``, kvfabric/transport/nixl.py) ``nixl_agent`` is the metadata of the NIXL agent
    that registered the arena and ``arena_base`` the address it is registered at (offset 0)."""

    op: ClassVar[ShmOp] = ShmOp.ATTACH
    capacity: int = 0
    nixl_agent: bytes | None = None
    arena_base: int | None = None

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"capacity": self.capacity}
        if self.nixl_agent is not None:
            m["nixl_agent"] = self.nixl_agent
            m["arena_base"] = self.arena_base
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ShmAttachReply:
        capacity = _field(meta, "capacity", int)
        if capacity <= 0:
            raise ProtocolError(ErrorCode.MALFORMED, "capacity must be > 0")
        agent = meta.get("nixl_agent")
        if agent is None:
            return cls(capacity=capacity)
        base = meta.get("arena_base")
        if not isinstance(agent, bytes) or not agent or not isinstance(base, int) or isinstance(base, bool) \
                or not 0 < base < 1 << 64:
            raise ProtocolError(ErrorCode.MALFORMED, "nixl_agent must be non-empty bytes and arena_base an address")
        return cls(capacity=capacity, nixl_agent=agent, arena_base=base)


@dataclass(frozen=True, slots=True)
class ShmLeaseRequest(KeysMessage):
    """Pin the found objects and say where they are (the shm GET)."""

    op: ClassVar[ShmOp] = ShmOp.LEASE


@dataclass(frozen=True, slots=True)
class ShmLeaseReply(Message):
    """``offsets[i]``/``sizes[i]`` are -1 for a miss. Pinned until RELEASE, disconnect or the
    server's lease cap (``--max-lease-ms``)."""

    op: ClassVar[ShmOp] = ShmOp.LEASE
    lease: int = 0
    offsets: Sequence[int] = ()
    sizes: Sequence[int] = ()
    checksums: Sequence[int] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"lease": self.lease, "offsets": list(self.offsets), "sizes": list(self.sizes),
                "checksums": list(self.checksums)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ShmLeaseReply:
        lease = _field(meta, "lease", int)
        offsets = _field(meta, "offsets", list)
        if len(offsets) > limits.max_keys_per_batch or lease < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "bad lease reply")
        n = len(offsets)
        return cls(lease=lease, offsets=_uint_list(meta, "offsets", n, allow_minus_one=True),
                   sizes=_uint_list(meta, "sizes", n, allow_minus_one=True, maximum=limits.max_object_bytes),
                   checksums=_uint_list(meta, "checksums", n))


@dataclass(frozen=True, slots=True)
class ShmReleaseRequest(Message):
    """Drop a lease. The server sends no reply."""

    op: ClassVar[ShmOp] = ShmOp.RELEASE
    lease: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {"lease": self.lease}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ShmReleaseRequest:
        lease = _field(meta, "lease", int)
        if lease < 0:
            raise ProtocolError(ErrorCode.MALFORMED, "lease must be >= 0")
        return cls(lease=lease)


@dataclass(frozen=True, slots=True)
class ShmReserveRequest(Message):
    """Reserve slots for objects the client then copies into the arena (the shm PUT, step 1).

    ``parents``, ``groups`` and ``group_parts`` as in :class:`PutRequest`; the server keeps
    them until COMMIT and hands them to the eviction policy with the INSERT.
    """

    op: ClassVar[ShmOp] = ShmOp.RESERVE
    keys: Sequence[bytes] = ()
    sizes: Sequence[int] = ()
    parents: Sequence[bytes | None] | None = None
    groups: Sequence[bytes] | None = None
    group_parts: Sequence[int] | None = None

    def to_meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"keys": list(self.keys), "sizes": list(self.sizes)}
        if self.parents is not None:
            m["parents"] = list(self.parents)
        if self.groups is not None:
            m["groups"] = list(self.groups)
            m["group_parts"] = list(self.group_parts if self.group_parts is not None else ())
        return m

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ShmReserveRequest:
        keys = _keys(meta, limits)
        sizes = _uint_list(meta, "sizes", len(keys), maximum=U64_MAX)
        parents = _parents(meta, len(keys), limits)
        groups, group_parts = _groups(meta, len(keys), limits)
        return cls(keys=keys, sizes=sizes, parents=parents, groups=groups, group_parts=group_parts)


@dataclass(frozen=True, slots=True)
class ShmReserveReply(Message):
    """``res`` names the reservation; ``offsets[i]`` is -1 where ``status[i]`` is not STORED
    (already held, too large, no space)."""

    op: ClassVar[ShmOp] = ShmOp.RESERVE
    res: int = 0
    offsets: Sequence[int] = ()
    status: Sequence[int] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"res": self.res, "offsets": list(self.offsets), "status": [int(s) for s in self.status]}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ShmReserveReply:
        res = _field(meta, "res", int)
        offsets = _field(meta, "offsets", list)
        if res < 0 or len(offsets) > limits.max_keys_per_batch:
            raise ProtocolError(ErrorCode.MALFORMED, "bad reserve reply")
        status = PutReply.from_meta(meta, limits).status
        if len(status) != len(offsets):
            raise ProtocolError(ErrorCode.MALFORMED, "offsets and status differ in length")
        return cls(res=res, offsets=_uint_list(meta, "offsets", len(offsets), allow_minus_one=True), status=status)


@dataclass(frozen=True, slots=True)
class ShmCommitRequest(Message):
    """Index the reserved slots once each matches its checksum (the shm PUT, step 2)."""

    op: ClassVar[ShmOp] = ShmOp.COMMIT
    res: int = 0
    checksums: Sequence[int] = ()

    def to_meta(self) -> dict[str, Any]:
        return {"res": self.res, "checksums": list(self.checksums)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ShmCommitRequest:
        res = _field(meta, "res", int)
        checksums = _field(meta, "checksums", list)
        if res < 0 or len(checksums) > limits.max_keys_per_batch:
            raise ProtocolError(ErrorCode.MALFORMED, "bad commit")
        return cls(res=res, checksums=_uint_list(meta, "checksums", len(checksums)))


@dataclass(frozen=True, slots=True)
class ShmCommitReply(PutReply):
    op: ClassVar[ShmOp] = ShmOp.COMMIT


@dataclass(frozen=True, slots=True)
class ErrorReply:
    code: int
    message: str

    def to_meta(self) -> dict[str, Any]:
        return {"code": int(self.code), "message": self.message}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ErrorReply:
        return cls(code=_field(meta, "code", int), message=_field(meta, "message", str, default=""))


#: opcode (Op or ShmOp) -> message class
REQUESTS: dict[int, type[Message]] = {
    Op.HELLO: HelloRequest,
    Op.PING: PingRequest,
    Op.EXISTS: ExistsRequest,
    Op.LOOKUP: LookupRequest,
    Op.GET: GetRequest,
    Op.PUT: PutRequest,
    Op.DELETE: DeleteRequest,
    Op.STATS: StatsRequest,
    Op.AUTH: AuthRequest,
    Op.RETIRE: RetireRequest,
    ShmOp.ATTACH: ShmAttachRequest,
    ShmOp.LEASE: ShmLeaseRequest,
    ShmOp.RELEASE: ShmReleaseRequest,
    ShmOp.RESERVE: ShmReserveRequest,
    ShmOp.COMMIT: ShmCommitRequest,
}
REPLIES: dict[int, type[Message]] = {
    Op.HELLO: HelloReply,
    Op.PING: PingReply,
    Op.EXISTS: ExistsReply,
    Op.LOOKUP: LookupReply,
    Op.GET: GetReply,
    Op.PUT: PutReply,
    Op.DELETE: DeleteReply,
    Op.STATS: StatsReply,
    Op.AUTH: AuthReply,
    Op.RETIRE: RetireReply,
    ShmOp.ATTACH: ShmAttachReply,
    ShmOp.LEASE: ShmLeaseReply,
    ShmOp.RESERVE: ShmReserveReply,
    ShmOp.COMMIT: ShmCommitReply,
}
