"""``kvfabric bench transport-native``: the native and shm data paths against their C ceilings.

One client, loopback, GET and PUT of ``--size`` blocks (default 1 MiB),
``--batch`` blocks per request (default 1). Measured in one run, interleaved
cell by cell (``--repeat`` times, median reported) so every figure and the
ceiling it is divided by were taken seconds apart under the same load:

ceilings
  * ``c-socket``: a C client and a C server process on loopback TCP
    doing the same request/reply exchange with plain blocking send/recv
    (``_native.socket_ceiling``): what any socket transport can reach here;
  * ``memcpy``: one thread copying the block between two warm buffers
    (``_native.memcpy_ceiling``): what a one-copy shm path can reach;
  * ``memcpy-cold``: the same copy into consecutive slots of a region as
    large as the servers' arenas (``--capacity``), so the destination is not
    in cache, as a fresh arena slot is not for a PUT;
  * ``rtt-tcp`` / ``rtt-unix``: the C exchange with 32-byte objects on
    loopback TCP / a unix socket pair: one round trip, the floor under any
    request that waits for a reply (shm's control frames go over a unix
    socket);
  * ``python-socket``: the pure-Python socket loop of ``kvfabric bench
    transport`` (the reference for ``tcp``);
  * ``cma`` (only with a ``nixl-sm`` path): ``process_vm_readv`` (GET) /
    ``process_vm_writev`` (PUT) of the block from / into the shared mapping
    of another process, rotating over ``--capacity`` (:class:`CmaCeiling`):
    the copy UCX makes for nixl over shared memory (``UCX_PROTO_INFO=y``
    names it: zero-copy ``cma/memory``), what that path can reach here;
  * ``ucx-sm`` / ``ucx-tcp`` (only with a ``nixl-sm`` / ``nixl-tcp`` path):
    NIXL itself, one READ (GET) / WRITE (PUT) of the block between this
    process's agent and a peer process's agent over UCX shared memory / UCX
    tcp, into consecutive slots of the peer's registered memfd mapping
    (``--capacity``), polled to completion as the transport polls its own
    (:class:`NixlCeiling`): the same transfer as the ``nixl`` paths without
    kvfabric's lease, reserve and commit frames, so what any design over
    that UCX transport can reach here.

Floors: every path also gets a ``/floor`` ratio against the least time its
request could take here. For the socket paths that is ``c-socket`` (it
already contains the round trip). For ``shm``, a GET is one round trip (the
lease) plus one copy out of a warm slot, so its floor is ``rtt-unix`` +
block/``memcpy``; a PUT is two round trips (reserve, commit) plus one copy
into a fresh slot: 2 x ``rtt-unix`` + block/``memcpy-cold``. When one round
trip already takes longer than twice the copy, the ``shm >= 0.5x memcpy``
target cannot be met by any design that waits for the server once per
request; the table says so with the measured figures.

paths (each against a fresh server process)
  * ``tcp``: pure-Python client, Python server (the reference);
  * ``tcp>native``: pure-Python client, native (io_uring) server;
  * ``native``: C client, native server (copying sends: loopback peer);
  * ``native+zc``: the same with ``--zerocopy on`` (SEND_ZC forced even on
    loopback, where the receiver copies out of the pinned pages anyway);
  * ``native>py``: C client, Python server;
  * ``shm``: same-host client, native server;
  * ``nixl-sm`` / ``nixl-tcp``: the nixl transport (issue 24), native server
    offering nixl, one NIXL READ (GET) or WRITE (PUT) per request into the
    arena, over UCX shared memory (``UCX_TLS=sm,self``) / UCX tcp
    (``UCX_TLS=tcp``); skipped, with the reason, where nixl does not import
    (run it from the nixl virtualenv: scripts/ci-nixl.sh builds one). Its floor
    is shm's with ``rtt-tcp`` for ``rtt-unix`` (the lease and commit go over TCP);
  * ``native+reg`` / ``native>py+reg`` (``--registered``): ``native`` /
    ``native>py`` with the GET buffers registered as io_uring fixed buffers
    (one staging buffer, ``NativeConnection.register_buffers``), so GET
    objects arrive through READ_FIXED instead of recvmsg;
  * ``nixl-sm+reg`` / ``nixl-tcp+reg`` (``--registered``): ``nixl-sm`` /
    ``nixl-tcp`` with the GET destination and the PUT sources registered with
    NIXL once (``NixlConnection.register_buffers``, as the vLLM connector
    registers its KV tensors), so a call registers nothing.

client paths (issue 20): the same requests through ``kvfabric.Client``, as
an engine makes them: ``get_into`` of the block(s) into a caller-owned
buffer and ``put`` of fresh keys, checksums on (``verify_checksums``, the
default: the client hashes every PUT object and checks every GET object, and
that time is counted), routing, pooling and deadlines included; each
against a fresh native server that offers every transport:

  * ``client-tcp`` / ``client-native`` / ``client-shm``: a Client forced to
    that transport.

reference (issue 14)
  * ``redis``: Redis's C client ``redis-benchmark`` (one connection, no
    pipelining) against a ``redis-server`` this run starts on loopback and
    stops (:mod:`kvfabric.bench.redis`), GET and SET of the same block size,
    measured in the same interleaved rounds; each path gets a ``/redis``
    ratio. Only with ``--batch 1``; skipped, with the reason in the table,
    when the binaries are not installed or with ``--no-redis``.
  * ``mooncake``: Mooncake Store, the peer KV store (its non-CUDA build over
    its TCP transport): a master and one holder this run starts on loopback
    and a client in this process, ``get_into`` of one key / ``put_from`` of
    a fresh key into buffers registered with it
    (:mod:`kvfabric.bench.mooncake_store`); each path gets a ``/mooncake``
    ratio. Only with ``--batch 1`` and where the ``mooncake`` package
    imports (run from the vLLM virtualenv, where scripts/ci-vllm.sh installs
    it); skipped with the reason otherwise, or with ``--no-mooncake``.

Buffers: every client-side buffer (GET destinations, PUT sources, the ``cma``
ceiling's local buffer) starts ``--buffer-offset`` bytes past a page boundary
(default 0: page-aligned, as a KV cache's tensors are aligned; torch's sit at
offset 64). The offset matters on CPUs whose REP MOVSB is slow when the
destination is a few bytes ahead of the source modulo the page (AMD Zen 3/4,
glibc bug 30994): numpy arrays and bytearrays of 1 MiB or more sit at offset
16, and a copy into them from a page-aligned arena slot ran 3x slower in the
kernel (``process_vm_readv``, what UCX's cma does for a nixl READ) and 10x in
glibc < 2.39 here. kvfabric's own copies avoid it (csrc/kvf_copy.h); the
kernel's cannot, so ``--buffer-offset 16`` shows what such a caller gets.

The client side is the transport's ``Connection.request`` (checksums of PUT
objects, bound to their fresh keys, are computed before each timed request and
their time is left out; GET replies land in a reused buffer and are not
re-hashed), so the figures are the transport's, not the client's
routing or hashing. For each path the server process's CPU time (utime +
stime from /proc) is divided by the bytes moved: server CPU seconds per GB.

Targets (issue 3): native >= 0.9x c-socket, shm >= 0.5x memcpy, both above
tcp; (issue 14) native >= redis. Prints a table; writes JSON (``--out``, default
bench-results/transport_native.json).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shlex
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from . import proc_cpu_s, write_json
from .. import protocol
from ..config import ClientConfig, parse_size

MiB = 1 << 20

#: the pure-Python reference server's module (the ``>py`` paths); ``kvfabric`` is the product server
REFERENCE = "kvfabric.testing.reference"
# path name -> (server module, client transport, extra server arguments)
PATHS = {
    "tcp": (REFERENCE, "tcp", []),
    "tcp>native": ("kvfabric", "tcp", []),
    "native": ("kvfabric", "native", []),
    "native+zc": ("kvfabric", "native", ["--zerocopy", "on"]),
    "native>py": (REFERENCE, "native", []),
    "shm": ("kvfabric", "shm", ["--transports", "tcp,native,shm"]),
    "native+reg": ("kvfabric", "native", []),
    "native>py+reg": (REFERENCE, "native", []),
    "client-tcp": ("kvfabric", "tcp", ["--transports", "tcp,native,shm"]),
    "client-native": ("kvfabric", "native", ["--transports", "tcp,native,shm"]),
    "client-shm": ("kvfabric", "shm", ["--transports", "tcp,native,shm"]),
    "nixl-sm": ("kvfabric", "nixl", ["--transports", "tcp,native,nixl"]),
    "nixl-tcp": ("kvfabric", "nixl", ["--transports", "tcp,native,nixl"]),
    "nixl-sm+reg": ("kvfabric", "nixl", ["--transports", "tcp,native,nixl"]),
    "nixl-tcp+reg": ("kvfabric", "nixl", ["--transports", "tcp,native,nixl"]),
}
#: nixl paths -> the UCX transports (UCX_TLS) their server and client use
NIXL_TLS = {"nixl-sm": "sm,self", "nixl-tcp": "tcp", "nixl-sm+reg": "sm,self", "nixl-tcp+reg": "tcp"}
#: paths measured through ``kvfabric.Client`` (checksums on) instead of one ``Connection``
CLIENT = ("client-tcp", "client-native", "client-shm")
#: paths whose GET buffers are registered; run only when asked (``--registered`` or ``--paths``)
REGISTERED = ("native+reg", "native>py+reg", "nixl-sm+reg", "nixl-tcp+reg")
#: the peer stores measured beside the paths when they run here (each row's ratio to them: /redis, /mooncake)
PEERS = ("redis", "mooncake")


@dataclass
class Row:
    name: str
    op: str
    size: int
    batch: int
    gbps: float = 0.0
    p50_us: float = 0.0
    p99_us: float | None = None
    server_cpu_s_per_gb: float | None = None
    floor_us: float | None = None
    samples: list[float] = field(default_factory=list)
    ratio: dict[str, float] = field(default_factory=dict)


class _Path:
    """A server process and one connection to it with the path's transport (a ``kvfabric.Client``
    forced to that transport for the :data:`CLIENT` paths)."""

    def __init__(self, name: str, size: int, batch: int, capacity: str, native_args: Sequence[str] = (),
                 offset: int = 0) -> None:
        from .. import transport
        from ..testing.servers import start_server

        module, tname, extra = PATHS[name]
        if module == "kvfabric":
            extra = [*extra, *native_args]
        self.name, self.size, self.batch = name, size, batch
        tls = NIXL_TLS.get(name)
        saved = os.environ.get("UCX_TLS")
        if tls is not None:  # the server process and this process's NIXL agent for it (one per UCX_TLS)
            os.environ["UCX_TLS"] = tls
        self.client = None
        try:
            self.server = start_server(capacity=capacity, module=module, extra_args=extra)
        except BaseException:
            _restore_env("UCX_TLS", saved)
            raise
        try:
            if name in CLIENT:
                from ..client import Client

                self.client = Client([self.server.address], config=ClientConfig(
                    transport=tname, connect_timeout_s=10, timeout_s=30, connections_per_server=1))
            else:
                self.conn = transport.connect(tname, self.server.address, ClientConfig(connect_timeout_s=10))
        except BaseException:
            self.server.kill()
            raise
        finally:
            _restore_env("UCX_TLS", saved)
        rng = np.random.default_rng(7)
        self.values = []
        for _ in range(batch):
            self.values.append(page_buffer(size, offset))
            self.values[-1][:] = rng.integers(0, 256, size, dtype=np.uint8)
        if name in REGISTERED:  # one reused staging buffer, registered once, sliced per block
            self.staging = page_buffer(size * batch, offset)
            self.dest = [self.staging[i * size:(i + 1) * size] for i in range(batch)]
            # nixl: the PUT sources too (what the vLLM connector does with its KV tensors: registered once)
            self.conn.register_buffers([self.staging, *(self.values if tname == "nixl" else [])])
        else:
            self.dest = [page_buffer(size, offset) for _ in range(batch)]
        self.get_keys = [os.urandom(16) for _ in range(batch)]
        self._put(*self._fresh(self.get_keys))

    def _fresh(self, keys: list[bytes] | None = None) -> tuple[list[bytes], list[int]]:
        """Keys (fresh random ones unless given) and the checksums of the values under them."""
        keys = keys or [os.urandom(16) for _ in range(self.batch)]
        if self.client is not None:
            return keys, None  # the Client's own hashing is part of what is measured
        return keys, [protocol.checksum(k, v) for k, v in zip(keys, self.values)]

    def _put(self, keys: list[bytes], sums: list[int] | None) -> int:
        if self.client is not None:  # the Client hashes the values itself (``sums`` is None)
            res = self.client.put(keys, self.values[: len(keys)])
            if res.dropped:
                raise RuntimeError(f"{self.name}: PUT dropped {res.dropped} blocks")
            return self.size * len(keys)
        msg = protocol.PutRequest(keys=keys, sizes=[self.size] * len(keys), checksums=sums)
        status = self.conn.request(msg, self.values[: len(keys)]).msg.status
        if any(s not in (0, 1) for s in status):
            raise RuntimeError(f"{self.name}: PUT failed with status {status}")
        return self.size * len(keys)

    def measure(self, op: str, duration: float) -> tuple[float, float, float, float, float]:
        """(seconds, bytes, server cpu seconds, p50 and p99 latency s) of repeated requests for ``duration``."""
        get = protocol.GetRequest(keys=self.get_keys)
        lat = []
        moved = 0
        cpu0 = proc_cpu_s(self.server.pid)
        t0 = time.perf_counter()
        end = t0 + duration
        prep = 0.0  # time spent making fresh keys and their checksums: not the transport's
        while True:
            if op != "get":
                p0 = time.perf_counter()
                fresh = self._fresh()
                prep += time.perf_counter() - p0
            a = time.perf_counter()
            if op == "get" and self.client is not None:
                if None in self.client.get_into(self.get_keys, self.dest):
                    raise RuntimeError(f"{self.name}: GET missed")
                moved += self.size * self.batch
            elif op == "get":
                rep = self.conn.request(get, recv_buffers=self.dest).msg
                if min(rep.sizes) < 0:
                    raise RuntimeError(f"{self.name}: GET missed")
                moved += self.size * self.batch
            else:
                moved += self._put(*fresh)
            b = time.perf_counter()
            lat.append(b - a)
            if b >= end and len(lat) >= 3:
                break
        secs = time.perf_counter() - t0 - prep
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        return secs, moved, proc_cpu_s(self.server.pid) - cpu0, statistics.median(lat), p99

    def close(self) -> None:
        try:
            (self.client or self.conn).close()
        finally:
            self.server.stop()


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


CEILINGS = ("c-socket", "memcpy", "memcpy-cold", "rtt-tcp", "rtt-unix", "python-socket")
RTT_BYTES = 32  # object size of the round-trip cells
PAGE = 4096


def page_buffer(nbytes: int, offset: int = 0) -> np.ndarray:
    """``nbytes`` of uint8 starting ``offset`` bytes past a page boundary (see the module doc, Buffers)."""
    raw = np.empty(nbytes + offset + PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    return raw[start:start + nbytes]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class CmaCeiling:
    """The ``cma`` ceiling: one ``process_vm_readv`` (get) or ``process_vm_writev`` (put) of ``nbytes`` between a
    warm local buffer and consecutive slots of a ``span``-byte shared mapping (a memfd, touched first) held by a
    forked child process. What UCX's shared-memory path does for a nixl READ / WRITE (one call per 512 KiB
    there: the same time per byte, measured)."""

    def __init__(self, nbytes: int, span: int, offset: int = 0) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.nbytes, self.slots = nbytes, max(2, span // nbytes)
        fd = os.memfd_create("kvfabric-cma-ceiling")
        try:
            os.ftruncate(fd, self.slots * nbytes)
            self._map = mmap.mmap(fd, self.slots * nbytes)
        finally:
            os.close(fd)
        view = np.frombuffer(self._map, np.uint8)
        view[:] = 1  # every page present, as an arena's are
        self._base = view.ctypes.data
        self._local = page_buffer(nbytes, offset)
        self._local[:] = 1
        r, self._wake = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the peer only holds the mapping (same address after fork) until told to go
            try:
                os.read(r, 1)
            finally:
                os._exit(0)
        os.close(r)

    def measure(self, op: str, duration: float) -> tuple[float, float]:
        """(GB/s, mean µs per copy) over about ``duration`` seconds."""
        call = self._libc.process_vm_readv if op == "get" else self._libc.process_vm_writev
        local = _Iovec(self._local.ctypes.data, self.nbytes)
        remote = _Iovec(0, self.nbytes)
        n, t0 = 0, time.perf_counter()
        while True:
            remote.base = self._base + (n % self.slots) * self.nbytes
            if call(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != self.nbytes:
                raise OSError(ctypes.get_errno(), f"process_vm_{'readv' if op == 'get' else 'writev'} fell short")
            n += 1
            secs = time.perf_counter() - t0
            if secs >= duration and n >= 4:
                return self.nbytes * n / secs / 1e9, secs / n * 1e6

    def close(self) -> None:
        if self.pid:
            os.write(self._wake, b"x")
            os.close(self._wake)
            os.waitpid(self.pid, 0)
            self.pid = 0


#: ceilings measured between two processes (:class:`CmaCeiling`, :class:`NixlCeiling`) -> the paths they bound:
#: measured only with one of those paths in the run, and those paths only are divided by them
PROCESS_CEILINGS = {"cma": ("nixl-sm", "nixl-sm+reg"), "ucx-sm": ("nixl-sm", "nixl-sm+reg"),
                    "ucx-tcp": ("nixl-tcp", "nixl-tcp+reg")}

_NIXL_PEER = """
import os, sys
from kvfabric.transport import nixl
span = int(sys.argv[1])
fd = os.memfd_create("kvfabric-nixl-ceiling")
os.ftruncate(fd, span)
ones, off = bytes([1]) * min(span, 1 << 20), 0
while off < span:  # every page present, as an arena's are
    off += os.pwrite(fd, ones[:span - off], off)
