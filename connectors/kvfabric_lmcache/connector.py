"""``KVFabricConnector``: LMCache's ``RemoteConnector`` backed by a ``kvfabric.Client``.

LMCache's ``RemoteBackend`` runs the connector's coroutines on its own event
loop thread and wraps it in ``InstrumentedRemoteConnector``, which releases
the memory objects' reference counts after ``put``/``batched_put`` return, so
this class never touches reference counts on the put path. Pool calls block
(sockets), so every coroutine hands its call to a small thread pool
(``io_threads``) and awaits it: a slow put never stalls a get on the loop.

Batched forms are offered, and LMCache uses them:

* ``batched_contains`` / ``batched_async_contains``: the leading hit count,
  ``Client.lookup`` (one LOOKUP per shard, in parallel); with ``pin=True`` the
  servers lease what they found for ``lease_ms`` so it is not evicted before
  the load.
* ``batched_get``: a full-chunk memory object is allocated per key first
  (``local_cpu_backend.allocate(meta_shapes, meta_dtypes, meta_fmt)``), then
  one ``Client.get_into_parts`` (one GET per shard) receives each stored
  object's 256-byte header into a small buffer and its chunk bytes straight
  into the memory object: no staging copy (:mod:`.value` pads the header to
  256 bytes for this). A shorter chunk is copied into an object of its own
  shape; an object in the older unpadded format is fetched whole and copied.
* ``batched_put``: one ``Client.put`` of header+bytes per chunk, staged in
  reused buffers; the copy into them happens on the loop before the put is
  queued for an I/O thread.

LMCache frees its allocator's arena at teardown before it closes this
backend, whatever the reference counts say: every touch of its memory (the
put's copy, the get's allocation and receive) runs under a
:class:`~.memguard.MemoryGuard`, which makes the free wait for the touches in
progress and turns later ones into counted drops and misses.

Failures degrade to misses: a dead, slow or refusing shard is a miss inside
the client already; a ``KVFabricError`` that still escapes (a closed client),
a stored object that does not decode, or an allocation that fails under
memory pressure all count (see :meth:`KVFabricConnector.stats`) and read as
misses, with a warning logged. ``get_copies`` counts the hits that took a
copy (shorter chunks, the older format) instead of landing in place. Programming errors (wrong key types) raise.

``list()`` raises ``NotImplementedError``: the pool holds one-way hashed keys
(:mod:`.keymap`) and cannot give LMCache's key strings back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

import numpy as np
from kvfabric import Client, KVFabricError
from kvfabric.metrics import LMCACHE, names
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from . import value
from .config import PluginSettings
from .keymap import KeyMapper
from .memguard import MemoryGuard
from .scratch import ScratchPool
from .stats import track as track_counters

log = logging.getLogger("kvfabric.lmcache")

T = TypeVar("T")

#: names and meanings: kvfabric/metrics.py LMCACHE
_COUNTERS = names(LMCACHE)


def _reader(lock: threading.Lock, counts: dict[str, int]) -> Callable[[], dict[str, int]]:
    """A snapshot function over one connector's counters that does not hold the connector."""

    def read() -> dict[str, int]:
        with lock:
            return dict(counts)

    return read


def _release_result(fut: "asyncio.Future[list[Optional[MemoryObj]]]") -> None:
    """Done-callback for an abandoned get: drop the references it would have handed over."""
    if fut.cancelled() or fut.exception() is not None:
        return
    for obj in fut.result():
        if obj is not None:
            obj.ref_count_down()


