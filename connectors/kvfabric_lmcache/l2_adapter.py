"""``KVFabricL2Adapter``: kvfabric as an L2 store of LMCache's multiprocess (MP) server.

LMCache 0.5's MP server keeps an L1 in its own memory and moves objects to
and from L2 adapters through a non-blocking interface
(``lmcache/v1/distributed/l2_adapters/base.py``): submit a store / lookup-
and-lock / load task, get a task id, and be told through an event fd when
results can be popped. It is loaded as a ``plugin`` adapter, from config
alone::

    --l2-adapter '{"type": "plugin", "module_path": "kvfabric_lmcache.l2_adapter",
                   "class_name": "KVFabricL2Adapter",
                   "adapter_params": {"url": "kvfabric://127.0.0.1:7070,127.0.0.1:7071"}}'

LMCache finds :class:`KVFabricL2AdapterConfig` by its name (class name +
``Config``) and builds it from ``adapter_params``: ``url`` plus the options
of :mod:`.config` (``timeout_s``, ``lease_ms``, ``io_threads``...).

How each task runs (on a small thread pool, ``io_threads``):

* **store**: one ``Client.put`` of header+bytes per object (:mod:`.value`).
  The objects are encoded (copied) in ``submit_store_task`` itself, before it
  returns: LMCache's L1 read lock on them lasts only ``--l1-read-ttl-seconds``,
  after which their memory may be reused, so a task that read them later (a
  slow pool) stored other keys' bytes. The task succeeds when no key was
  dropped; its byte count is the objects' sizes. The adapter never touches the objects' reference counts (the L1
  manager owns them).
* **lookup and lock**: ``Client.exists`` gives the bitmap; the found keys are
  then leased with ``Client.lookup(found, lease_ms)`` so the servers do not
  evict them before the load. ``submit_unlock`` is a no-op: leases expire by
  themselves after ``lease_ms``.
* **load**: ``Client.get_into`` staging buffers, each object decoded and
  checked against the caller's buffer (same shapes, dtypes, format, size)
  before its bytes are copied in; anything else is a 0 bit, never wrong KV.

Keys: ``ObjectKey`` (model, kv rank, object group, cache salt, chunk hash)
maps to ``H(H_ns(Namespace(model, kv_layout="lmcache-mp-object-v1",
extras={kv_rank, group, cache_salt})) || "lmcache-mp-object" || chunk_hash)``
with the deployment's key algorithm and secret.

Placement (issue 23): an LMCache chunk is one object per (kv rank, object
group); every object of one chunk and kv rank is routed by one placement key,
``H(H_ns(Namespace(model, kv_layout, extras={kv_rank, cache_salt})) ||
"lmcache-mp-chunk" || chunk_hash)`` (:meth:`ObjectKeyMapper.placement`), so the
object groups of a chunk live on one owner set. Each object stays its own
server group (store tasks need not carry every group of a chunk), and the
lookup bitmap stays per object.

Capacity and eviction belong to the pool servers (each has a hard bound and
its own policy), so the adapter reports no capacity (``max_capacity_bytes=0``)
and does not implement ``delete``: do not configure LMCache's L2 eviction for
it. Failures (dead shards, deadlines) are misses and failed store tasks;
nothing raises out of the task methods.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from kvfabric import Client, KeyHasher, KVFabricError, Namespace
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from . import value
from .config import PluginSettings, settings_from_params

log = logging.getLogger("kvfabric.lmcache.l2")

KV_LAYOUT = "lmcache-mp-object-v1"
_OBJECT_TAG = b"lmcache-mp-object"
_CHUNK_TAG = b"lmcache-mp-chunk"


class KVFabricL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the plugin adapter, parsed once (ConfigError / ValueError on bad input)."""

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> KVFabricL2AdapterConfig:
        return cls(settings_from_params(d))

    @classmethod
    def help(cls) -> str:
        return (
            "kvfabric L2 adapter (plugin) adapter_params:\n"
            "- url (str): kvfabric://host:port[,host:port...][?option=value...] (or KVFABRIC_SERVERS)\n"
            "- timeout_s, connect_timeout_s, replicas, transport, key_algorithm, max_batch_keys,\n"
            "  verify_checksums, lease_ms, io_threads, auth_token, key_secret (optional)"
        )