export = nixl.ArenaExport(fd, span)
os.close(fd)
sys.stdout.write("KVFABRIC-NIXL-PEER %d %s\\n" % (export.base, export.metadata.hex()))
sys.stdout.flush()
sys.stdin.read()  # until the bench closes the pipe
export.close()
"""


class NixlCeiling:
    """A ``ucx-*`` ceiling: one NIXL READ (get) or WRITE (put) of ``nbytes`` between a registered local buffer and
    consecutive slots of a ``span``-byte memfd mapping that a peer process registered with its own agent
    (:class:`kvfabric.transport.nixl.ArenaExport`, as a pool server does), both agents over ``UCX_TLS=tls``;
    prepared, posted and polled to completion as ``NixlConnection`` does each transfer, with none of its control
    frames. Raises ``RuntimeError`` (with the peer's stderr) when the peer does not come up."""

    def __init__(self, tls: str, nbytes: int, span: int, offset: int = 0, timeout_s: float = 60.0) -> None:
        import subprocess
        import tempfile

        from ..testing.servers import first_line
        from ..transport import nixl

        self.nbytes, self.slots = nbytes, max(2, span // nbytes)
        env = {**os.environ, "UCX_TLS": tls}
        self._err = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-c", _NIXL_PEER, str(self.slots * nbytes)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self._mem = self._key = None
        try:
            try:
                line = first_line(self._proc, timeout_s, what=f"the nixl ceiling's peer (UCX_TLS={tls})")
                marker, base, md = line.split()
                assert marker == "KVFABRIC-NIXL-PEER", line
            except (RuntimeError, ValueError, AssertionError) as e:
                self._err.seek(0)
                raise RuntimeError(f"{e}; its stderr: {self._err.read().decode(errors='replace')[-2000:]}") from None
            self._base = int(base)
            saved = os.environ.get("UCX_TLS")
            os.environ["UCX_TLS"] = tls  # this process's agent for that UCX environment (the nixl path's own)
            try:
                self._mem, self._peer, self._key = nixl._peer(bytes.fromhex(md))
            finally:
                _restore_env("UCX_TLS", saved)
            self._local = page_buffer(nbytes, offset)
            self._local[:] = 1
            self._pins = self._mem.pin([(self._local.ctypes.data, nbytes)])
        except BaseException:
            self.close()
            raise

    def _one(self, op: str, slot: int) -> None:
        from ..transport import nixl

        mem = self._mem
        handle, held = mem.prepare(op, [(self._local.ctypes.data, self.nbytes)],
                                   [(self._base + slot * self.nbytes, self.nbytes)], self._peer, register=False)
        try:
            state = nixl._transfer(mem.agent, handle, None)   # polled as NixlConnection._xfer polls its own
            if state != "DONE":
                raise RuntimeError(f"nixl ceiling {op} failed (state {state})")
        finally:
            mem.agent.release_xfer_handle(handle)
            mem.release(held)

    def measure(self, op: str, duration: float) -> tuple[float, float]:
        """(GB/s, mean µs per transfer) over about ``duration`` seconds."""
        xop = "READ" if op == "get" else "WRITE"
        n, t0 = 0, time.perf_counter()
        while True:
            self._one(xop, n % self.slots)
            n += 1
            secs = time.perf_counter() - t0
            if secs >= duration and n >= 4:
                return self.nbytes * n / secs / 1e9, secs / n * 1e6

    def close(self) -> None:
        from ..transport import nixl

        if self._mem is not None:
            self._mem.release(getattr(self, "_pins", []))
            self._mem = None
        if self._key is not None:
            nixl._unpeer(self._key)
            self._key = None
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except Exception:  # noqa: BLE001 - a peer that does not exit is killed
                self._proc.kill()
                self._proc.wait()
        self._err.close()


def _ceiling(name: str, op: str, size: int, batch: int, duration: float, pysock, span: int,
             process: dict[str, CmaCeiling | NixlCeiling] | None = None) -> tuple[float, float]:
    """(GB/s, p50 us) of one ceiling cell (for rtt-*, GB/s of the 32-byte objects)."""
    from .. import _native

    nbytes = size * batch
    if name == "python-socket":
        cell = pysock.measure(op, nbytes, 1, duration)
        return cell.gbps, cell.p50_us
    if name in PROCESS_CEILINGS:
        assert process is not None
        return process[name].measure(op, duration)
    fns = {
        "memcpy": lambda it: _native.memcpy_ceiling(nbytes, it),
        "memcpy-cold": lambda it: _native.memcpy_ceiling(nbytes, it, max(span, 2 * nbytes)),
        "c-socket": lambda it: _native.socket_ceiling(nbytes, it, op == "put"),
        "rtt-tcp": lambda it: _native.socket_ceiling(RTT_BYTES, it, False),
        "rtt-unix": lambda it: _native.socket_ceiling(RTT_BYTES, it, False, True),
    }
    fn = fns[name]
    moved = RTT_BYTES if name.startswith("rtt-") else nbytes
    # calibrate the iteration count to about `duration` seconds
    probe = fn(4)
    iters = max(4, int(duration / max(probe / 4, 1e-6)))
    secs = fn(iters)
    return moved * iters / secs / 1e9, secs / iters * 1e6


def _floor_parts(path: str, op: str, med: dict[str, "Row"], nbytes: int) -> tuple[int, float, str, float]:
    """What the least request of a shm or nixl ``path`` takes here (see the module doc): its round trips on the
    control socket, each of ``rtt_us``, and one copy of the block as the named ``memcpy`` ceiling makes it
    (``copy_us``): ``(round_trips, rtt_us, copy_ceiling, copy_us)``."""
    # ceilings report the mean time per exchange; nixl's control frames go over TCP
    rtt = med["rtt-unix" if PATHS[path][1] == "shm" else "rtt-tcp"].p50_us
    copy = "memcpy" if op == "get" else "memcpy-cold"
    return (1 if op == "get" else 2), rtt, copy, nbytes / (med[copy].gbps * 1e3)


def _floor_us(path: str, op: str, med: dict[str, "Row"], nbytes: int) -> float:
    """The least time in µs one request of ``path`` could take here (see the module doc)."""
    if PATHS[path][1] not in ("shm", "nixl"):
        return nbytes / (med["c-socket"].gbps * 1e3)
    trips, rtt, _, copy_us = _floor_parts(path, op, med, nbytes)
    return trips * rtt + copy_us


def _start_redis(args: argparse.Namespace, skipped: dict[str, str]):
    """The Redis reference server for this run, or None (the reason then in ``skipped["redis"]``)."""
    from . import redis

    if getattr(args, "no_redis", False):
        skipped["redis"] = "--no-redis"
        return None
    if args.batch != 1:
        skipped["redis"] = "only with --batch 1 (redis-benchmark sends one value per request)"
        return None
    reason = redis.unavailable()
    if reason:
        skipped["redis"] = reason
        return None
    try:
        return redis.RedisServer(args.size)
    except Exception as e:  # noqa: BLE001 - reported in the table, the rest of the run goes on
        skipped["redis"] = f"redis-server did not start: {e}"
        return None


def _start_mooncake(args: argparse.Namespace, skipped: dict[str, str]):
    """The Mooncake Store peer of this run (:class:`kvfabric.bench.mooncake_store.MooncakePeer`), or None (the
    reason then in ``skipped["mooncake"]``)."""
    from .mooncake_store import MooncakePeer, NotAvailable

    if getattr(args, "no_mooncake", False):
        skipped["mooncake"] = "--no-mooncake"
        return None
    if args.batch != 1:
        skipped["mooncake"] = "only with --batch 1 (one object per call, as measured)"
        return None
    try:
        return MooncakePeer(args.size)
    except NotAvailable as e:
        skipped["mooncake"] = str(e)
    except RuntimeError as e:
        skipped["mooncake"] = f"Mooncake Store did not start: {e}"
    return None


def run(args: argparse.Namespace) -> dict:
    from .. import transport
    from .transport import PythonSocketCeiling

    avail = set(transport.available())
    names = [n for n in args.paths if PATHS[n][1] in avail]
    skipped = {n: transport.unavailable().get(PATHS[n][1], "unavailable") for n in args.paths if n not in names}
    ceilings = list(CEILINGS)
    span = parse_size(args.capacity)
    paths = {}
    pysock = PythonSocketCeiling()
    pysock.open(1)
    rows: list[Row] = []
    peers: dict = {}   # the peer stores of this run, measured in the same rounds: redis, mooncake
    process: dict[str, CmaCeiling | NixlCeiling] = {}
    try:
        for c, bounded in PROCESS_CEILINGS.items():
            if any(n in bounded for n in names):
                nbytes = args.size * args.batch
                process[c] = (CmaCeiling(nbytes, span, args.buffer_offset) if c == "cma" else  # ucx-*: the paths' UCX
                              NixlCeiling(NIXL_TLS[bounded[0]], nbytes, span, args.buffer_offset))
                ceilings.append(c)
        for n in names:
            paths[n] = _Path(n, args.size, args.batch, args.capacity, shlex.split(args.native_args),
                             args.buffer_offset)
        for name, start in (("redis", _start_redis), ("mooncake", _start_mooncake)):
            srv = start(args, skipped)
            if srv is not None:
                peers[name] = srv
        for op in ("get", "put"):
            samples: dict[str, list[tuple[float, float, float | None, float | None]]] = {}
            for _ in range(args.repeat):
                for c in ceilings:
                    gbps, p50 = _ceiling(c, op, args.size, args.batch, args.duration, pysock, span, process)
                    samples.setdefault(c, []).append((gbps, p50, None, None))
                for n, pth in paths.items():
                    secs, moved, cpu, p50, p99 = pth.measure(op, args.duration)
                    samples.setdefault(n, []).append((moved / secs / 1e9, p50 * 1e6, cpu / (moved / 1e9), p99 * 1e6))
                for peer, srv in list(peers.items()):
                    try:
                        g, p50, p99, cpu = srv.measure(op, args.duration)
                        samples.setdefault(peer, []).append((g, p50, cpu, p99))
                    except Exception as e:  # noqa: BLE001 - a reference failing must not lose the other rows
                        skipped[peer] = f"{peer} failed: {e}"
                        srv.close()
                        del peers[peer]
                        samples.pop(peer, None)
            med = {}
            for name, vals in samples.items():
                ranked = sorted(vals, key=lambda v: v[0])
                g, p50, cpu, p99 = ranked[(len(ranked) - 1) // 2]
                row = Row(name, op, args.size, args.batch, g, p50, p99, cpu, samples=[v[0] for v in vals])
                med[name] = row
                rows.append(row)
            nbytes = args.size * args.batch
            for peer in PEERS:
                if peer in med:
                    med[peer].ratio["c-socket"] = med[peer].gbps / med["c-socket"].gbps
            for name in paths:
                for c in ("c-socket", "memcpy", "memcpy-cold", "python-socket", *PEERS, *PROCESS_CEILINGS):
                    if c in med and name in PROCESS_CEILINGS.get(c, (name,)):
                        med[name].ratio[c] = med[name].gbps / med[c].gbps
                med[name].floor_us = _floor_us(name, op, med, nbytes)
                med[name].ratio["floor"] = med[name].floor_us / (nbytes / (med[name].gbps * 1e3))
    finally:
        pysock.close()
        for pc in process.values():
            pc.close()
        for p in paths.values():
            p.close()
        for srv in peers.values():
            srv.close()
    by = {(r.name, r.op): r for r in rows}
    targets = []
    for op in ("get", "put"):
        if ("native", op) in by:
            r = by[("native", op)].ratio["c-socket"]
            targets.append({"cell": f"native {op}", "vs": "c-socket", "ratio": r, "goal": 0.9, "met": r >= 0.9})
        if ("native", op) in by and ("redis", op) in by:
            r = by[("native", op)].ratio["redis"]
            targets.append({"cell": f"native {op}", "vs": "redis", "ratio": r, "goal": 1.0, "met": r >= 1.0})
        if ("shm", op) in by:
            r = by[("shm", op)].ratio["memcpy"]
            t = {"cell": f"shm {op}", "vs": "memcpy", "ratio": r, "goal": 0.5, "met": r >= 0.5}
            # the time a request may take to meet the goal vs the round trips it must wait for
            budget_us = args.size * args.batch / (0.5 * by[("memcpy", op)].gbps * 1e3)
            trips = 1 if op == "get" else 2
            rtt_us = by[("rtt-unix", op)].p50_us
            if trips * rtt_us >= budget_us:
                t["note"] = (f"unreachable here with {trips} round trip(s) per request: the goal leaves "
                             f"{budget_us:.0f} us per request, one unix-socket round trip alone took {rtt_us:.0f} us")
            targets.append(t)
        for sm in ("nixl-sm", "nixl-sm+reg"):  # issue 24: nixl over UCX shared memory vs memcpy (cold) and shm
            if (sm, op) not in by:
                continue
            r = by[(sm, op)].ratio["memcpy-cold"]
            t = {"cell": f"{sm} {op}", "vs": "memcpy-cold", "ratio": r, "goal": 0.5, "met": r >= 0.5}
            cma_gbps = by[("cma", op)].gbps if ("cma", op) in by else None
            if cma_gbps is not None and cma_gbps < 0.5 * by[("memcpy-cold", op)].gbps:
                t["note"] = (f"unreachable over UCX's cma here: the cross-process copy alone ran at {cma_gbps:.2f} "
                             f"GB/s = {cma_gbps / by[('memcpy-cold', op)].gbps:.2f}x memcpy-cold; "
                             f"{sm} reached {by[(sm, op)].ratio['cma']:.2f}x cma")
            elif cma_gbps is not None:  # the copy could: the control frames' TCP round trips and the copy together?
                budget_us = args.size * args.batch / (0.5 * by[("memcpy-cold", op)].gbps * 1e3)
                trips = 1 if op == "get" else 2
                rtt_us, copy_us = by[("rtt-tcp", op)].p50_us, args.size * args.batch / (cma_gbps * 1e3)
                if trips * rtt_us + copy_us >= budget_us:
                    t["note"] = (f"unreachable here with {trips} TCP round trip(s) per request: the goal leaves "
                                 f"{budget_us:.0f} us, one round trip took {rtt_us:.0f} us and UCX's cma copy "
                                 f"{copy_us:.0f} us; {sm} reached {by[(sm, op)].ratio['cma']:.2f}x cma")
            if ("ucx-sm", op) in by:  # NIXL's own transfer over UCX shared memory, same run
                raw = by[("ucx-sm", op)].gbps / by[("memcpy-cold", op)].gbps
                t["note"] = (f"{t['note']}; " if "note" in t else "unreachable over UCX shared memory here: "
                             if raw < 0.5 else "") + (
                    f"NIXL's own {'READ' if op == 'get' else 'WRITE'} over UCX shared memory ran at "
                    f"{by[('ucx-sm', op)].gbps:.2f} GB/s = {raw:.2f}x memcpy-cold; {sm} reached "
                    f"{by[(sm, op)].ratio['ucx-sm']:.2f}x it")
            targets.append(t)
            if ("shm", op) in by:
                r = by[(sm, op)].gbps / by[("shm", op)].gbps
                targets.append({"cell": f"{sm} {op}", "vs": "shm", "ratio": r, "goal": 1.0, "met": r >= 1.0})
        for tcp in ("nixl-tcp", "nixl-tcp+reg"):
            if op == "put" and (tcp, op) in by:
                r = by[(tcp, op)].ratio["c-socket"]
                t = {"cell": f"{tcp} put", "vs": "c-socket", "ratio": r, "goal": 0.8, "met": r >= 0.8}
                if ("ucx-tcp", op) in by:  # NIXL's own WRITE over UCX tcp, same run: alone, and with the frames
                    raw = by[("ucx-tcp", op)]
                    budget_us = args.size * args.batch / (0.8 * by[("c-socket", op)].gbps * 1e3)
                    rtt_us = by[("rtt-tcp", op)].p50_us
                    why = ("unreachable over UCX tcp here: " if raw.p50_us >= budget_us else
                           "unreachable here with 2 TCP round trips per request (reserve, commit): "
                           if raw.p50_us + 2 * rtt_us >= budget_us else "")
                    t["note"] = (f"{why}the goal leaves {budget_us:.0f} us, NIXL's own WRITE over UCX tcp took "
                                 f"{raw.p50_us:.0f} us ({raw.gbps / by[('c-socket', op)].gbps:.2f}x c-socket), one "
                                 f"round trip {rtt_us:.0f} us; {tcp} reached {by[(tcp, op)].ratio['ucx-tcp']:.2f}x it")
                targets.append(t)
        if ("tcp", op) in by:
            for n in ("native", "shm"):
                if (n, op) in by:
                    ok = by[(n, op)].gbps > by[("tcp", op)].gbps
                    targets.append({"cell": f"{n} {op}", "vs": "tcp", "ratio": by[(n, op)].gbps / by[("tcp", op)].gbps,
                                    "goal": ">1", "met": ok})
    targets += _client_targets(by)
    return {
        "benchmark": "transport-native",
        "meta": {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
                 "kernel": platform.release(), "cpus": os.cpu_count(), "size": args.size, "batch": args.batch,
                 "buffer_offset": args.buffer_offset, "duration_s": args.duration, "repeat": args.repeat,
                 "statistic": "median of repeats",
                 "clients": 1, "argv": sys.argv[1:], "skipped": skipped},
        "rows": [asdict(r) for r in rows],
        "targets": targets,
    }


#: issue 20: (client path, op, ceiling or path it is divided by, goal)
CLIENT_GOALS = (
    ("client-native", "get", "c-socket", 0.9), ("client-native", "put", "c-socket", 0.9),
    ("client-native", "get", "client-tcp", 1.0), ("client-native", "put", "client-tcp", 1.0),
    ("client-shm", "get", "memcpy-cold", 0.5), ("client-shm", "put", "c-socket", 0.9),
)


def _client_targets(by: dict[tuple[str, str], Row]) -> list[dict]:
    """The Client's goals (:data:`CLIENT_GOALS`) among the rows measured."""
    out = []
    for name, op, vs, goal in CLIENT_GOALS:
        if (name, op) in by and (vs, op) in by and by[(vs, op)].gbps > 0:
            row = by[(name, op)]
            r = row.gbps / by[(vs, op)].gbps
            t = {"cell": f"{name} {op}", "vs": vs, "ratio": r, "goal": goal, "met": r >= goal}
            if name == "client-shm" and all((c, op) in by for c in ("rtt-unix", "memcpy", "memcpy-cold")):
                # the least a shm request takes here, the row's own floor: its round trips and one copy
                nbytes = row.size * row.batch
                budget_us = nbytes / (goal * by[(vs, op)].gbps * 1e3)
                trips, rtt_us, copy, copy_us = _floor_parts(name, op, {c: by[(c, op)] for c in
                                                                       ("rtt-unix", "memcpy", "memcpy-cold")}, nbytes)
                least = trips * rtt_us + copy_us
                t["note"] = (f"{'unreachable here: ' if least >= budget_us else ''}the goal leaves "
                             f"{budget_us:.0f} us per call; {trips} unix-socket round trip(s) of {rtt_us:.0f} us and "
                             f"one copy of {copy_us:.0f} us ({copy}) take {least:.0f} us before the checksum and "
                             f"the Client's own work; the call took {nbytes / (row.gbps * 1e3):.0f} us")
            out.append(t)
    return out


def print_table(report: dict) -> None:
    m = report["meta"]
    print(f"block {m['size'] // 1024} KiB x {m['batch']} per request, one client, loopback, "
          f"median of {m['repeat']} x {m['duration_s']} s; kernel {m['kernel']}, {m['cpus']} cpus; "
          f"client buffers {m.get('buffer_offset', 0)} bytes past a page")
    hdr = (f"{'path':<13} {'op':<4} {'GB/s':>7} {'p50 us':>8} {'p99 us':>8} {'/c-socket':>9} {'/memcpy':>8} {'/mc-cold':>8} "
           f"{'/py-sock':>8} {'/redis':>7} {'/mooncake':>9} {'/floor':>7} {'srv CPU s/GB':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in report["rows"]:
        ratio = r["ratio"]
        cpu = r["server_cpu_s_per_gb"]
        def cell(key: str, width: int) -> str:
            return f"{ratio[key]:>{width}.2f}" if key in ratio else " " * width

        p99 = "" if r["p99_us"] is None else f"{r['p99_us']:.0f}"
        print(f"{r['name']:<13} {r['op']:<4} {r['gbps']:>7.2f} {r['p50_us']:>8.0f} {p99:>8} {cell('c-socket', 9)} "
              f"{cell('memcpy', 8)} {cell('memcpy-cold', 8)} {cell('python-socket', 8)} {cell('redis', 7)} "
              f"{cell('mooncake', 9)} {cell('floor', 7)} "
              f"{'' if cpu is None else f'{cpu:.3f}':>12}")
    print("(rtt-* rows: GB/s of 32-byte objects; p50 us there is the round-trip time. Ceilings' p50 us is the mean.)")
    if any(r["name"] == "redis" for r in report["rows"]):
        print("(redis rows: redis-benchmark -c 1 against a redis-server started by this run; put = SET; GB/s from its "
              "requests/s; its p50/p99 are its own histogram, which for a large GET reply stops before the whole "
              "value is read: compare GB/s)")
    if any(r["name"] == "mooncake" for r in report["rows"]):
        print("(mooncake rows: Mooncake Store over its TCP transport, a master and one holder started by this run, "
              "one client in this process: get_into of one key / put_from of a fresh key into registered buffers; "
              "srv CPU is the master's and the holder's)")
    for t in report["targets"]:
        note = f" ({t['note']})" if "note" in t else ""
        print(f"target {t['cell']} vs {t['vs']}: {t['ratio']:.2f}x (goal {t['goal']}): "
              f"{'met' if t['met'] else 'NOT met'}{note}")
    for n, why in report["meta"]["skipped"].items():
        print(f"skipped {n}: {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench transport-native", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=MiB, help="block size (default 1MiB)")
    ap.add_argument("--batch", type=int, default=1, help="blocks per request (default 1)")
    ap.add_argument("--paths", type=lambda s: s.split(","), default=[p for p in PATHS if p not in REGISTERED],
                    help=f"comma list of {list(PATHS)}")
    ap.add_argument("--registered", action="store_true",
                    help=f"also run {', '.join(REGISTERED)} (GET into registered buffers)")
    ap.add_argument("--buffer-offset", type=int, default=0, metavar="BYTES",
                    help="the client's buffers start this far past a page boundary (default 0; numpy arrays of "
                         "1 MiB or more sit at 16: see the module doc, Buffers)")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per cell")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions; the median is reported")
    ap.add_argument("--capacity", default="256MiB", help="capacity of each server")
    ap.add_argument("--native-args", default="", metavar="ARGS",
                    help='extra command-line arguments for the native servers, e.g. "--evict-watermarks 0,0"')
    ap.add_argument("--no-redis", action="store_true", help="leave out the redis-benchmark reference row")
    ap.add_argument("--no-mooncake", action="store_true",
                    help="leave out the Mooncake Store reference row (it runs where the mooncake package imports)")
    ap.add_argument("--out", default="bench-results/transport_native.json")
    args = ap.parse_args(argv)
    if args.registered:
        args.paths += [p for p in REGISTERED if p not in args.paths]
    bad = [p for p in args.paths if p not in PATHS]
    if bad or args.batch < 1 or not 0 < args.size <= 64 * MiB or args.duration <= 0 or args.repeat < 1:
        ap.error(f"bad arguments (unknown paths {bad}?)")
    if not 0 <= args.buffer_offset < PAGE:
        ap.error(f"--buffer-offset must be 0..{PAGE - 1}")
    try:
        from .. import _native  # noqa: F401
    except ImportError as e:
        ap.error(f"the C extension is not built: {e}")
    report = run(args)
    print_table(report)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
