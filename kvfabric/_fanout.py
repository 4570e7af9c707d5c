"""How one client call reaches several shards at once (a private part of :class:`kvfabric.Client`).

Two drivers, one outcome: :meth:`_FanOut._fan_out` runs one job per shard on
the client's thread pool (any request, a connect, a GET receiving into the
caller's buffers), and :meth:`_FanOut._converse` runs small request/reply
conversations (LOOKUP, EXISTS) from the calling thread, all shards' requests
sent at once and the replies read as they fully arrive, handing a shard to
the pool only when it needs a connect or a busy wait. Either way a shard that
fails, or runs past the call's deadline, costs only its own keys: counted,
marked down when the connection is out of step, never raised (degrade to a
miss). Programming errors propagate.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, wait
from dataclasses import dataclass

from . import protocol, transport
from ._shard import _Busy, _Down, _Shard
from .errors import FATAL_CODES, DeadlineExceeded, KVFabricError, RemoteError
from .transport.base import SocketConnection
from .transport.native import NativeConnection, send_requests

log = logging.getLogger("kvfabric.client")

Conversation = Generator[protocol.Message, transport.Reply, None]


@dataclass(slots=True, eq=False)
class _Flight:
    """One shard's conversation in :meth:`Client._pipeline`: its connection and the request out."""

    pos: int
    shard: _Shard
    conn: SocketConnection
    talk: Conversation
    fd: int = -1
    msg: protocol.Message | None = None
    rid: int = 0  # request id of the request out, 0 when none is
    done: bool = False

    def __post_init__(self) -> None:
        self.fd = self.conn.fileno()

    def finish(self) -> None:
        """Hand the connection back (a closed one is dropped by the pool); once."""
        if not self.done:
            self.done = True
            self.shard.release(self.conn)


#: Requests of at most this many key bytes go out from the calling thread, pipelined over the shards
#: (:meth:`Client._converse`). Well under a fresh loopback connection's receive window, so a send
#: to a server that is not reading still completes at once and cannot hold up the other shards.
_SMALL_REQUEST_BYTES = 64 << 10


def _small(keys: list[bytes], idx: list[int]) -> bool:
    """Whether the keys ``idx`` make a small request (each key costs up to 3 bytes of framing)."""
    if len(idx) * (protocol.MAX_KEY_BYTES + 3) <= _SMALL_REQUEST_BYTES:
        return True
    return sum(len(keys[i]) + 3 for i in idx) <= _SMALL_REQUEST_BYTES


def _as_job(make: Callable[[], Conversation]) -> Callable[[transport.Connection, float], None]:
    """A conversation as a :meth:`Client._fan_out` job: its requests one after another on one connection."""
    def job(conn: transport.Connection, deadline: float) -> None:
        talk = make()
        reply = None
        while True:
            try:
                msg = talk.send(reply)
            except StopIteration:
                return
            reply = conn.request(msg, deadline=deadline)
    return job