class ObjectKeyMapper:
    """``ObjectKey`` -> kvfabric key (see the module docstring); caches namespace digests."""

    def __init__(self, hasher: KeyHasher) -> None:
        self.hasher = hasher
        self._digests: dict[tuple, bytes] = {}
        self._lock = threading.Lock()

    def __call__(self, key: ObjectKey) -> bytes:
        if not isinstance(key, ObjectKey):
            raise TypeError(f"expected an LMCache ObjectKey, got {type(key).__name__}")
        return self.hasher.hash(self._digest(key, True), _OBJECT_TAG, bytes(key.chunk_hash))

    def placement(self, key: ObjectKey) -> bytes:
        """The placement key of ``key``'s chunk: the same for every object group of one chunk and kv rank."""
        return self.hasher.hash(self._digest(key, False), _CHUNK_TAG, bytes(key.chunk_hash))

    def _digest(self, key: ObjectKey, with_group: bool) -> bytes:
        group = key.object_group_id if with_group else None
        ident = (key.model_name, key.kv_rank, group, key.cache_salt, with_group)
        d = self._digests.get(ident)
        if d is None:
            extras = {"engine": "lmcache-mp", "kv_rank": key.kv_rank, "group": group, "cache_salt": key.cache_salt}
            if not with_group:
                del extras["group"]
            d = self.hasher.namespace_digest(Namespace(model=key.model_name, kv_layout=KV_LAYOUT, extras=extras))
            with self._lock:
                if len(self._digests) >= 1024:
                    self._digests.clear()
                self._digests[ident] = d
        return d


