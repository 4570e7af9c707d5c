"""Per-shard connection state for :class:`kvfabric.client.Client` (private).

The client (``kvfabric/client.py``) decides what to send where: routing,
batching, fan-out, deadlines and degrade-to-miss. This module owns how it
gets a connection to one server and what happens when that server fails:

* :class:`_Shard`: one server's small connection pool (at most
  ``connections_per_server`` connections, idle ones reused), the server's
  HELLO facts (transport, limits, server id), and its up/down state. A shard
  marked down closes its idle connections, drops the ones checked out when
  they come back (a generation counter), and makes every ``acquire`` raise
  :class:`_Down` at once until it is reconnected. Routing identity: a shard
  routes under :attr:`_Shard.route_id`, the server id its HELLO reported, or
  before any HELLO its ``hint`` (the id membership published, else the
  configured address); ``on_identity`` tells the client when the HELLO id
  changes that; ``on_state`` when it is marked down or comes back up (a client
  following a dynamic membership routes around down shards). A shard that
  left the membership is retired (:meth:`_Shard.retire`): its connections
  close and it answers :class:`_Down` forever.
  ``acquire_idle`` hands out an idle connection without ever waiting or
  connecting (the client's calling-thread fan-out).
* :class:`_Reconnector`: one daemon thread per client that reconnects down
  shards when their backoff is due (``reconnect_backoff_s`` doubling up to
  ``reconnect_backoff_max_s`` per failed attempt, reset on success).
* :class:`_Counters`: the client's thread-safe counters (``stats()["client"]``).
  A server that does not prove it holds the pool token (protocol 3,
  :func:`kvfabric.transport.base.hello`) is refused in ``_connect``: counted
  (``servers_refused``), logged with its address, and the shard stays down.
* :class:`_Registration`: the buffers the caller asked to register
  (``Client.register_buffers``); each ``native`` or ``nixl`` connection picks
  up the current set when it is next acquired.
* :class:`_Down`, :class:`_Busy`: how ``_Shard.acquire`` says "skip this
  shard" (down) or "no connection freed up before the deadline" (busy).

Nothing here raises out of the client's public calls: the client turns these
exceptions and connect errors into misses and counted drops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from . import protocol, transport
from .config import ClientConfig
from .errors import AuthError, KVFabricError
from .metrics import CLIENT, names

# The client's logger: these messages are part of the client's behaviour.
log = logging.getLogger("kvfabric.client")


class _Down(Exception):
    """Internal: the shard is marked down; its keys miss without a request."""


class _Busy(Exception):
    """Internal: every pooled connection of the shard stayed busy until the deadline."""


#: names, types and meanings: kvfabric/metrics.py CLIENT (a GET's keys count in hits / misses, a
#: lookup's in lookup_hits / lookup_misses, so a block looked up and then fetched is one hit, not two)
_COUNTERS = names(CLIENT)


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v = dict.fromkeys(_COUNTERS, 0)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, n in kw.items():
                self._v[k] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._v)


class _Registration:
    """The client's registered receive buffers, applied lazily to each native connection.

    :meth:`set` replaces the set (``None`` drops it) and bumps a generation;
    :meth:`apply` brings one connection up to date the next time it is
    acquired. ``native`` connections register them with io_uring, ``nixl`` ones
    with NIXL (``tcp`` cannot, ``shm`` copies out of the arena). A connection that cannot register (io_uring
    setup or the kernel refusing the pinning, e.g. over RLIMIT_MEMLOCK) keeps
    receiving with recvmsg: the failure is logged once per generation and
    counted, never raised out of a GET.
    """

    def __init__(self, counters: _Counters) -> None:
        self._lock = threading.Lock()
        self._counters = counters
        self.gen = 0
        self.buffers: list | None = None
        self._warned_gen = -1

    def set(self, buffers: list | None) -> None:
        with self._lock:
            self.gen += 1
            self.buffers = buffers

    def stats(self) -> dict[str, int]:
        with self._lock:
            bufs = self.buffers or []
            return {"buffers": len(bufs), "bytes": sum(memoryview(b).nbytes for b in bufs)}

    def apply(self, conn: transport.Connection) -> None:
        if conn.name not in ("native", "nixl") or getattr(conn, "_kvf_reg_gen", 0) == self.gen:
            return
        with self._lock:
            gen, buffers = self.gen, self.buffers
        conn._kvf_reg_gen = gen  # type: ignore[attr-defined]  # not retried until the set changes
        try:
            if buffers is None:
                conn.unregister_buffers()  # type: ignore[attr-defined]
            else:
                conn.register_buffers(buffers)  # type: ignore[attr-defined]
                self._counters.add(buffer_registrations=1)
        except Exception as e:  # an optimisation only: never fails the GET that acquired the connection
            self._counters.add(buffer_registration_failures=1)
            with self._lock:
                warn, self._warned_gen = self._warned_gen != gen, gen
            if warn:
                log.warning("kvfabric: cannot register receive buffers on %s (%s); GETs there %s", conn.address, e,
                            "use recvmsg" if conn.name == "native" else "register their buffers per call")


class _Reconnector:
    """The background thread that reconnects down shards when their backoff is due.

    ``is_closed`` tells it when the client is closed. Shards call :meth:`wake`
    when they are marked down, so the thread recomputes its next due time.
    """

    def __init__(self, is_closed: Callable[[], bool], join_timeout_s: float) -> None:
        self._is_closed = is_closed
        self._join_timeout_s = join_timeout_s
        self._cond = threading.Condition()
        self._shards: Callable[[], Sequence[_Shard]] = tuple
        self._thread = threading.Thread(target=self._loop, name="kvfabric-reconnect", daemon=True)

    def start(self, shards: Callable[[], Sequence[_Shard]]) -> None:
        """Start the thread; ``shards()`` returns the current shards (membership may change them)."""
        self._shards = shards
        self._thread.start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def join(self) -> None:
        """Wait for the thread to stop (call after the client is closed and :meth:`wake`)."""
        if self._thread.is_alive():
            self._thread.join(timeout=self._join_timeout_s)

    def _loop(self) -> None:
        while not self._is_closed():
            now = time.monotonic()
            shards = self._shards()
            due = [s for s in shards if s.down_until and s.down_until <= now]
            for s in due:
                if self._is_closed():
                    return
                s.try_reconnect()
            with self._cond:
                if self._is_closed():
                    return
                pending = [s.down_until for s in shards if s.down_until]
                timeout = max(0.0, min(pending) - time.monotonic()) if pending else None
                self._cond.wait(timeout)


class _Shard:
    """One server: a small connection pool plus up/down state.

    ``is_closed`` is the owning client's closed flag: connections released
    after the client is closed are closed instead of pooled.
    """

    def __init__(
        self,
        index: int,
        address: str,
        config: ClientConfig,
        counters: _Counters,
        reconnector: _Reconnector,
        is_closed: Callable[[], bool],
        registration: _Registration | None = None,
        hint: str = "",
        on_identity: Callable[[_Shard], None] | None = None,
        on_state: Callable[[_Shard], None] | None = None,
    ) -> None:
        self.index = index  # unique in its client for the client's life (never reused), not a list position
        self.hint = hint or address  # routing id until a HELLO reports the server's own
        self._on_identity = on_identity
        self._on_state = on_state  # told after the shard was marked down or came back up
        self.retired = False
        self._registration = registration
        self.address = address
        self._config = config
        self._counters = counters
        self._reconnector = reconnector
        self._is_closed = is_closed
        self._cond = threading.Condition()
        self._idle: list[transport.Connection] = []
        self._open = 0  # idle + checked out
        # Bumped when the shard is marked down: connections opened before that
        # are closed when released instead of going back to the pool.
        self._gen = 0
        self._conn_gen: dict[int, int] = {}  # id(conn) -> generation it was opened in
        self.down_until = 0.0  # 0.0: up; else monotonic time of the next reconnect attempt
        self.backoff = config.reconnect_backoff_s
        self.last_error = ""
        self.transport: str | None = None
        self.limits = protocol.DEFAULT_LIMITS
        self.server_id = ""

    # -- connections -----------------------------------------------------

    def _connect(self, connect_s: float, hello_s: float) -> transport.Connection:
        """A new connection: ``connect_s`` to reach the server, then ``hello_s`` for its HELLO reply
        (a server that accepted is alive; a late HELLO is load, not a dead shard)."""
        cfg = self._config
        try:
            conn = transport.connect(cfg.transport, self.address, cfg.with_(connect_timeout_s=max(connect_s, 0.001)),
                                     hello_timeout_s=max(hello_s, 0.001))
        except AuthError as e:  # it never got a key, a PUT or a lookup; the caller marks the shard down
            self._counters.add(servers_refused=1)
            log.error("kvfabric: %s; its keys are misses (retried in the background)", e.message)
            raise
        if self.transport is not None and self.transport != conn.name:
            log.warning("kvfabric: %s now uses transport %s (was %s)", self.address, conn.name, self.transport)
        self.transport = conn.name
        lim = conn.hello.limits
        self.limits = lim
        if conn.hello.server_id != self.server_id:
            self.server_id = conn.hello.server_id
            if self._on_identity is not None:
                self._on_identity(self)
        return conn

    @property
    def route_id(self) -> str:
        """The id this shard's keys are routed under (see the module docstring)."""
        return self.server_id or self.hint

    def acquire(self, deadline: float) -> transport.Connection:
        """A connection for the caller's exclusive use; raises _Down, _Busy or a connect error."""
        conn = self._checkout(deadline)
        if self._registration is not None:
            self._registration.apply(conn)
        return conn

    def acquire_idle(self) -> transport.Connection | None:
        """An idle pooled connection at once, or None when none is idle (nothing waits, nothing
        connects: the caller takes the :meth:`acquire` path on a thread for that). Raises _Down."""
        with self._cond:
            if self.down_until:
                raise _Down()
            conn = self._pop_idle()
            if conn is None:
                return None
        if self._registration is not None:
            self._registration.apply(conn)
        return conn

    def _pop_idle(self) -> transport.Connection | None:
        """The most recently used idle connection that can still serve a request, or None; connections
        the server closed meanwhile (its idle timeout, a restart) are dropped here, so a quiet engine's
        next call connects afresh instead of failing on a dead socket. Called with ``_cond`` held."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn
            conn.close()
            self._conn_gen.pop(id(conn), None)
            self._open -= 1
        return None

    def _checkout(self, deadline: float) -> transport.Connection:
        """An idle connection, or a new one while under ``connections_per_server``."""
        with self._cond:
            while True:
                if self.down_until or self.retired:
                    raise _Down()
                conn = self._pop_idle()
                if conn is not None:
                    return conn
                if self._open < self._config.connections_per_server:
                    self._open += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Busy()
                self._cond.wait(left)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Busy()
            gen = self._gen
            conn = self._connect(min(self._config.connect_timeout_s, left), left)
            with self._cond:
                self._conn_gen[id(conn)] = gen
            return conn
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def release(self, conn: transport.Connection) -> None:
        with self._cond:
            if conn.closed or self._is_closed() or self._conn_gen.get(id(conn)) != self._gen:
                conn.close()
                self._conn_gen.pop(id(conn), None)
                self._open -= 1
            else:
                self._idle.append(conn)
            self._cond.notify()

    def mark_down(self, err: BaseException) -> None:
        """Close idle connections and schedule a background reconnect."""
        with self._cond:
            self.last_error = f"{type(err).__name__}: {err}"
            if self.down_until or self.retired:
                return
            self.down_until = time.monotonic() + self.backoff
            self._gen += 1
            idle = self._take_idle()
        for c in idle:
            c.close()
        log.warning("kvfabric: shard %s marked down (%s); retrying in %.2fs", self.address, self.last_error, self.backoff)
        self._reconnector.wake()
        if self._on_state is not None:
            self._on_state(self)

    def try_reconnect(self) -> bool:
        """One reconnect attempt (reconnector thread only). True when the shard is up again."""
        try:
            conn = self._connect(self._config.connect_timeout_s, self._config.timeout_s)
        except Exception as e:  # whatever it is, the shard stays down and is retried later
            if not isinstance(e, KVFabricError):
                log.exception("kvfabric: unexpected error reconnecting %s", self.address)
            with self._cond:
                self.last_error = f"{type(e).__name__}: {e}"
                self.backoff = min(self.backoff * 2, self._config.reconnect_backoff_max_s)
                self.down_until = time.monotonic() + self.backoff
            return False
        with self._cond:
            if self.retired:  # left the membership while this attempt ran
                conn.close()
                return False
            self._conn_gen[id(conn)] = self._gen
            self._idle.append(conn)
            self._open += 1
            self.down_until = 0.0
            self.backoff = self._config.reconnect_backoff_s
            self._cond.notify_all()
        self._counters.add(reconnects=1)
        log.info("kvfabric: shard %s reconnected", self.address)
        if self._on_state is not None:
            self._on_state(self)
        return True

    def close(self) -> None:
        with self._cond:
            idle = self._take_idle()
        for c in idle:
            c.close()

    def retire(self) -> None:
        """The server left the membership: close idle connections, drop checked-out ones when they come
        back, and answer every later ``acquire`` with :class:`_Down` (no reconnects)."""
        with self._cond:
            self.retired = True
            self.down_until = 0.0
            self._gen += 1
            idle = self._take_idle()
        for c in idle:
            c.close()

    def _take_idle(self) -> list[transport.Connection]:
        """Remove every idle connection from the pool and wake waiters; the caller holds
        ``self._cond`` and closes the returned connections after releasing it."""
        idle, self._idle = self._idle, []
        self._open -= len(idle)
        for c in idle:
            self._conn_gen.pop(id(c), None)
        self._cond.notify_all()
        return idle