class KVFabricConnector(RemoteConnector):
    """See the module docstring. Built by :class:`~kvfabric_lmcache.adapter.KVFabricConnectorAdapter`."""

    def __init__(
        self,
        client: Client,
        keymap: KeyMapper,
        settings: PluginSettings,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
    ) -> None:
        super().__init__(config, metadata)
        self.client = client
        self.keymap = keymap
        self.settings = settings
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._memory = MemoryGuard.of(local_cpu_backend)
        self._io = ThreadPoolExecutor(max_workers=settings.io_threads, thread_name_prefix="kvfabric-lmcache")
        # One staging buffer holds a full chunk plus the largest header.
        buf = self.full_chunk_size_bytes + value.MAX_HEADER_BYTES
        self._scratch = ScratchPool(buf, (settings.scratch_mb << 20) // buf)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        track_counters(_reader(self._lock, self._counts))  # into the process's Prometheus registry

    # ------------------------------------------------------------------ plumbing

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    def counts(self) -> dict[str, int]:
        """This connector's counters (no I/O)."""
        with self._lock:
            return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        """This connector's counters plus the client's (``client.stats()["client"]``; asks the servers)."""
        out: dict[str, Any] = self.counts()
        if not self._closed:
            try:
                out["client"] = self.client.stats()["client"]
            except KVFabricError as e:
                out["client"] = {"error": str(e)}
        return out

    def _guard(self, what: str, default: T, fn: Callable[[], T]) -> T:
        """Run a pool call; a KVFabricError becomes ``default`` (a miss), counted and logged."""
        try:
            return fn()
        except KVFabricError as e:
            self._count(pool_errors=1)
            log.warning("kvfabric-lmcache: %s failed, treated as a miss: %s", what, e)
            return default

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn)

    def __repr__(self) -> str:
        return f"<KVFabricConnector servers={','.join(self.client.servers)}>"

    # ------------------------------------------------------------------ contains

    def exists_sync(self, key: CacheEngineKey) -> bool:
        k, place = self.keymap(key), self.keymap.placement([key])
        return self._guard("exists", False, lambda: self.client.exists([k], placement=place)[0])

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._off_loop(lambda: self.exists_sync(key))

    def support_batched_contains(self) -> bool:
        return True

    def _lookup(self, keys: list[CacheEngineKey], lease_ms: int) -> int:
        if not keys:
            return 0
        ks, place = self.keymap.many(keys), self.keymap.placement(keys)
        # with per-layer keys (all layers of one chunk, consecutive) the chunk counts only when whole
        n = self._guard("lookup", 0, lambda: self.client.lookup(ks, lease_ms=lease_ms, placement=place))
        self._count(lookups=1, lookup_hits=n)
        return n

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading ``keys`` the pool holds (one LOOKUP per shard)."""
        return self._lookup(list(keys), 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading hit count; with ``pin`` the servers lease the hits for ``lease_ms``."""
        lease = self.settings.lease_ms if pin else 0
        return await self._off_loop(lambda: self._lookup(list(keys), lease))

    # ------------------------------------------------------------------ get

    def support_batched_get(self) -> bool:
        return True

    def _alloc(self, shapes: list[Any], dtypes: list[Any], fmt: Any) -> Optional[MemoryObj]:
        # No busy loop: under memory pressure a retrieve misses instead of
        # waiting for stores to drain (the pool promises never to stall the engine).
        obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)
        if obj is None:
            self._count(alloc_failures=1)
            log.warning("kvfabric-lmcache: no local memory for a chunk, treated as a miss")
        return obj

    def _rebuild(self, raw: Any) -> Optional[MemoryObj]:
        """Stored object -> a new memory object holding its bytes (one copy); None (counted) when it cannot be."""
        if raw is None:
            return None
        try:
            meta, payload = value.decode(raw)
        except value.ValueFormatError as e:
            self._count(bad_values=1)
            log.warning("kvfabric-lmcache: stored object rejected, treated as a miss: %s", e)
            return None
        obj = self._alloc(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            return None
        dst = memoryview(obj.byte_array).cast("B")  # ctypes-backed, format '<B'
        if len(dst) != meta.nbytes:
            obj.ref_count_down()
            self._count(bad_values=1)
            log.warning("kvfabric-lmcache: stored chunk of %d bytes does not fit its declared shape (%d bytes)", meta.nbytes, len(dst))
            return None
        dst[:] = payload
        self._count(get_copies=1)
        return obj

    def _land(self, key: bytes, head: np.ndarray, obj: MemoryObj, size: Optional[int],
              place: Optional[bytes] = None) -> Optional[MemoryObj]:
        """The memory object for one key after the scatter GET put ``size`` bytes over (head, obj).

        A full chunk written by this plugin is ready as it is. Anything else
        takes a second look: a shorter chunk (``save_unfull_chunk``) is copied
        into an object of its own shape, an object whose header is not the
        256-byte one (written by the previous format, or with unusually large
        metadata) is fetched again whole and rebuilt; a bad one is a counted miss.
        """
        if size is None:
            obj.ref_count_down()
            return None
        head = head[: min(size, head.size)]  # only what the object filled
        try:
            region = value.header_length(head)
            # the fast path needs the chunk bytes to start right after the head buffer
            meta = value.decode_header(head, size) if region == value.HEADER_ALIGN else None
        except value.ValueFormatError as e:
            obj.ref_count_down()
            self._count(bad_values=1)
            log.warning("kvfabric-lmcache: stored object rejected, treated as a miss: %s", e)
            return None
        if meta is not None and meta.nbytes == self.full_chunk_size_bytes and meta.fmt == self.meta_fmt \
                and meta.shapes == self.meta_shapes and meta.dtypes == self.meta_dtypes:
            return obj  # the common case: the bytes are where LMCache wants them
        if meta is None:  # the payload did not start at the 256-byte boundary: fetch it whole
            obj.ref_count_down()
            raw = self._guard("get", [None], lambda: self.client.get([key], placement=None if place is None
                                                                     else [place]))[0]
            return self._rebuild(raw)
        out = self._alloc(meta.shapes, meta.dtypes, meta.fmt)
        if out is not None:
            dst = memoryview(out.byte_array).cast("B")
            if len(dst) != meta.nbytes:
                out.ref_count_down()
                out = None
                self._count(bad_values=1)
                log.warning("kvfabric-lmcache: stored chunk of %d bytes does not fit its declared shape (%d bytes)",
                            meta.nbytes, len(dst))
            else:
                dst[:] = memoryview(obj.byte_array).cast("B")[: meta.nbytes]
                self._count(get_copies=1)
        obj.ref_count_down()
        return out

    def _get_batch(self, keys: list[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """:meth:`_fetch_into` while LMCache's memory is there (else all misses), counted."""
        with self._memory.use() as live:
            out = self._fetch_into(keys) if live else [None] * len(keys)
        hits = sum(o is not None for o in out)
        self._count(gets=len(keys), get_hits=hits, get_misses=len(keys) - hits)
        return out

    def _fetch_into(self, keys: list[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """Fetch on an I/O thread straight into new full-chunk memory objects (no staging copy).

        Each key gets a full-chunk object allocated before the GET; the object's
        256-byte header goes into a small buffer and its chunk bytes into the
        memory object (``Client.get_into_parts``). A key whose object cannot be
        allocated is a miss without asking the pool. An object larger than
        header + full chunk is not one this configuration wrote: that batch is
        fetched again with ``Client.get`` and rebuilt (the decoder rejects it).
        """
        objs: list[Optional[MemoryObj]] = [None] * len(keys)
        for i in range(len(keys)):
            objs[i] = self._alloc(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if objs[i] is None:
                break  # no memory now: the rest would fail too
        want = [i for i, o in enumerate(objs) if o is not None]
        out: list[Optional[MemoryObj]] = [None] * len(keys)
        if want:
            ks, place = self.keymap.many([keys[i] for i in want]), self.keymap.placement([keys[i] for i in want])
            heads = np.empty((len(want), value.HEADER_ALIGN), dtype=np.uint8)
            parts = [(heads[j], memoryview(objs[i].byte_array).cast("B")) for j, i in enumerate(want)]

            def fetch() -> Optional[list[Optional[int]]]:
                try:
                    return self.client.get_into_parts(ks, parts, placement=place)
                except ValueError:  # some object is larger than header + full chunk
                    return None

            sizes = self._guard("get", [None] * len(want), fetch)
            if sizes is None:
                for i in want:
                    objs[i].ref_count_down()
                raws = self._guard("get", [None] * len(want), lambda: self.client.get(ks, placement=place))
                for i, raw in zip(want, raws):
                    out[i] = self._rebuild(raw)
            else:
                for j, i in enumerate(want):
                    out[i] = self._land(ks[j], heads[j], objs[i], sizes[j], None if place is None else place[j])
        return out

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """Memory objects for ``keys`` in order; None for each miss.

        If the caller gives up (LMCache cancels a get that passed its
        ``blocking_timeout_secs``), the pool call still finishes on its thread
        and the memory objects it produced are released, not leaked.
        """
        keys = list(keys)
        fut = asyncio.get_running_loop().run_in_executor(self._io, self._get_batch, keys)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_release_result)
            raise

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of found chunks; objects after the first miss are released."""
        objs = await self.batched_get(keys)
        out: list[MemoryObj] = []
        for i, o in enumerate(objs):
            if o is None:
                for rest in objs[i + 1:]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(o)
        return out

    # ------------------------------------------------------------------ put

    def support_batched_put(self) -> bool:
        return True

    def _encode(self, objs: list[MemoryObj]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(scratch buffers taken, header+bytes value per chunk): the one copy out of LMCache's memory."""
        bufs = self._scratch.take(len(objs))
        try:
            values = [
                value.encode_into(o, b) if value.encoded_size(o) <= b.size else value.encode(o)
                for o, b in zip(objs, bufs)
            ]
        except BaseException:
            self._scratch.give(bufs)
            raise
        return bufs, values

    def _send(self, keys: list[CacheEngineKey], values: list[np.ndarray], bufs: list[np.ndarray]) -> None:
        """PUT the encoded chunks (blocking), then hand the scratch buffers back."""
        try:
            ks, place = self.keymap.many(keys), self.keymap.placement(keys)
            # per-layer objects arrive layer by layer: each is its own server group, placed with its chunk
            res = self._guard("put", None, lambda: self.client.put(ks, values, placement=place,
                                                                   groups=None if place is None else ks))
        finally:
            self._scratch.give(bufs)
        if res is None:
            self._count(puts=len(keys), puts_dropped=len(keys))
        else:
            self._count(puts=len(keys), puts_stored=res.stored, puts_existed=res.existed, puts_dropped=res.dropped)

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Store the chunks. The bytes are copied out of LMCache's memory objects here, on the
        loop, under the memory guard, before the put waits for an I/O thread; a put that runs
        after LMCache began freeing its arena (teardown) is dropped and counted, never read."""
        keys, objs = list(keys), list(memory_objs)
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        if not keys:
            return
        with self._memory.use() as live:
            if not live:  # LMCache is freeing its memory (teardown): nothing left to copy from
                self._count(puts=len(keys), puts_dropped=len(keys))
                return
            bufs, values = self._encode(objs)
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._io, lambda: self._send(keys, values, bufs))
        except BaseException:  # not queued (connector closed): _send will not give the buffers back
            self._scratch.give(bufs)
            raise
        await fut

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    # ------------------------------------------------------------------ misc

    def remove_sync(self, key: CacheEngineKey) -> bool:
        k, place = self.keymap(key), self.keymap.placement([key])
        return self._guard("delete", 0, lambda: self.client.delete([k], placement=place)) > 0

    async def list(self) -> list[str]:
        raise NotImplementedError(
            "a kvfabric pool stores one-way hashed keys and cannot list LMCache key strings"
        )

    async def close(self) -> None:
        """Close the client and the I/O threads; later calls raise (LMCache does not make any)."""
        if self._closed:
            return
        self._closed = True
        await self._off_loop(self.client.close)
        self._io.shutdown(wait=True)
        log.info("kvfabric-lmcache: connector closed; stats %s", self.stats())


__all__ = ["KVFabricConnector"]