class _FanOut:
    """The fan-out half of :class:`kvfabric.Client` (a base class: it uses the client's ``_pool``,
    ``_counters`` and ``_by_index``)."""

    def _on_shard(self, shard: _Shard, deadline: float, job: Callable[[transport.Connection, float], None]) -> bool:
        """Run ``job`` on a pooled connection of ``shard``; False when the shard failed it."""
        try:
            conn = shard.acquire(deadline)
        except _Down:
            self._counters.add(skipped_down=1)
            return False
        except _Busy:
            self._counters.add(timeouts=1)
            return False
        except KVFabricError as e:
            self._counters.add(shard_errors=1)
            shard.mark_down(e)
            return False
        try:
            job(conn, deadline)
            return True
        except KVFabricError as e:
            self._shard_failed(shard, e, deadline)
            return False
        finally:
            shard.release(conn)

    def _shard_failed(self, shard: _Shard, e: KVFabricError, deadline: float) -> None:
        """Count a shard's failed request; mark the shard down unless the server answered a
        non-fatal error (the connection is then still in step)."""
        if isinstance(e, RemoteError):
            self._counters.add(shard_errors=1)
            if e.code in FATAL_CODES:
                shard.mark_down(e)
            else:
                log.debug("kvfabric: %s answered %s", shard.address, e)
            return
        self._counters.add(shard_errors=1, timeouts=int(time.monotonic() >= deadline))
        shard.mark_down(e)

    def _fan_out(self, jobs: list[tuple[_Shard, Callable[[transport.Connection, float], None]]], deadline: float) -> list[bool]:
        """Run one job per shard in parallel; returns which succeeded.

        Re-raises a programming error from any job, but only after every job
        has stopped.
        """
        futures: list[Future] = [self._pool.submit(self._on_shard, s, deadline, j) for s, j in jobs[1:]]
        results: list[bool] = []
        error: BaseException | None = None
        if jobs:
            try:
                results.append(self._on_shard(jobs[0][0], deadline, jobs[0][1]))
            except BaseException as e:  # programming error: still wait for the others
                error = e
                results.append(False)
        late, late_error = self._wait_for(futures, deadline)
        results += late
        error = error or late_error
        if error is not None:
            raise error
        return results

    def _wait_for(self, futures: list[Future], deadline: float) -> tuple[list[bool], BaseException | None]:
        """Wait for pool jobs until ``deadline``; jobs not started by then never start. Returns
        each job's result (False when cancelled or failed) and the first programming error."""
        results: list[bool] = []
        error: BaseException | None = None
        if futures:
            _, late = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
            for f in late:
                f.cancel()  # not started yet: never will
            if late:
                wait(late)  # started: they stop at their next socket op, deadline passed
        for f in futures:
            if f.cancelled():
                self._counters.add(timeouts=1)
                results.append(False)
            elif f.exception() is not None:
                error = error or f.exception()
                results.append(False)
            else:
                results.append(f.result())
        return results, error

    # A conversation is one shard's part of a call written once for both drivers: a generator
    # that yields request messages (no payload either way) and is sent each one's Reply.

    def _converse(self, talks: list[tuple[_Shard, Callable[[], Conversation], bool]], deadline: float) -> list[bool]:
        """Run one conversation per shard; returns which succeeded (as :meth:`_fan_out`).

        ``talks`` holds ``(shard, make_conversation, small)``. A small
        conversation on a shard with an idle pooled socket connection runs on
        this thread, pipelined across shards: every shard's request is sent,
        then replies are read as they arrive (``poll``), each one reading only
        a reply that has fully arrived, so a slow or dead shard holds up no
        other. The rest (large requests, or no idle connection: a connect or a
        wait for a busy one) run on the pool as :meth:`_fan_out` jobs. The
        outcomes are :meth:`_fan_out`'s: a shard past the deadline is closed,
        counted and marked down, nothing waits past ``deadline``, and a
        programming error is raised after every shard has stopped.
        """
        results = [False] * len(talks)
        flights: list[_Flight] = []
        pooled: list[int] = []
        for pos, (shard, make, small) in enumerate(talks):
            conn = None
            if small:
                try:
                    conn = shard.acquire_idle()
                except _Down:
                    self._counters.add(skipped_down=1)
                    continue
                if conn is not None and not isinstance(conn, SocketConnection):
                    shard.release(conn)
                    conn = None
            if conn is None:
                pooled.append(pos)
            else:
                flights.append(_Flight(pos, shard, conn, make()))
        futures = [self._pool.submit(self._on_shard, talks[p][0], deadline, _as_job(talks[p][1])) for p in pooled]
        error: BaseException | None = None
        try:
            self._pipeline(flights, deadline, results)
        except BaseException as e:  # programming error: still wait for the pool's jobs
            error = e
        late, late_error = self._wait_for(futures, deadline)
        for p, ok in zip(pooled, late):
            results[p] = ok
        error = error or late_error
        if error is not None:
            raise error
        return results

    def _pipeline(self, flights: list[_Flight], deadline: float, results: list[bool]) -> None:
        """Drive ``flights`` on this thread until each is done, failed or past ``deadline``."""
        waiting: dict[int, _Flight] = {}  # fd -> flight whose reply has not started to arrive
        partial: dict[int, _Flight] = {}  # fd -> flight whose reply has partly arrived
        poller = select.poll()
        try:
            for f in self._start(flights, deadline, results):
                waiting[f.fd] = f
                poller.register(f.fd, select.POLLIN)
            while waiting or partial:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # A partly arrived reply is checked again every millisecond: poll cannot wait for "more".
                step = min(left, 0.001) if partial else left
                if waiting:
                    events = poller.poll(step * 1000)
                else:
                    time.sleep(step)
                    events = []
                ready = []
                for fd, _ in events:
                    poller.unregister(fd)
                    ready.append(waiting.pop(fd))
                ready += [partial.pop(fd) for fd in [fd for fd, f in partial.items() if f.conn.reply_ready()]]
                for f in ready:
                    if not f.conn.reply_ready():
                        partial[f.fd] = f
                        continue
                    try:
                        reply = f.conn.recv_reply(f.msg, f.rid, deadline=deadline)
                    except KVFabricError as e:
                        self._shard_failed(f.shard, e, deadline)
                        f.finish()
                        continue
                    f.rid = 0  # the stream is in step again
                    if self._advance(f, reply, deadline, results):
                        waiting[f.fd] = f
                        poller.register(f.fd, select.POLLIN)
        finally:
            for f in flights:
                if f.done:
                    continue
                if f.rid:  # a request is out (past the deadline, or a programming error): out of step
                    f.conn.close()
                    if time.monotonic() >= deadline:
                        self._shard_failed(f.shard, DeadlineExceeded(
                            f"{f.msg.op.name if f.msg else 'request'} to {f.shard.address} ran past its deadline"),
                            deadline)
                f.finish()

    def _start(self, flights: list[_Flight], deadline: float, results: list[bool]) -> list[_Flight]:
        """Send every flight's first request; the flights now awaiting a reply. The requests on
        native connections (``native``, and ``shm``'s unix socket) go out in one submission
        (:func:`transport.native.send_requests`): sent one by one, each send wakes a server that a
        loaded machine runs at once, in place of this thread, which then waits its turn again
        before it can send the next (four shards: four extra waits in every call's tail)."""
        batch: list[_Flight] = []
        out: list[_Flight] = []
        for f in flights:
            if not isinstance(f.conn, NativeConnection):
                if self._advance(f, None, deadline, results):
                    out.append(f)
                continue
            try:
                f.msg = f.talk.send(None)
            except StopIteration:
                results[f.pos] = True
                f.finish()
                continue
            batch.append(f)
        if len(batch) == 1:  # nothing to batch: the plain send
            f = batch.pop()
            if self._send(f, deadline):
                out.append(f)
        sent = send_requests([f.conn for f in batch], [f.msg for f in batch], deadline=deadline) if batch else []
        for f, rid in zip(batch, sent):
            if isinstance(rid, KVFabricError):
                self._shard_failed(f.shard, rid, deadline)
                f.finish()
            else:
                f.rid = rid
                out.append(f)
        return out

    def _send(self, f: _Flight, deadline: float) -> bool:
        """Send ``f.msg``; False (the shard failed, the flight finished) when that fails."""
        try:
            f.rid = f.conn.send_request(f.msg, deadline=deadline)
            return True
        except KVFabricError as e:
            f.rid = 0
            self._shard_failed(f.shard, e, deadline)
        f.finish()
        return False

    def _advance(self, f: _Flight, reply: transport.Reply | None, deadline: float, results: list[bool]) -> bool:
        """Give ``reply`` (None: start) to a flight's conversation and send its next request.
        True while a reply is awaited; otherwise the flight is over (result recorded, connection
        released). A programming error propagates with the flight left to :meth:`_pipeline`."""
        try:
            f.msg = f.talk.send(reply)
            f.rid = f.conn.send_request(f.msg, deadline=deadline)
            return True
        except StopIteration:
            results[f.pos] = True
        except KVFabricError as e:
            f.rid = 0
            self._shard_failed(f.shard, e, deadline)
        f.finish()
        return False