class KVFabricL2Adapter(L2AdapterInterface):
    """See the module docstring. ``config`` is a :class:`KVFabricL2AdapterConfig` or its raw dict."""

    def __init__(self, config: KVFabricL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        if isinstance(config, dict):
            config = KVFabricL2AdapterConfig.from_dict(config)
        self.settings = config.settings
        c = self.settings.client
        self.keymap = ObjectKeyMapper(KeyHasher(c.key_algorithm, c.key_secret))
        self.client = Client(config=c)
        self._io = ThreadPoolExecutor(max_workers=self.settings.io_threads, thread_name_prefix="kvfabric-l2")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._closed = False

    # ------------------------------------------------------------ plumbing

    def _submit(self, work: Callable[[], Any], results: dict, notifier: Any, failed: Callable[[], Any]) -> L2TaskId:
        with self._lock:
            if self._closed:
                raise RuntimeError("the kvfabric L2 adapter is closed")
            tid = self._next_id
            self._next_id += 1

        def run() -> None:
            try:
                res = work()
            except KVFabricError as e:  # degrade: the task fails / misses, the controller carries on
                log.warning("kvfabric L2: task %d failed: %s", tid, e)
                res = failed()
            except Exception:
                log.exception("kvfabric L2: task %d raised", tid)
                res = failed()
            with self._lock:
                results[tid] = res
            notifier.notify()

        self._io.submit(run)
        return tid

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------ store

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        keys, objects = list(keys), list(objects)
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        ks = [self.keymap(k) for k in keys]
        place = [self.keymap.placement(k) for k in keys]
        # Copy the bytes out now, while LMCache's read lock holds the objects: it
        # expires after --l1-read-ttl-seconds and the memory is then reused.
        try:
            values = [value.encode(o) for o in objects]
            sizes = [o.get_size() for o in objects]
            error = None
        except Exception as exc:  # noqa: BLE001 - an unstorable object fails its task, never the caller
            values, sizes, error = [], [], exc

        def work() -> L2StoreResult:
            if error is not None:
                log.warning("kvfabric L2: cannot encode a store task's objects: %r", error)
                return L2StoreResult(False, 0)
            res = self.client.put(ks, values, placement=place, groups=ks)
            if res.dropped:
                return L2StoreResult(False, 0)
            self._notify_keys_stored(keys, sizes)
            return L2StoreResult(True, sum(sizes))

        return self._submit(work, self._stores, self._store_efd, lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:  # copy-and-clear: running tasks hold a reference to this very dict
            done = dict(self._stores)
            self._stores.clear()
        return done

    # ------------------------------------------------------------ lookup and lock

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        ks = [self.keymap(k) for k in keys]
        place = [self.keymap.placement(k) for k in keys]
        n = len(ks)

        def work() -> Bitmap:
            bm = Bitmap(n)
            if not ks:
                return bm
            present = self.client.exists(ks, placement=place, groups=ks)  # a bit per object
            found = [i for i, p in enumerate(present) if p]
            if found and self.settings.lease_ms:  # lease them until the load
                self.client.lookup([ks[i] for i in found], lease_ms=self.settings.lease_ms,
                                   placement=[place[i] for i in found], groups=[ks[i] for i in found])
            bm.batched_set([i for i, p in enumerate(present) if p])
            return bm

        return self._submit(work, self._lookups, self._lookup_efd, lambda: Bitmap(n))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to do: the lock is a server lease that expires after ``lease_ms``."""

    # ------------------------------------------------------------ load

    def _fill(self, obj: MemoryObj, raw: Any) -> bool:
        if raw is None:
            return False
        try:
            meta, payload = value.decode(raw)
        except value.ValueFormatError as e:
            log.warning("kvfabric L2: stored object rejected, treated as a miss: %s", e)
            return False
        dst = memoryview(obj.byte_array).cast("B")
        shapes, dtypes = value.shapes_dtypes(obj)
        if (meta.nbytes != len(dst) or meta.fmt != obj.get_memory_format()
                or list(meta.shapes) != shapes or list(meta.dtypes) != dtypes):
            log.warning("kvfabric L2: stored %r does not match the load buffer, treated as a miss", meta)
            return False
        dst[:] = payload
        return True

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        keys, objects = list(keys), list(objects)
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        ks = [self.keymap(k) for k in keys]
        place = [self.keymap.placement(k) for k in keys]
        n = len(ks)

        def work() -> Bitmap:
            bm = Bitmap(n)
            if not ks:
                return bm
            bufs = [np.empty(o.get_size() + value.MAX_HEADER_BYTES, dtype=np.uint8) for o in objects]
            try:
                sizes = self.client.get_into(ks, bufs, placement=place)
                raws: list[Any] = [None if s is None else memoryview(b)[:s] for b, s in zip(bufs, sizes)]
            except ValueError:  # an object larger than its buffer: not what this buffer can hold
                raws = self.client.get(ks, placement=place)
            ok = [i for i, (o, r) in enumerate(zip(objects, raws)) if self._fill(o, r)]
            bm.batched_set(ok)
            if ok:
                self._notify_keys_accessed([keys[i] for i in ok])
            return bm

        return self._submit(work, self._loads, self._load_efd, lambda: Bitmap(n))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    # ------------------------------------------------------------ status, close

    def report_status(self) -> dict:
        shards = self.client.stats()["client"].get("shards", {}) if not self._closed else {}
        return {
            "is_healthy": any(s.get("up") for s in shards.values()),
            "type": "kvfabric",
            "servers": list(self.client.servers),
            "shards_up": sum(1 for s in shards.values() if s.get("up")),
        }

    def close(self) -> None:
        """Finish running tasks, then close the client and the event fds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io.shutdown(wait=True)
        self.client.close()
        for n in (self._store_efd, self._lookup_efd, self._load_efd):
            n.close()


__all__ = ["KVFabricL2Adapter", "KVFabricL2AdapterConfig", "ObjectKeyMapper"]
