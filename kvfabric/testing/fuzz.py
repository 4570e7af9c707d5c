"""A protocol-3 frame fuzzer against a real ``kvfabric serve`` with a pool token, an SSD and a shared tier.

Seeded, so every finding reproduces (``--seed`` and the session number are printed with it). Each
*session* is one connection of one kind (:data:`KINDS`):

* ``auth``: a valid HELLO + AUTH with the token first, then 1-12 pipelined frames of every opcode
  (HELLO, AUTH, PING, EXISTS, LOOKUP, GET, PUT, DELETE, STATS, the shm ops, unknown ones): structured
  (real keys, PUTs with right and wrong sizes, checksums and parents, leases) and, per session none,
  5%, a third or 70% of them, mutated (metadata cut, flipped or replaced; header bits flipped;
  ``meta_len`` / ``payload_len`` lying, up to 2**32-1 / 2**64-1; payloads cut or padded);
* ``preauth``: the same frames with no AUTH (sometimes after a HELLO, sometimes after a wrong AUTH),
  then a PING: the pre-auth rule must hold, nothing but HELLO and AUTH answered (and a HELLO only
  within the pre-auth limits: 4 KiB of metadata, no payload);
* ``unix`` / ``unix-preauth``: the same on the shm unix socket; authenticated ones first run one shm
  PUT for real (ATTACH, the arena mapped, RESERVE, the bytes written, sometimes wrong, COMMIT) and
  read it back with LEASE, then pipeline the shm ops and the rest;
* ``trickle``: an authenticated connection whose first 2 KiB go out 1-7 bytes at a time;
* ``hold``: a connection left half-sent (a partial header or frame) while later sessions run; at most
  :data:`HELD` stay open, the oldest is closed first.

Oracles, checked on every reply stream: reply frames are well formed; no pre-auth reply but HELLO's
(and AUTH's errors); a GET object whose checksum verifies is the exact bytes that were PUT under
its key (keys the fuzzer owns, ``G``-prefixed, are only ever stored with their canonical bytes: a
mutated frame's checksum no longer matches), and without ``client_verifies`` every object's checksum
verifies; an shm LEASE's verifying object likewise. Every ``probe_every`` sessions and at the end a
fresh client authenticates and PINGs; the server's RSS is sampled after every session and held
against the memory bound docs/operations.md states (:meth:`FuzzServer.rss_bound`). A session that
gets no EOF within ``session_timeout_s`` after its last byte is a *hang*; a server process that
exits is a *crash* (its log tail and the bytes the session pipelined after its handshake are kept, and
the server is restarted). The frames a seed sends do not depend on the server's answers (a refused
handshake aside), so `--seed S` replays a finding.

The suite runs a bounded campaign (tests/native/test_fuzz_v3.py); a long one::

    python -m kvfabric.testing.fuzz --frames 200000 --seed 1 [--minutes 10] [--workers 4] [--json out.json]

Under AddressSanitizer (an ASan build of the extension first on ``PYTHONPATH``, ``LD_PRELOAD`` of
libasan, as scripts/ci-native.sh does; the server subprocess inherits both) a memory error aborts the
server, which the campaign reports as a crash with ASan's report in the log tail; RSS is then not held
against the bound.
"""

from __future__ import annotations

import argparse
import array
import collections
import hashlib
import json
import mmap
import os
import random
import selectors
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from .. import protocol as p
from ..errors import ConnectionClosed, ErrorCode
from ..protocol.wire import FLAG_ERROR, FLAG_REPLY, HEADER, HEADER_SIZE, MAGIC, VERSION, Op, ShmOp
from ..server.memory import dram_needs
from ..sizes import parse_size
from ..transport import tcp
from .servers import ServerProcess, start_server

__all__ = ["FuzzServer", "Fuzzer", "Report", "KINDS", "asan_preloaded", "run_workers", "start_fuzz_server", "main"]

TOKEN = "fuzz-pool-token-v3"
KINDS = ("auth", "auth", "auth", "preauth", "preauth", "unix", "unix-preauth", "trickle", "hold")
HELD = 8
PRE_AUTH_META = p.PRE_AUTH_LIMITS.max_meta_bytes
_SHM_OPS = tuple(int(o) for o in ShmOp)
_OPS = tuple(int(o) for o in Op) + _SHM_OPS
_GOOD_SIZES = (1, 100, 4095, 4096, 65536, 200_000)
_MAX_GOOD = 2000                     # distinct good keys over a campaign (bounds the shared tier's disk)
_TRICKLE_BYTES = 2048                # a trickle session sends this much 1-7 bytes at a time, then the rest
_KEEP_REPLY_BYTES = 64 << 20         # reply bytes kept per session for the oracles
_OBJ_BYTES, _CONN_BYTES = 1 << 10, 32 << 10   # the bound's per-object and per-connection shares


# ------------------------------------------------------------------ the server under test

