"""Request handlers: opcode -> operation on the store, independent of how bytes move.

A transport (the TCP loop in ``tcp.py``; the native and shm data planes beside
it) does the I/O and calls these in a fixed order for every frame::

    header = handlers.parse_header(session, header_bytes)   # limits checked here
    msg = handlers.decode(session, header, meta_bytes)       # before any payload
    if isinstance(msg, PutRequest):
        ingest = handlers.begin_put(session, header, msg)
        for i in range(len(msg.keys)):
            view = ingest.reserve(i)     # an arena slot to receive into, or None
            ... receive msg.sizes[i] bytes into view (or discard them) ...
            ingest.complete(i)           # only after a view was filled
        reply = ingest.reply()           # ingest.abort() if the stream broke
    else:
        reply = handlers.handle(session, header, msg)
    ... send reply.head, then each of reply.payload ..., then reply.release()
    if reply.close: close the connection

Any step may raise :class:`~kvfabric.errors.ProtocolError`; the transport then
sends ``handlers.error_reply(session, opcode, request_id, exc)`` (which also
counts the error by code) and closes the connection when ``reply.close`` is
set (the codes in ``kvfabric.errors.FATAL_CODES``), after draining the
payload otherwise. Payload views in a reply point into the arena and stay
valid (their objects pinned) until ``reply.release()`` runs: call it once the
bytes are sent, or when sending failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import __version__, protocol
from ...errors import FATAL_CODES, ErrorCode, ProtocolError
from ...protocol import (
    DEFAULT_LIMITS,
    PRE_AUTH_LIMITS,
    AuthReply,
    AuthRequest,
    DeleteReply,
    ExistsReply,
    GetReply,
    Header,
    HelloReply,
    HelloRequest,
    Limits,
    LookupReply,
    Message,
    Op,
    PingReply,
    PutReply,
    PutRequest,
    PutStatus,
    RetireReply,
    RetireRequest,
    StatsReply,
)
from .store import NamespaceTableFull, Slot, Store

log = logging.getLogger("kvfabric.server")


@dataclass(slots=True)
class Reply:
    """Bytes to send back: ``head`` (header + metadata), then ``payload`` views in order."""

    head: bytes
    payload: list[memoryview] = field(default_factory=list)
    release: Callable[[], None] = lambda: None
    close: bool = False


class Session:
    """Per-connection state: whether the peer has authenticated, which limits apply, and the nonces
    of its last HELLO (protocol 3: ``client_nonce`` its, ``server_nonce`` ours, fresh per HELLO)."""

    __slots__ = ("peer", "transport", "authenticated", "limits", "client_nonce", "server_nonce")

    def __init__(self, peer: str, transport: str, authenticated: bool, limits: Limits) -> None:
        self.peer = peer
        self.transport = transport
        self.authenticated = authenticated
        self.limits = limits if authenticated else PRE_AUTH_LIMITS
        self.client_nonce: bytes | None = None
        self.server_nonce: bytes | None = None


class ServerCounters:
    """Connection-level counters for STATS; thread-safe (own small lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.connections = 0
        self.connections_total = 0
        self.connections_refused = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.drops: dict[str, int] = {}  # connections dropped without an error reply, by reason

    def connection_opened(self) -> None:
        with self._lock:
            self.connections += 1
            self.connections_total += 1

    def connection_closed(self) -> None:
        with self._lock:
            self.connections -= 1

    def refused(self) -> None:
        with self._lock:
            self.connections_refused += 1

    def traffic(self, bytes_in: int, bytes_out: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out
            self.requests += requests

    def dropped(self, reason: str) -> None:
        """A connection was closed mid-frame: ``stalled``, ``peer_closed`` or ``io_error``."""
        with self._lock:
            self.drops[reason] = self.drops.get(reason, 0) + 1

    def error(self, code: ErrorCode) -> None:
        with self._lock:
            self.errors[code.name] = self.errors.get(code.name, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "connections": self.connections,
                "connections_total": self.connections_total,
                "connections_refused": self.connections_refused,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "requests": self.requests,
                "errors": dict(self.errors),
                "drops": dict(self.drops),
            }


class Handlers:
    """The server's request logic over one :class:`Store`; shared by all connections and transports.

    ``auth_token``: when set, a connection must prove it holds it (HELLO, then
    AUTH: :mod:`kvfabric.protocol.auth`) before anything else, and until then
    only HELLO and AUTH are served, under :data:`PRE_AUTH_LIMITS`. Without
    one, AUTH is answered MALFORMED (there is nothing to prove).
    ``transports``: names advertised in the HELLO reply.
    """

    def __init__(
        self,
        store: Store,
        *,
        server_id: str,
        transports: Sequence[str] = ("tcp",),
        auth_token: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.store = store
        self.server_id = server_id
        self.transports = list(transports)
        self.auth_token = auth_token or None
        self.limits = limits
        self.counters = ServerCounters()
        self.started = time.monotonic()
        # extra STATS entries contributed by transports (name -> callable returning a map)
        self.stats_sources: dict[str, Callable[[], Any]] = {}
        self._dispatch: dict[Op, Callable[[Session, Header, Any], Reply]] = {
            Op.HELLO: self._hello,
            Op.PING: self._ping,
            Op.EXISTS: self._exists,
            Op.LOOKUP: self._lookup,
            Op.GET: self._get,
            Op.DELETE: self._delete,
            Op.STATS: self._stats,
            Op.AUTH: self._auth,
            Op.RETIRE: self._retire,
        }

    # ------------------------------------------------------------------ framing

    def new_session(self, peer: str, transport: str = "tcp") -> Session:
        return Session(peer, transport, self.auth_token is None, self.limits)

    def parse_header(self, session: Session, buf: Any) -> Header:
        """Check the 32 header bytes against the session's limits (ProtocolError otherwise)."""
        try:
            header = protocol.unpack_header(buf, session.limits)
        except ProtocolError as e:
            if e.code == ErrorCode.BAD_VERSION:  # say it as the C server does
                raise ProtocolError(ErrorCode.BAD_VERSION, protocol.BAD_VERSION_MESSAGE) from None
            raise
        if header.is_reply:
            raise ProtocolError(ErrorCode.MALFORMED, "a request must not carry the REPLY flag")
        return header

    def decode(self, session: Session, header: Header, meta: Any) -> Message:
        """Decode and check the metadata; refuses anything but HELLO and AUTH before authentication."""
        if not session.authenticated and header.opcode not in (Op.HELLO, Op.AUTH):
            raise ProtocolError(ErrorCode.AUTH_FAILED, "authenticate with HELLO and AUTH first")
        msg = protocol.decode_request(header, meta, session.limits)
        if isinstance(msg, PutRequest) and msg.ns is not None:  # the tag interned before any payload is read
            self._ns_ref(msg.ns)
        return msg

    def _ns_ref(self, tag: bytes) -> tuple[bytes, int]:
        try:
            return self.store.ns_ref(tag)
        except NamespaceTableFull:
            raise ProtocolError(ErrorCode.BUSY, "namespace tag table full: this server knows as many tags as it "
                                                "can hold; nothing stored") from None

    def error_reply(self, session: Session | None, opcode: int, request_id: int, exc: ProtocolError) -> Reply:
        """The error frame for ``exc``, counted by code; ``close`` set for fatal codes."""
        self.counters.error(exc.code)
        peer = session.peer if session is not None else "?"
        # a failed proof may be someone without the token trying: the operator hears of it
        log.log(logging.WARNING if exc.code == ErrorCode.AUTH_FAILED else logging.INFO,
                "error %s from %s: %s", exc.code.name, peer, exc.message)
        head = protocol.encode_error(opcode, request_id, exc.code, exc.message)
        return Reply(head, close=exc.code in FATAL_CODES)

    def busy_reply(self, message: str) -> Reply:
        """A BUSY error frame (request id 0) for a peer refused before it sent anything."""
        self.counters.error(ErrorCode.BUSY)
        return Reply(protocol.encode_error(0, 0, ErrorCode.BUSY, message), close=True)

    # ------------------------------------------------------------------ requests

    def handle(self, session: Session, header: Header, msg: Message) -> Reply:
        """Run a request that carries no payload (everything but PUT)."""
        return self._dispatch[msg.op](session, header, msg)

    def begin_put(self, session: Session, header: Header, msg: PutRequest) -> PutIngest:
        return PutIngest(self, header, msg)

    def _hello(self, session: Session, header: Header, msg: HelloRequest) -> Reply:
        if msg.version != protocol.VERSION:
            raise ProtocolError(ErrorCode.BAD_VERSION, protocol.BAD_VERSION_MESSAGE)
        nonce = proof = None
        if self.auth_token is not None:  # a fresh challenge per HELLO; AUTH answers it
            nonce = protocol.new_nonce()
            session.client_nonce, session.server_nonce = msg.nonce, nonce
            proof = protocol.server_proof(self.auth_token, msg.nonce, nonce, self.server_id)
        reply = HelloReply(
            server=f"kvfabric/{__version__}",
            server_id=self.server_id,
            transports=tuple(self.transports),
            limits=self.limits,
            capacity=self.store.capacity,
            auth_required=self.auth_token is not None,
            nonce=nonce,
            proof=proof,
        )
        return Reply(protocol.encode_reply(reply, header.request_id))

    def _auth(self, session: Session, header: Header, msg: AuthRequest) -> Reply:
        if self.auth_token is None:
            raise ProtocolError(ErrorCode.MALFORMED, "this server has no pool token: AUTH is not expected")
        ns, nc = session.server_nonce, session.client_nonce
        session.server_nonce = session.client_nonce = None  # one AUTH per HELLO (as csrc/kvf_ops.c)
        if ns is None or nc is None:
            raise ProtocolError(ErrorCode.AUTH_FAILED, "AUTH without a HELLO to answer")
        expected = protocol.client_proof(self.auth_token, ns, nc)
        if not protocol.proof_ok(expected, msg.proof):
            raise ProtocolError(ErrorCode.AUTH_FAILED, "wrong proof: this peer does not hold the pool token")
        session.authenticated = True
        session.limits = self.limits
        return Reply(protocol.encode_reply(AuthReply(), header.request_id))

    def _ping(self, session: Session, header: Header, msg: Message) -> Reply:
        return Reply(protocol.encode_reply(PingReply(), header.request_id))

    def _exists(self, session: Session, header: Header, msg: Any) -> Reply:
        present = self.store.exists(msg.keys)
        return Reply(protocol.encode_reply(ExistsReply(present), header.request_id))

    def _lookup(self, session: Session, header: Header, msg: Any) -> Reply:
        count = self.store.lookup(msg.keys, msg.lease_ms)
        # the reference server has no tiers: every counted key is in its memory
        media = bytes([protocol.MEDIUM_DRAM]) * count if msg.media else None
        return Reply(protocol.encode_reply(LookupReply(count, media), header.request_id))

    def _get(self, session: Session, header: Header, msg: Any) -> Reply:
        got = self.store.acquire(msg.keys, max_bytes=session.limits.max_payload_bytes, verify=not msg.client_verifies)
        try:
            head = protocol.encode_reply(GetReply(got.sizes, got.checksums), header.request_id)
        except BaseException:
            got.release()
            raise
        return Reply(head, got.views, got.release)

    def _retire(self, session: Session, header: Header, msg: RetireRequest) -> Reply:
        try:
            gen = self.store.retire(msg.ns)
        except NamespaceTableFull:
            raise ProtocolError(ErrorCode.BUSY, "namespace tag table full: this server knows as many tags as it "
                                                "can hold; nothing retired") from None
        return Reply(protocol.encode_reply(RetireReply(gen), header.request_id))

    def _delete(self, session: Session, header: Header, msg: Any) -> Reply:
        n = self.store.delete(msg.keys)
        return Reply(protocol.encode_reply(DeleteReply(n), header.request_id))

    def _stats(self, session: Session, header: Header, msg: Message) -> Reply:
        return Reply(protocol.encode_reply(StatsReply(self.stats()), header.request_id))

    def stats(self) -> dict[str, Any]:
        """The STATS map: every key of ``protocol.STATS_KEYS`` plus the reference's optional ones."""
        out = self.store.stats()
        out.update(self.counters.snapshot())
        out["transports"] = list(self.transports)
        out["server_id"] = self.server_id
        out["uptime_s"] = round(time.monotonic() - self.started, 3)
        out["free_bytes"] = self.store.arena.free_bytes
        out["stalled_connections"] = out["drops"].get("stalled", 0)  # the min-rate bound included
        out["namespaces"] = self.store.namespaces()
        for key in protocol.STATS_KEYS:
            out.setdefault(key, 0)  # a mechanism the reference does not have (budgets, idle timeouts)
        for name, source in self.stats_sources.items():
            out[name] = source()
        return out


class PutIngest:
    """One PUT in progress: hands out arena slots to receive into, then builds the reply.

    ``reserve(i)`` returns the view to fill with object ``i``'s bytes, or
    ``None`` when that object is not being stored (already held, too large,
    no space, its group refused already): the transport then reads and
    discards its bytes. After a filled view, ``complete(i)`` checks the
    checksum and commits it. If the stream breaks, ``abort()`` returns any slot
    still reserved (and any kept by an open group, counted ``groups_torn``).

    Groups (issue 23; the C server's rules, csrc/kvf_put.c): a group's parts are
    consecutive (the decoder checked); each verified part's slot is kept until
    the run's last part, then the group is committed whole; a part too large,
    without space or failing its checksum refuses the whole group, every part
    answering that status.
    """

    def __init__(self, handlers: Handlers, header: Header, msg: PutRequest) -> None:
        self._h = handlers
        self._header = header
        self.msg = msg
        self.status: list[int] = [-1] * len(msg.keys)
        self._slot: Slot | None = None
        self._index = -1
        self._gend = -1  # the open group's run is [self._gstart, self._gend) while self._gend > i
        self._gstart = -1
        self._gfail: PutStatus | None = None
        self._kept: list[tuple[int, Slot]] = []  # verified parts of the open group
        self._ns = handlers._ns_ref(msg.ns) if msg.ns is not None else None  # interned by decode already

    def reserve(self, i: int) -> memoryview | None:
        if self._slot is not None:
            raise RuntimeError("previous slot neither completed nor aborted")
        groups = self.msg.groups
        if groups is not None and i >= self._gend:
            self._open_group(i)
        if groups is not None and self._gfail is not None:
            self.status[i] = int(self._gfail)
            self._after(i)
            return None
        res = self._h.store.begin_put(self.msg.keys[i], self.msg.sizes[i])
        if isinstance(res, Slot):
            self._slot, self._index = res, i
            return res.view
        self.status[i] = int(res)
        if groups is not None and res != PutStatus.EXISTS:
            self._gfail = res
        self._after(i)
        return None

    def complete(self, i: int) -> None:
        slot, self._slot = self._slot, None
        if slot is None or i != self._index:
            raise RuntimeError(f"complete({i}) without a reserved slot")
        parent = self.msg.parents[i] if self.msg.parents is not None else None
        store = self._h.store
        if self.msg.groups is None:
            self.status[i] = int(store.commit_put(self.msg.keys[i], slot, self.msg.checksums[i], parent, self._ns))
            return
        if store.verify_put(self.msg.keys[i], slot, self.msg.checksums[i]):
            self._kept.append((i, slot))
        else:
            self.status[i] = int(PutStatus.CHECKSUM_MISMATCH)
            self._gfail = self._gfail or PutStatus.CHECKSUM_MISMATCH
        self._after(i)

    def _open_group(self, i: int) -> None:
        self._gstart, self._gend = i, i + self.msg.group_parts[i]
        self._gfail = None
        self._kept = []
        if self._h.store.group_too_large(self.msg.sizes[i:self._gend]):
            self._gfail = PutStatus.TOO_LARGE

    def _after(self, i: int) -> None:
        """Part ``i`` is answered: after the run's last part, commit or refuse its group whole."""
        if i != self._gend - 1:
            return
        kept, self._kept = self._kept, []
        store = self._h.store
        run = range(self._gstart, self._gend)
        if self._gfail is None and kept:
            parent = self.msg.parents[kept[0][0]] if self.msg.parents is not None else None
            g = self.msg.groups[self._gstart]
            got = store.commit_group([(self.msg.keys[k], slot, self.msg.checksums[k]) for k, slot in kept], g,
                                     self.msg.group_parts[self._gstart], parent, self._ns)
            for (k, _), st in zip(kept, got):
                self.status[k] = int(st)
        elif self._gfail is not None:
            store.refuse_group([slot for _, slot in kept])
            for k in run:
                self.status[k] = int(self._gfail)

    def abort(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            self._h.store.abort_put(slot)
        kept, self._kept = self._kept, []
        for _, s in kept:
            self._h.store.abort_put(s)
        if self.msg.groups is not None and self._gend > 0 and -1 in self.status[self._gstart:self._gend]:
            self._h.store.count("groups_torn")

    def reply(self) -> Reply:
        if self._slot is not None or -1 in self.status:
            self.abort()
            raise RuntimeError("PUT reply before every object was received")
        return Reply(protocol.encode_reply(PutReply(self.status), self._header.request_id))


__all__ = ["Handlers", "PutIngest", "Reply", "ServerCounters", "Session", "PutStatus"]