@dataclass
class FuzzServer:
    """A ``kvfabric serve`` started by :func:`start_fuzz_server`, with what its memory bound needs."""

    proc: ServerProcess
    token: str | None
    shm_socket: str
    capacity: int
    reply_budget: int
    request_budget: int
    ssd_write_queue: int
    preauth_s: float | None = None   # with a token: a connection not authenticated this long after accept is closed

    def rss_bound(self, objects: int, connections: int) -> int:
        """docs/operations.md "Memory bound": capacity + page map + 48 MiB + the budgets + the tier's
        staging queue + 1 KiB per stored object + 32 KiB per open connection."""
        return (dram_needs(self.capacity, reply_budget=self.reply_budget, request_budget=self.request_budget,
                           tier_write_queue=self.ssd_write_queue)
                + objects * _OBJ_BYTES + connections * _CONN_BYTES)

    def probe(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """A fresh authenticated client's PING, then STATS (raises when the server does not answer;
        :class:`SlowHandshake` when it closed a handshake that had run past its pre-auth limit, as it
        must: on a loaded machine the fuzzer's own threads can hold the probe's up that long)."""
        t0 = time.monotonic()
        try:
            c = tcp.connect(self.proc.address, timeout_s=timeout_s, auth_token=self.token)
        except ConnectionClosed as e:
            took = time.monotonic() - t0
            if self.preauth_s is not None and took >= self.preauth_s:
                raise SlowHandshake(f"handshake closed after {took:.1f} s (pre-auth limit {self.preauth_s} s)") from e
            raise
        with c:
            if c.request(p.PingRequest()).msg != p.PingReply():
                raise AssertionError("PING not answered with PING")
            return c.request(p.StatsRequest()).msg.stats


@contextmanager
def start_fuzz_server(workdir: str, *, token: str | None = TOKEN, capacity: str = "4MiB",
                      budget: str = "8MiB", stall_timeout_s: float = 2.0) -> Iterator[FuzzServer]:
    """``kvfabric serve`` with ``--auth-token``, tcp+native+shm, an SSD tier and a shared tier under
    ``workdir``, small budgets (so the memory bound is tight) and a short stall timeout (so held and
    trickled connections are dropped within the campaign). ``token=None`` starts it without a token
    (only to show that the pre-auth oracle fires: every frame is then served before AUTH)."""
    ssd, shared = os.path.join(workdir, "ssd"), os.path.join(workdir, "shared")
    for d in (ssd, shared):
        os.makedirs(d, mode=0o700, exist_ok=True)
    sock = os.path.join(workdir, "shm.sock")
    args = (["--auth-token", token] if token else []) + [
            "--transports", "tcp,native,shm", "--shm-socket", sock,
            "--ssd-path", ssd, "--ssd-capacity", "8MiB", "--ssd-write-queue", budget, "--shared-path", shared,
            "--reply-budget", budget, "--request-budget", budget, "--stall-timeout", str(stall_timeout_s),
            "--idle-timeout", "60", "--max-lease-ms", "2000", "--log-level", "warning"]
    with start_server(capacity=capacity, extra_args=args) as proc:
        b = parse_size(budget)
        yield FuzzServer(proc, token, sock, parse_size(capacity), b, b, b,
                         preauth_s=stall_timeout_s if token else None)   # server/native.py: preauth = stall


class SlowHandshake(Exception):
    """The server closed a probe's HELLO/AUTH that had taken longer than its pre-auth limit."""


def asan_preloaded() -> bool:
    """Whether AddressSanitizer is preloaded here (and so in the servers started from here)."""
    return "libasan" in os.environ.get("LD_PRELOAD", "")


# ------------------------------------------------------------------ keys the fuzzer owns

def good_key(rng: random.Random) -> bytes:
    """A key whose canonical bytes (:func:`canonical`) are all that is ever stored under it."""
    return b"G" + struct.pack("<I", rng.choice(_GOOD_SIZES)) + rng.randbytes(11)


def canonical(key: bytes) -> bytes:
    size = struct.unpack_from("<I", key, 1)[0]
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def _is_good(key: Any) -> bool:
    return isinstance(key, bytes) and len(key) == 16 and key[:1] == b"G"


# ------------------------------------------------------------------ frames

@dataclass
class Sent:
    """What a reply to request id ``rid`` may be checked against (only frames sent unmutated)."""

    op: int
    meta_len: int
    payload_len: int
    keys: list = field(default_factory=list)
    client_verifies: bool = False
    intact: bool = True


def _frame(op: int, rid: int, meta: bytes, payload: bytes = b"", *, meta_len: int | None = None,
           payload_len: int | None = None, flags: int = 0, version: int = VERSION, magic: bytes = MAGIC) -> bytes:
    head = HEADER.pack(magic, version, op & 0xFF, flags & 0xFF, rid, len(meta) if meta_len is None else meta_len,
                       len(payload) if payload_len is None else payload_len, 0)
    return head + meta + payload


class Generator:
    """Structured-random request frames (see the module docstring); ``good`` are the keys stored so far."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.good: list[bytes] = []
        self.rid = 1
        self.mutate_p = 0.33      # chance that a frame is mutated; set per session
        self.aliased: set[int] = set()   # request ids a flipped header bit gave a mutated frame

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def keys(self) -> list:
        r = self.rng
        n = r.choice([0, 1, 1, 2, 3, 8, 64, 65, 4097]) if r.random() < 0.1 else r.randint(1, 6)
        out: list = []
        for _ in range(n):
            x = r.random()
            if x < 0.6 and self.good:
                out.append(r.choice(self.good))
            elif x < 0.75:
                out.append(good_key(r))
            elif x < 0.97:
                out.append(r.randbytes(r.choice([1, 8, 16, 32, 64])))
            else:
                out.append(r.choice([b"", r.randbytes(65), r.randbytes(200), "str", 7, None, [b"k"]]))
        if out and r.random() < 0.1:
            out.append(out[0])            # a duplicate key
        return out

    def put(self) -> tuple[dict, bytes, bool]:
        """PUT metadata, payload and whether it is well formed (its sizes match the payload)."""
        r = self.rng
        keys = []
        for _ in range(r.randint(1, 4)):
            if r.random() < 0.5 and len(self.good) < _MAX_GOOD:
                k = good_key(r)
                self.good.append(k)
            elif self.good and r.random() < 0.6:
                k = r.choice(self.good)
            else:
                k = r.randbytes(r.choice([8, 16, 33]))
            keys.append(k)
        objs = [canonical(k) if _is_good(k) else r.randbytes(r.choice([0, 1, 100, 5000, 70_000])) for k in keys]
        sums = [p.checksum(k, o) for k, o in zip(keys, objs)]
        sizes = [len(o) for o in objs]
        ok = True
        x = r.random()
        if x < 0.15:                                  # a wrong checksum
            i = r.randrange(len(keys))
            sums[i] ^= 1 << r.randrange(64)
        elif x < 0.25:                                # a wrong or absurd size
            i = r.randrange(len(keys))
            sizes[i] = r.choice([0, sizes[i] + 1, max(sizes[i] - 1, 0), 1 << 40, (1 << 64) - 1, -1, 64 << 20 | 1])
            ok = False
        elif x < 0.3:                                 # fields missing or of the wrong type
            return {"keys": keys, r.choice(["sizes", "checksums"]): r.choice([None, "x", sizes[:-1]])}, b"".join(objs), False
        meta: dict[str, Any] = {"keys": keys, "sizes": sizes, "checksums": sums}
        y = r.random()
        if y < 0.3:
            meta["parents"] = [r.choice([None, *self.good[-8:], r.randbytes(16)]) for _ in keys]
        elif y < 0.4:
            meta["parents"] = r.choice([[], [b""] * len(keys), ["x"] * len(keys), [r.randbytes(65)] * len(keys),
                                        [None] * (len(keys) + 1), b"p", 3])
            ok = False
        return meta, b"".join(objs), ok

    def request(self, on_unix: bool) -> tuple[int, dict | None, bytes, Sent]:
        """One structured request: (opcode, metadata, payload, what its reply may be checked against)."""
        r = self.rng
        ops = [int(o) for o in Op] * 2 + list(_SHM_OPS) * (4 if on_unix else 1) + [int(Op.PUT), int(Op.GET)] * 3
        op = r.choice(ops) if r.random() < 0.97 else r.choice([0, 10, 31, 37, 200, 255])
        meta: dict | None
        payload = b""
        cv = False
        if op == Op.HELLO:
            meta = {"version": r.choice([3, 3, 3, 2, 4, -1]), "client": "fuzz",
                    "transports": r.choice([["tcp"], ["tcp", "native", "shm"], [], ["x"] * 40]),
                    "nonce": r.choice([r.randbytes(32), r.randbytes(31), r.randbytes(33), None])}
            if r.random() < 0.05:
                meta["client"] = "c" * r.choice([5000, 70_000])      # over the pre-auth 4 KiB
        elif op == Op.AUTH:
            meta = {"proof": r.choice([r.randbytes(32), r.randbytes(16), b"", "p" * 32, None])}
        elif op in (Op.PING, Op.STATS, ShmOp.ATTACH):
            meta = {}
        elif op in (Op.EXISTS, Op.DELETE, ShmOp.LEASE):
            meta = {"keys": self.keys()}
        elif op == Op.LOOKUP:
            meta = {"keys": self.keys(), "lease_ms": r.choice([0, 0, 1, 500, 3_600_000, 3_600_001, 1 << 63])}
            if r.random() < 0.3:
                meta["media"] = r.choice([True, False, 1, None, b"x"])
        elif op == Op.GET:
            cv = r.random() < 0.3
            meta = {"keys": self.keys(), "client_verifies": cv}
        elif op == Op.PUT:
            meta, payload, _ = self.put()
        elif op == ShmOp.RELEASE:
            meta = {"lease": r.choice([0, 1, 2, r.getrandbits(64)])}
        elif op == ShmOp.RESERVE:
            m, _, _ = self.put()
            meta = {"keys": m["keys"], "sizes": m.get("sizes")}
        elif op == ShmOp.COMMIT:
            meta = {"res": r.choice([0, 1, 2, r.getrandbits(64)]), "checksums": [r.getrandbits(64)] * r.randint(0, 3)}
        else:
            meta = r.choice([{}, {"keys": self.keys()}, None])
        keys = meta.get("keys", []) if isinstance(meta, dict) else []
        return op, meta, payload, Sent(op, 0, len(payload), list(keys) if isinstance(keys, list) else [], cv)

    def frame(self, on_unix: bool = False) -> tuple[bytes, int, Sent]:
        """One request frame, mutated a third of the time: (bytes, request id, Sent)."""
        r = self.rng
        op, meta, payload, sent = self.request(on_unix)
        rid = self.next_rid()
        body = b"" if meta is None else msgpack.packb(meta, use_bin_type=True)
        kw: dict[str, Any] = {}
        if r.random() < self.mutate_p:
            sent.intact = False
            for _ in range(r.randint(1, 3)):
                m = r.randrange(9)
                if m == 0 and body:
                    body = body[:r.randrange(len(body))]
                elif m == 1 and body:
                    b = bytearray(body)
                    for _ in range(r.randint(1, 4)):
                        b[r.randrange(len(b))] = r.getrandbits(8)
                    body = bytes(b)
                elif m == 2:
                    body = r.choice([msgpack.packb([1, 2]), msgpack.packb("s"), b"\xc1", b"\x81" * 200,
                                     b"\x91" * 5000, msgpack.packb({"keys": [[[[]]]] * 10}), r.randbytes(40),
                                     b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xf0"])
                elif m == 3:
                    kw["meta_len"] = r.choice([0, len(body) + 1, max(len(body) - 1, 0), 4097, 1 << 20,
                                               (1 << 20) + 1, (1 << 32) - 1])
                elif m == 4:
                    kw["payload_len"] = r.choice([0, len(payload) + 1, 1 << 30, (1 << 30) + 1, (1 << 64) - 1])
                elif m == 5:
                    payload = payload[:r.randrange(len(payload))] if payload else r.randbytes(r.randint(1, 100))
                elif m == 6:
                    kw["flags"] = r.choice([FLAG_REPLY, FLAG_ERROR, 4, 0xFF])
                elif m == 7:
                    if r.random() < 0.5:
                        kw["version"] = r.choice([2, 4, 0xFFFF])
                    else:
                        kw["magic"] = b"KVFX"
                else:
                    op = r.randrange(256)
        data = _frame(op, rid, body, payload, **kw)
        if r.random() < 0.03:                       # a bit flipped anywhere in the header
            b = bytearray(data)
            at = r.randrange(HEADER_SIZE)
            b[at] ^= 1 << r.randrange(8)
            data, sent.intact = bytes(b), False
            if 8 <= at < 16:                          # the request id: now maybe another frame's
                self.aliased.add(struct.unpack_from("<Q", data, 8)[0])
        sent.op = op
        sent.meta_len = kw.get("meta_len", len(body))
        sent.payload_len = kw.get("payload_len", len(payload))
        return data, rid, sent


def hello_frame(rid: int, nonce: bytes) -> bytes:
    return p.encode_request(p.HelloRequest(client="fuzz", transports=("tcp", "native", "shm"), nonce=nonce), rid)


# ------------------------------------------------------------------ talking to the server

class Conversation:
    """One connection: request/reply calls (for the handshake and the shm PUT), then pipelined bytes."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.buf = bytearray()
        self.fds: list[int] = []
        sock.settimeout(timeout_s)

    def _recv(self) -> bool:
        data, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                self.fds.extend(fds)
        self.buf += data
        return bool(data)

    def call(self, frame: bytes) -> tuple[tuple, dict, bytes]:
        """Send one frame, read one reply: ((op, flags, rid, meta_len, payload_len), meta, payload)."""
        self.sock.sendall(frame)
        while True:
            got = _split(self.buf)
            if got is not None:
                head, meta, payload, used = got
                del self.buf[:used]
                return head, meta, payload
            if not self._recv():
                raise ConnectionError("closed by the server")

    def handshake(self, token: str) -> dict:
        """HELLO + AUTH with the token (the proof checked as a client does); the HELLO reply's meta."""
        nonce = p.new_nonce()
        head, meta, _ = self.call(hello_frame(1, nonce))
        if head[1] & FLAG_ERROR or not p.proof_ok(p.server_proof(token, nonce, meta["nonce"], meta["server_id"]),
                                                  meta.get("proof")):
            raise AssertionError(f"the server's HELLO reply does not prove the token: {meta}")
        head, ameta, _ = self.call(p.encode_request(p.AuthRequest(proof=p.client_proof(token, meta["nonce"], nonce)), 2))
        if head[1] & FLAG_ERROR:
            raise AssertionError(f"AUTH with the right proof refused: {ameta}")
        return meta

    def pipeline(self, data: bytes, trickle: random.Random | None = None) -> str:
        """Send ``data`` while reading (with ``trickle``, its first :data:`_TRICKLE_BYTES` 1-7 bytes at a time,
        now and then after a pause of up to 5 ms), half-close, read to EOF: "eof", "reset" or "hang"."""
        s = self.sock
        s.setblocking(False)
        view, sent, half = memoryview(data), 0, False
        end = time.monotonic() + self.timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
            while True:
                if sent >= len(data) and not half:
                    half = True
                    end = time.monotonic() + self.timeout_s
                    try:
                        s.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    sel.modify(s, selectors.EVENT_READ)
                left = end - time.monotonic()
                if left <= 0:
                    return "hang"
                for _, ev in sel.select(min(left, 1.0)):
                    if ev & selectors.EVENT_READ:
                        try:
                            if not self._recv():
                                return "eof"
                        except BlockingIOError:
                            pass
                        except OSError:
                            return "reset"
                        if len(self.buf) > _KEEP_REPLY_BYTES:
                            return "reset"      # more than any reply here can be: treated as the end
                    if ev & selectors.EVENT_WRITE and not half:
                        slow = trickle is not None and sent < _TRICKLE_BYTES
                        n = trickle.randint(1, 7) if slow else 1 << 16
                        try:
                            sent += s.send(view[sent:sent + n])
                        except BlockingIOError:
                            pass
                        except OSError:
                            sent = len(data)     # the server closed: read what it said
                        if slow and trickle.random() < 0.1:
                            time.sleep(trickle.random() * 0.005)
                        end = time.monotonic() + self.timeout_s

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.sock.close()


def _split(buf: bytearray) -> tuple[tuple, Any, bytes, int] | None:
    """The first whole reply frame in ``buf``: (header fields, meta, payload, bytes used), or None."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, version, op, flags, rid, mlen, plen, reserved = HEADER.unpack_from(buf)
    if magic != MAGIC or version != VERSION or reserved or not flags & FLAG_REPLY:
        raise ValueError(f"malformed reply header {bytes(buf[:HEADER_SIZE]).hex()}")
    if mlen > p.MAX_META_BYTES or plen > p.MAX_PAYLOAD_BYTES:
        raise ValueError(f"reply of {mlen}+{plen} bytes")
    if len(buf) < HEADER_SIZE + mlen + plen:
        return None
    meta = msgpack.unpackb(bytes(buf[HEADER_SIZE:HEADER_SIZE + mlen]), raw=False)
    payload = bytes(buf[HEADER_SIZE + mlen:HEADER_SIZE + mlen + plen])
    return (op, flags, rid, mlen, plen), meta, payload, HEADER_SIZE + mlen + plen


# ------------------------------------------------------------------ the campaign

def _op_name(op: int) -> str:
    for enum in (Op, ShmOp):
        try:
            return enum(op).name if enum is Op else "SHM_" + enum(op).name
        except ValueError:
            pass
    return str(op)


@dataclass
class Report:
    seed: int
    frames: int = 0
    sessions: int = 0
    by_kind: dict = field(default_factory=dict)
    crashes: int = 0
    hangs: int = 0
    unresponsive: int = 0       # probes a fresh client's PING did not get through
    violations: int = 0         # oracle failures: pre-auth answers, wrong bytes, malformed replies
    rss_start: int = 0
    rss_peak: int = 0
    rss_bound_at_peak: int = 0
    over_bound: int = 0         # samples above the bound
    good_keys: int = 0
    replies: int = 0
    error_replies: int = 0
    answered: dict = field(default_factory=dict)   # non-error replies by opcode name
    errors: dict = field(default_factory=dict)     # error replies by code
    objects_checked: int = 0    # GET / LEASE objects compared with their canonical bytes
    shm_puts: int = 0
    closed_by_reset: int = 0
    handshake_drops: int = 0    # connections the server closed during our HELLO/AUTH or shm PUT
    slow_probes: int = 0        # probes whose handshake overran the pre-auth limit (the retry answered)
    seconds: float = 0.0
    tiers: dict = field(default_factory=dict)   # the server's ssd_* / shared_* / shm_* STATS at the end
    failures: list = field(default_factory=list)   # the first few, with seed and session to reproduce

    def fail(self, what: str, limit: int = 20) -> None:
        if len(self.failures) < limit:
            self.failures.append(what)

    @property
    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.unresponsive or self.violations or self.over_bound)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"seed {self.seed}: {self.frames} frames in {self.sessions} sessions ({self.seconds:.0f} s), "
                f"{self.crashes} crashes, {self.hangs} hangs, {self.unresponsive} unanswered probes, "
                f"{self.violations} oracle violations; RSS {self.rss_start / mib:.1f} -> peak "
                f"{self.rss_peak / mib:.1f} MiB (bound there {self.rss_bound_at_peak / mib:.1f} MiB, "
                f"{self.over_bound} samples over); {self.replies} replies ({self.error_replies} errors), "
                f"{self.objects_checked} objects checked, {self.shm_puts} shm PUTs, {self.good_keys} keys"
                + (f", {self.slow_probes} probe handshakes over the pre-auth limit (retried)" if self.slow_probes
                   else ""))


class Fuzzer:
    """Runs sessions against one :class:`FuzzServer`; :meth:`run` until a frame count or a deadline."""

    def __init__(self, server: FuzzServer, seed: int, *, session_timeout_s: float = 60.0,
                 probe_every: int = 200, crash_dir: str | None = None, kinds: tuple[str, ...] = KINDS,
                 check_rss: bool = True) -> None:
        self.server = server
        self.check_rss = check_rss   # off under AddressSanitizer: its shadow memory is outside the bound
        self.kinds = kinds
        self.seed = seed
        self.rng = random.Random(seed)
        self.gen = Generator(self.rng)
        self.report = Report(seed)
        self.session_timeout_s = session_timeout_s
        self.probe_every = probe_every
        self.crash_dir = crash_dir
        self.held: collections.deque[socket.socket] = collections.deque()
        self._objects = 0

    # -- one session --------------------------------------------------

    def _connect(self, unix: bool) -> socket.socket:
        if unix:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.session_timeout_s)
            s.connect(self.server.shm_socket)
            return s
        return socket.create_connection((self.server.proc.host, self.server.proc.port), timeout=self.session_timeout_s)

    def session(self, kind: str) -> bytes:
        """Run one session of ``kind``; returns the bytes it pipelined (kept for a crash report)."""
        r, rep = self.rng, self.report
        unix = kind.startswith("unix")
        authed = kind in ("auth", "unix", "trickle")
        if kind == "hold":
            return self._hold()
        conv = Conversation(self._connect(unix), self.session_timeout_s)
        sent: dict[int, Sent] = {}
        chunks: list[bytes] = []
        try:
            if authed:
                conv.handshake(self.server.token)
                rep.frames += 2
                if unix and r.random() < 0.7:
                    self._shm_put(conv)
            elif r.random() < 0.5:
                chunks.append(hello_frame(self.gen.next_rid(), p.new_nonce()))
                if r.random() < 0.3:
                    chunks.append(p.encode_request(p.AuthRequest(proof=r.randbytes(32)), self.gen.next_rid()))
            self.gen.mutate_p = r.choice([0.0, 0.05, 0.33, 0.7])
            for _ in range(r.randint(1, 12)):
                data, rid, s = self.gen.frame(on_unix=unix)
                chunks.append(data)
                sent[rid] = s
            if not authed:
                chunks.append(p.encode_request(p.PingRequest(), self.gen.next_rid()))
            if r.random() < 0.05:                      # cut the stream mid-frame
                last = chunks[-1]
                chunks[-1] = last[:r.randrange(len(last))]
            rep.frames += len(chunks)
            data = b"".join(chunks)
            # the trickle's own generator: how many calls it makes depends on the server (a close ends it)
            trickle = random.Random(r.getrandbits(64)) if kind == "trickle" else None
            outcome = conv.pipeline(data, trickle=trickle)
            if outcome == "hang":
                rep.hangs += 1
                rep.fail(f"session {rep.sessions} ({kind}): no EOF {self.session_timeout_s:.0f} s after its last byte")
            rep.closed_by_reset += outcome == "reset"
            self._check_replies(conv.buf, sent, authed, kind, outcome)
            return data
        except (AssertionError, ValueError, KeyError, TypeError) as e:   # a HELLO/AUTH/shm answer that is wrong
            rep.violations += 1
            rep.fail(f"session {rep.sessions} ({kind}): {e!r}")
            return b""
        except socket.timeout:
            rep.hangs += 1
            rep.fail(f"session {rep.sessions} ({kind}): no answer to a request/reply call "
                     f"within {self.session_timeout_s:.0f} s")
            return b""
        except ConnectionError:        # dropped during the handshake (a crash is seen by the caller)
            rep.handshake_drops += 1
            return b""
        finally:
            conv.close()

    def _hold(self) -> bytes:
        r = self.rng
        s = self._connect(r.random() < 0.3)
        data, _, _ = self.gen.frame()
        part = data[:r.randrange(1, max(2, len(data)))]
        try:
            s.sendall(part)
        except OSError:
            pass
        self.held.append(s)
        while len(self.held) > HELD:
            self.held.popleft().close()
        self.report.frames += 1
        return part

    def _shm_put(self, conv: Conversation) -> None:
        """ATTACH, map the arena, RESERVE good keys, write their bytes (sometimes wrong), COMMIT, LEASE
        them back and check what the arena holds for every verifying object; RELEASE."""
        r, rep = self.rng, self.report
        head, meta, _ = conv.call(p.encode_request(p.ShmAttachRequest(), 3))
        rep.frames += 1
        if head[1] & FLAG_ERROR or not conv.fds:
            rep.violations += 1
            rep.fail(f"session {rep.sessions}: SHM_ATTACH after AUTH refused: {meta}")
            return
        cap = meta["capacity"]
        keys = [good_key(r) for _ in range(r.randint(1, 3))]
        wrong = r.random() < 0.2              # drawn before any answer decides what happens next
        with mmap.mmap(conv.fds[-1], cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as arena:
            if len(self.gen.good) < _MAX_GOOD:
                self.gen.good.extend(keys)
            sizes = [len(canonical(k)) for k in keys]
            head, meta, _ = conv.call(p.encode_request(p.ShmReserveRequest(keys=keys, sizes=sizes), 4))
            rep.frames += 1
            if head[1] & FLAG_ERROR:
                return
            sums = []
            for k, off, st in zip(keys, meta["offsets"], meta["status"]):
                obj = canonical(k)
                if st == p.PutStatus.STORED and off >= 0:
                    arena[off:off + len(obj)] = bytes(len(obj)) if wrong and obj else obj
                sums.append(p.checksum(k, obj))
            conv.call(p.encode_request(p.ShmCommitRequest(res=meta["res"], checksums=sums), 5))
            head, meta, _ = conv.call(p.encode_request(p.ShmLeaseRequest(keys=keys), 6))
            rep.frames += 2
            rep.shm_puts += 1
            if head[1] & FLAG_ERROR:
                return
            for k, off, size, ck in zip(keys, meta["offsets"], meta["sizes"], meta["checksums"]):
                if size < 0:
                    continue
                obj = bytes(arena[off:off + size])
                rep.objects_checked += 1
                if p.checksum(k, obj) != ck:
                    rep.violations += 1
                    rep.fail(f"session {rep.sessions}: LEASE of {k.hex()} names bytes that do not verify")
                elif obj != canonical(k):
                    rep.violations += 1
                    rep.fail(f"session {rep.sessions}: LEASE of {k.hex()} verifies wrong bytes")
            conv.sock.sendall(p.encode_request(p.ShmReleaseRequest(lease=meta["lease"]), 7))
            rep.frames += 1

    def _check_replies(self, buf: bytearray, sent: dict[int, Sent], authed: bool, kind: str, outcome: str) -> None:
        rep = self.report
        view = bytearray(buf)
        while True:
            try:
                got = _split(view)
            except (ValueError, msgpack.UnpackException) as e:
                rep.violations += 1
                rep.fail(f"session {rep.sessions} ({kind}): malformed reply: {e}")
                return
            if got is None:
                return
            (op, flags, rid, mlen, plen), meta, payload, used = got
            del view[:used]
            rep.replies += 1
            s = sent.get(rid)
            if flags & FLAG_ERROR:
                rep.error_replies += 1
                code = meta.get("code") if isinstance(meta, dict) else None
                code = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
                rep.errors[code] = rep.errors.get(code, 0) + 1
                continue
            name = _op_name(op)
            rep.answered[name] = rep.answered.get(name, 0) + 1
            if not authed:
                if op != Op.HELLO:
                    rep.violations += 1
                    rep.fail(f"session {rep.sessions} ({kind}): op {op} answered before AUTH: {str(meta)[:200]}")
                elif s is not None and (s.meta_len > PRE_AUTH_META or s.payload_len):
                    rep.violations += 1
                    rep.fail(f"session {rep.sessions} ({kind}): a HELLO of {s.meta_len}+{s.payload_len} bytes "
                             "answered before AUTH (pre-auth limits)")
                continue
            if s is None or not s.intact or op != Op.GET or s.op != Op.GET or rid in self.gen.aliased:
                continue
            self._check_get(s, meta, payload, kind)

    def _check_get(self, s: Sent, meta: Any, payload: bytes, kind: str) -> None:
        rep = self.report
        sizes, sums = meta.get("sizes", []), meta.get("checksums", [])
        if len(sizes) != len(s.keys) or len(sums) != len(sizes) or sum(x for x in sizes if x > 0) != len(payload):
            rep.violations += 1
            rep.fail(f"session {rep.sessions} ({kind}): GET reply {meta} does not fit {len(s.keys)} keys and "
                     f"{len(payload)} payload bytes")
            return
        at = 0
        for k, size, ck in zip(s.keys, sizes, sums):
            if size < 0:
                continue
            obj = payload[at:at + size]
            at += size
            verifies = isinstance(k, bytes) and p.checksum(k, obj) == ck
            if not verifies and not s.client_verifies:
                rep.violations += 1
                rep.fail(f"session {rep.sessions} ({kind}): GET of {k!r:.40} sent bytes that fail their checksum")
            elif verifies and _is_good(k):
                rep.objects_checked += 1
                if obj != canonical(k):
                    rep.violations += 1
                    rep.fail(f"session {rep.sessions} ({kind}): GET of {k.hex()} returned wrong bytes that verify")

    # -- the loop -----------------------------------------------------

    def _sample_rss(self, stats: dict | None = None) -> None:
        rep, srv = self.report, self.server
        try:
            rss = srv.proc.rss_bytes()
        except (OSError, RuntimeError):
            return
        if stats is not None:
            self._objects = int(stats.get("objects", 0)) + int(stats.get("ssd_objects", 0))
        bound = srv.rss_bound(self._objects, len(self.held) + 4)
        if not self.check_rss:
            rep.rss_peak = max(rep.rss_peak, rss)
            return
        if rss > bound and stats is None:   # objects counted at the last probe may be stale: count again
            try:
                return self._sample_rss(srv.probe())
            except Exception:  # noqa: BLE001 - the next probe reports an unresponsive server
                pass
        if rss > rep.rss_peak:
            rep.rss_peak, rep.rss_bound_at_peak = rss, bound
        if rss > bound:
            rep.over_bound += 1
            rep.fail(f"session {rep.sessions}: RSS {rss >> 20} MiB over the bound {bound >> 20} MiB")

    def probe(self) -> dict | None:
        try:
            try:
                st = self.server.probe()
            except SlowHandshake:
                self.report.slow_probes += 1   # the limit at work, not a finding, if the retry is answered
                st = self.server.probe()
        except Exception as e:  # noqa: BLE001 - any failure to answer is the finding
            if self.server.proc.alive:
                self.report.unresponsive += 1
                tail = "\n    ".join(self.server.proc.stderr_text().splitlines()[-8:])
                self.report.fail(f"session {self.report.sessions}: a fresh client's PING failed: {e!r}; "
                                 f"the server's log ends:\n    {tail}")
            return None
        self._sample_rss(st)
        return st

    def _crashed(self, last: bytes, kind: str) -> None:
        rep = self.report
        rep.crashes += 1
        tail = "\n".join(self.server.proc.stderr_text().splitlines()[-20:])
        rep.fail(f"session {rep.sessions} ({kind}): server exited with {self.server.proc.popen.returncode}:\n{tail}")
        if self.crash_dir:
            path = os.path.join(self.crash_dir, f"crash-seed{self.seed}-session{rep.sessions}.bin")
            with open(path, "wb") as f:
                f.write(last)

    def run(self, frames: int, deadline_s: float | None = None) -> Report:
        """Sessions until ``frames`` frames were sent (or ``deadline_s`` seconds passed, or the server died)."""
        rep = self.report
        t0 = time.monotonic()
        rep.rss_start = self.server.proc.rss_bytes()
        self.probe()
        while rep.frames < frames and (deadline_s is None or time.monotonic() - t0 < deadline_s):
            kind = self.rng.choice(self.kinds)
            last = b""
            try:
                last = self.session(kind)
            except OSError as e:
                if self.server.proc.alive:
                    rep.fail(f"session {rep.sessions} ({kind}): {e!r}")
            rep.sessions += 1
            rep.by_kind[kind] = rep.by_kind.get(kind, 0) + 1
            if not self.server.proc.alive:
                self._crashed(last, kind)
                break
            self._sample_rss()
            if rep.sessions % self.probe_every == 0:
                self.probe()
        while self.held:
            self.held.popleft().close()
        if self.server.proc.alive:
            st = self.probe() or {}
            rep.tiers = {k: v for k, v in sorted(st.items()) if k.startswith(("ssd_", "shared_", "shm_"))
                         and isinstance(v, int) and not k.endswith("_us_total")}
        rep.good_keys = len(self.gen.good)
        rep.seconds = time.monotonic() - t0
        return rep


def run_workers(server: FuzzServer, seed: int, frames: int, deadline_s: float | None, workers: int,
                **kw: Any) -> list[Report]:
    """``workers`` fuzzers at once against one server, each on a thread with its own seed (the first
    ``seed``, the others ``seed + 100000 * i``: their keys and frames are their own) and its share of
    ``frames``; their sessions interleave as the scheduler likes, so only each one's frames replay."""
    import threading

    fuzzers = [Fuzzer(server, seed + 100_000 * i, **kw) for i in range(workers)]
    share = -(-frames // workers)
    threads = [threading.Thread(target=fz.run, args=(share, deadline_s), name=f"fuzz-{i}", daemon=True)
               for i, fz in enumerate(fuzzers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [fz.report for fz in fuzzers]


# ------------------------------------------------------------------ command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.testing.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=100_000, help="frames to send in all (default 100000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long even if frames remain")
    ap.add_argument("--capacity", default="4MiB", help="the arena (default 4MiB: small, so objects move to the tiers)")
    ap.add_argument("--restarts", type=int, default=3, help="servers started again after a crash (default 3)")
    ap.add_argument("--workers", type=int, default=1,
                    help="fuzzers at once against the server, one thread each (default 1: fully reproducible)")
    ap.add_argument("--json", default=None, help="write the report(s) here as JSON")
    args = ap.parse_args(argv)
    reports = []
    left, t0, seed = args.frames, time.monotonic(), args.seed
    deadline = None if args.minutes is None else args.minutes * 60.0
    asan = asan_preloaded()
    if asan:
        print("AddressSanitizer preloaded: RSS is reported, not held against the bound (ASan's shadow memory "
              "and quarantine are outside it)", flush=True)
    for attempt in range(args.restarts + 1):
        with tempfile.TemporaryDirectory(prefix="kvfabric-fuzz-") as work, start_fuzz_server(work, capacity=args.capacity) as srv:
            crash_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else os.getcwd()
            run = run_workers(srv, seed, left, None if deadline is None else deadline - (time.monotonic() - t0),
                              max(1, args.workers), crash_dir=crash_dir, check_rss=not asan)
            for rep in run:
                print(rep.summary(), flush=True)
                print(f"  answered: {rep.answered}\n  errors: {rep.errors}\n  tiers: {rep.tiers}", flush=True)
                for f in rep.failures:
                    print("  " + f, flush=True)
            reports.append(run)
        left -= sum(r.frames for r in run)
        crashed = any(r.crashes for r in run)
        if not crashed or left <= 0 or (deadline is not None and time.monotonic() - t0 >= deadline):
            break
        seed += 1000   # the crashed session is reproducible from the report; go on with fresh frames
    flat = [r for run in reports for r in run]
    total = {k: sum(getattr(r, k) for r in flat) for k in ("frames", "sessions", "hangs", "unresponsive",
                                                             "violations", "over_bound", "objects_checked",
                                                             "slow_probes")}
    total["crashes"] = sum(max(r.crashes for r in run) for run in reports)   # the workers of a run share a server
    total["servers"] = len(reports)
    total["workers"] = max(1, args.workers)
    total["rss_peak_mib"] = round(max(r.rss_peak for r in flat) / (1 << 20), 1)
    total["seconds"] = round(time.monotonic() - t0, 1)
    print("total: " + ", ".join(f"{k} {v}" for k, v in total.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total": total, "runs": [[asdict(r) for r in run] for run in reports]}, f, indent=1)
    return 0 if all(r.ok for r in flat) else 1


if __name__ == "__main__":
    sys.exit(main())
