"""Worker side: copy between vLLM's paged KV blocks and pool chunks.

Chunk object layout (``KV_LAYOUT_VERSION`` 1): for one TP rank, the pages of
the chunk's ``P = chunk_tokens // block_size`` blocks, layer-major::

    [layer 0: block 0 page, block 1 page, ... block P-1 page][layer 1: ...]...

where a page is ``kv_layer[block_id]``, the block's ``[H, N, C]`` bytes in
vLLM's per-layer view (blocks at dim 0; on the CPU backend ``C`` holds K then
V). Layers are in the model order vLLM lists them in. The namespace binds
the layout name, heads, head sizes, block size and layer count, so engines
whose pages differ never share keys.

Loads (``load``): an async spec (``load_async``, the default) is queued on
one loader thread and reported through ``finished_loads`` (vLLM's
``get_finished``), so no step of the batch waits on the pool; a step waits
for a load still in flight at most ``load_poll_ms`` (2 ms). A sync spec runs
in ``start_load_kv``, before the forward that reads it. Either way one
batched ``Client.get_into`` per request (bounded by ``load_timeout_s``)
straight into a staging tensor, then one ``copy_`` per page into the blocks. The staging
tensor is reused and registered with the client (``register_load_buffer``),
so on ``native`` connections the chunks are received with io_uring
READ_FIXED into pre-registered memory. A chunk
that misses, has the wrong size, or a step whose read raises, is reported in
``failed_block_ids`` and vLLM recomputes those tokens; the failure is counted
and warned once, never raised into vLLM's step.

Saves: ``gather_layer`` copies the chunks completed by this step out of a
layer's blocks right after that layer's attention wrote them
(``save_kv_layer``); ``submit_saves`` (``wait_for_save``) gathers any layer
not seen yet and hands the staging tensors to one background thread that
``put``s them. Since the bytes are copied out during the step, vLLM may
free or reuse the blocks as soon as the step ends. Pending save bytes are
bounded: past ``max_pending_save_bytes`` new chunks are skipped and counted.

Held requests (PD, ``hold_until_saved``): the scheduler kept the blocks of
a finished request that sent saves and names it in the next step's
``KVFabricMetadata.hold`` (the same step whose ``finished_req_ids`` holds
it); ``finished_saves`` reports it (vLLM's ``finished_sending``) once every
put job of that request is done, whatever its outcome (a dropped put is a
future miss, not a reason to keep blocks), so its blocks go back to vLLM
only after the pool acknowledged the puts (or ``save_timeout_s`` ran out).

Shutdown (vLLM calls it on SIGTERM in every mode, then kills the process 5 s
later) drains queued saves for at most ``shutdown_drain_s``; what is still
queued or running then is abandoned and counted (``save_abandoned_jobs``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import torch

from kvfabric import ConfigError, KVFabricError

from .config import ConnectorConfig
from .meta import LoadSpec, SaveSpec
from .metrics import Counters, log

if TYPE_CHECKING:
    from kvfabric import Client

__all__ = ["WorkerSide"]


class _Staged:
    """One save spec's staging tensor and which layers are already gathered in it."""

    def __init__(self, spec: SaveSpec, data: torch.Tensor) -> None:
        self.spec = spec
        self.data = data              # [n_chunks, L, P, *page_shape]
        self.layers: set[int] = set()


class WorkerSide:
    """The connector's worker half for one TP rank (see the module docstring)."""

    def __init__(self, cfg: ConnectorConfig, client: Client | None, tp_rank: int, block_size: int,
                 layer_names: Sequence[str], counters: Counters) -> None:
        if cfg.chunk_tokens % block_size:
            raise ConfigError(f"chunk_tokens {cfg.chunk_tokens} is not a multiple of block size {block_size}")
        self.cfg = cfg
        self.client = client
        self.tp_rank = tp_rank
        self.per_chunk = cfg.chunk_tokens // block_size
        self.layer_names = list(layer_names)
        self.counters = counters
        self.layers: list[torch.Tensor] = []
        self._index = {name: i for i, name in enumerate(self.layer_names)}
        self._failed: set[int] = set()
        self._staged: dict[int, _Staged] = {}   # id(spec) -> staging, for this step only
        self._pending_bytes = 0
        self._load_buf: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-save")
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-load")
        self._loads: dict[str, Future] = {}      # req_id -> async load in flight, until reported
        self._save_jobs: set[Future] = set()
        self._req_saves: dict[str, set[Future]] = {}   # req_id -> its put jobs not done yet
        self._held: set[str] = set()                   # finished, held for their saves, not reported
        self._closed = False

    # ------------------------------------------------------------------ registration

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer KV tensors; raise ConfigError for a layout this connector cannot copy."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kvfabric: vLLM registered no KV cache for layers {missing}")
        layers = [kv_caches[n] for n in self.layer_names]
        first = layers[0]
        for name, kv in zip(self.layer_names, layers):
            if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
                raise ConfigError(f"kvfabric: layer {name} KV {tuple(kv.shape)}/{kv.dtype} differs from "
                                  f"{tuple(first.shape)}/{first.dtype}; mixed layouts are not supported")
            if not kv[0].is_contiguous():
                raise ConfigError(f"kvfabric: layer {name}: a block's page is not contiguous "
                                  f"(shape {tuple(kv.shape)}, strides {kv.stride()})")
        self.layers = layers
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.chunk_bytes = len(layers) * self.per_chunk * first[0].numel() * first.element_size()
        log.info("kvfabric: %d layers, page %s %s, %d bytes per %d-token chunk", len(layers),
                 self.page_shape, self.dtype, self.chunk_bytes, self.cfg.chunk_tokens)

    # ------------------------------------------------------------------ loads

    def load(self, specs: Iterable[LoadSpec]) -> None:
        """Copy every spec's chunks into vLLM's blocks (async specs: queue them); failures land
        in ``failed_block_ids`` (async: when ``finished_loads`` reports the request)."""
        for spec in specs:
            if spec.async_load:
                self.counters.add("async_loads")
                self._loads[spec.req_id] = self._loader.submit(self._load_guarded, spec)
            else:
                failed = self._load_guarded(spec)
                with self._lock:
                    self._failed.update(failed)

    def _load_guarded(self, spec: LoadSpec) -> set[int]:
        """Load one spec; the blocks that must be recomputed (never raises)."""
        failed: set[int] = set()
        t0 = time.monotonic()
        try:
            self._load_one(spec, failed)
        except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's step
            self.counters.fail("load_errors", "loading %d chunks failed: %r", len(spec.block_ids), exc, exc=exc)
            failed.update(self._blocks_to_write(spec, range(len(spec.block_ids))))
        self.counters.observe("load_seconds", time.monotonic() - t0)
        return failed

    def finished_loads(self) -> set[str]:
        """Requests whose async load is done; their failed blocks join ``failed_block_ids`` now,
        so vLLM sees both in the same step. Waits at most ``load_poll_ms`` for one in flight."""
        if not self._loads:
            return set()
        if self.cfg.load_poll_ms and not any(f.done() for f in self._loads.values()):
            wait_futures(list(self._loads.values()), timeout=self.cfg.load_poll_ms / 1000,
                         return_when="FIRST_COMPLETED")
        done = {rid for rid, f in self._loads.items() if f.done()}
        for rid in done:
            fut = self._loads.pop(rid)
            failed = fut.result() if not fut.cancelled() else set()
            with self._lock:
                self._failed.update(failed)
        return done

    def _blocks_to_write(self, spec: LoadSpec, chunks: Iterable[int]) -> list[int]:
        out: list[int] = []
        for i in chunks:
            out.extend(spec.block_ids[i][spec.skip_blocks if i == 0 else 0 :])
        return out

    def _load_one(self, spec: LoadSpec, failed: set[int]) -> None:
        n = len(spec.block_ids)
        if n == 0:
            return
        if self.client is None:
            raise KVFabricError("no pool client (the pool was unusable at start)")
        keys = spec.keys[self.tp_rank]
        if len(keys) != n or any(len(b) != self.per_chunk for b in spec.block_ids):
            raise ValueError(f"malformed load spec for {spec.req_id}: {len(keys)} keys, {n} chunks")
        raw = self._load_staging(n)
        sizes = self.client.get_into(keys, [memoryview(raw[i].numpy()) for i in range(n)],
                                     timeout_s=self.cfg.load_timeout_s)
        good = [i for i, s in enumerate(sizes) if s == self.chunk_bytes]
        bad = [i for i, s in enumerate(sizes) if s != self.chunk_bytes]
        if bad:
            self.counters.fail("load_failed_chunks", "%d of %d chunks were missing or malformed in the pool",
                               len(bad), n, n=len(bad))
            failed.update(self._blocks_to_write(spec, bad))
        if not good:
            return
        data = raw.view(self.dtype).view(n, len(self.layers), self.per_chunk, *self.page_shape)
        pages = 0
        # One copy_ per page: pages are contiguous on both sides, and unlike
        # index_copy_ this does not fan out to torch's intra-op threads, which
        # compete with vLLM's own compute threads for the same cores.
        for i in good:
            first = spec.skip_blocks if i == 0 else 0
            for li, kv in enumerate(self.layers):
                src = data[i, li]
                for j in range(first, self.per_chunk):
                    kv[spec.block_ids[i][j]].copy_(src[j])
            pages += self.per_chunk - first
        self.counters.add("load_chunks", len(good))
        self.counters.add("load_tokens", pages * (self.cfg.chunk_tokens // self.per_chunk))
        self.counters.add("load_bytes", pages * (self.chunk_bytes // self.per_chunk))

    def _load_staging(self, n: int) -> torch.Tensor:
        """A reused staging buffer for ``n`` chunks: a fresh multi-MiB allocation would be
        page-faulted in by the receive on every load. Loads run one at a time (in the step, or
        on the one loader thread, and a step with sync loads has no async one running: vLLM
        plans a request's load one way), so one buffer suffices; it never outgrows the
        largest load seen (bounded by vLLM's KV cache)."""
        if self._load_buf is None or self._load_buf.shape[0] < n:
            self._load_buf = torch.empty((n, self.chunk_bytes), dtype=torch.uint8)
            if self.cfg.register_load_buffer and self.client is not None:
                try:
                    self.client.register_buffers([self._load_buf.numpy()])
                except ValueError as e:  # over the registration limits (1 GiB): loads use recvmsg
                    log.warning("kvfabric: load staging buffer not registered (%s); loads use recvmsg", e)
        return self._load_buf[:n]

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            out, self._failed = self._failed, set()
        return out

    # ------------------------------------------------------------------ saves

    def _staging(self, spec: SaveSpec) -> _Staged:
        st = self._staged.get(id(spec))
        if st is None:
            n = len(spec.block_ids)
            data = torch.empty((n, len(self.layers), self.per_chunk, *self.page_shape), dtype=self.dtype)
            st = self._staged[id(spec)] = _Staged(spec, data)
        return st

    def gather_layer(self, layer_name: str, specs: Iterable[SaveSpec]) -> None:
        """Copy this step's completed chunks of one layer into staging (called per layer)."""
        li = self._index.get(layer_name)
        if li is None:
            return
        for spec in specs:
            try:
                self._gather(self._staging(spec), li)
            except Exception as exc:  # noqa: BLE001
                self.counters.fail("save_errors", "gathering KV for a save failed: %r", exc, exc=exc)

    def _gather(self, st: _Staged, li: int) -> None:
        if li in st.layers:
            return
        kv = self.layers[li]
        for i, blocks in enumerate(st.spec.block_ids):
            dst = st.data[i, li]
            for j, b in enumerate(blocks):
                dst[j].copy_(kv[b])
        st.layers.add(li)

    def submit_saves(self, specs: Iterable[SaveSpec]) -> None:
        """Finish gathering and hand this step's chunks to the background putter."""
        specs = list(specs)
        try:
            for spec in specs:
                if self.client is None or not spec.block_ids:
                    continue
                st = self._staging(spec)
                for li in range(len(self.layers)):
                    self._gather(st, li)
                nbytes = st.data.numel() * st.data.element_size()
                with self._lock:
                    if self._pending_bytes + nbytes > self.cfg.max_pending_save_bytes:
                        over = True
                    else:
                        over = False
                        self._pending_bytes += nbytes
                if over:
                    self.counters.fail("save_skipped_chunks", "saves are slower than prefill; skipping chunks "
                                       "beyond %d pending bytes", self.cfg.max_pending_save_bytes,
                                       n=len(spec.block_ids))
                    continue
                self.counters.add("save_jobs")
                fut = self._saver.submit(self._put, spec, st.data, nbytes)
                with self._lock:
                    self._save_jobs.add(fut)
                fut.add_done_callback(self._save_job_done)
                self._track_save(spec.req_id, fut)
        except Exception as exc:  # noqa: BLE001
            self.counters.fail("save_errors", "submitting saves failed: %r", exc, exc=exc)
        finally:
            self._staged.clear()

    def _put(self, spec: SaveSpec, data: torch.Tensor, nbytes: int) -> None:
        t0 = time.monotonic()
        try:
            assert self.client is not None
            raw = data.view(len(spec.block_ids), -1).view(torch.uint8)
            values = [memoryview(raw[i].numpy()) for i in range(raw.shape[0])]
            res = self.client.put(spec.keys[self.tp_rank], values, parents=spec.parents[self.tp_rank],
                                  timeout_s=self.cfg.save_timeout_s)
            self.counters.add("save_chunks", res.stored + res.existed)
            self.counters.add("save_bytes", (res.stored + res.existed) * (nbytes // max(1, len(values))))
            if res.dropped:
                self.counters.fail("save_dropped_chunks", "the pool did not take %d chunks (down, full or slow)",
                                   res.dropped, n=res.dropped)
        except Exception as exc:  # noqa: BLE001 - a background save must never crash the worker
            self.counters.fail("save_errors", "saving %d chunks failed: %r", len(spec.block_ids), exc, exc=exc)
        finally:
            with self._lock:
                self._pending_bytes -= nbytes
            self.counters.observe("save_seconds", time.monotonic() - t0)
            self.counters.add("save_jobs_done")

    def _track_save(self, req_id: str, fut: Future) -> None:
        """Remember ``fut`` as one of ``req_id``'s put jobs until it is done."""
        with self._lock:
            self._req_saves.setdefault(req_id, set()).add(fut)

        def done(f: Future) -> None:
            with self._lock:
                jobs = self._req_saves.get(req_id)
                if jobs is not None:
                    jobs.discard(f)
                    if not jobs:
                        del self._req_saves[req_id]

        fut.add_done_callback(done)

    def finished_saves(self, finished_req_ids: set[str], hold: Iterable[str]) -> set[str]:
        """Held requests whose put jobs are all done (vLLM's ``finished_sending``).

        ``hold`` comes from this step's metadata, with the same step's
        ``finished_req_ids``, so every id reported was in a set vLLM passed
        (its contract). Waits at most ``load_poll_ms`` for a held request's
        put when none is ready: when only held requests remain, vLLM steps
        again at once, and this keeps that loop from spinning."""
        self._held.update(hold)
        if not self._held:
            return set()
        with self._lock:
            ready = {rid for rid in self._held if rid not in self._req_saves}
            pending = [f for rid in self._held for f in self._req_saves.get(rid, ())]
        if not ready and pending and self.cfg.load_poll_ms:
            wait_futures(pending, timeout=self.cfg.load_poll_ms / 1000, return_when="FIRST_COMPLETED")
            with self._lock:
                ready = {rid for rid in self._held if rid not in self._req_saves}
        self._held -= ready
        if ready:
            self.counters.add("held_released", len(ready))
        return ready

    def _save_job_done(self, fut: Future) -> None:
        with self._lock:
            self._save_jobs.discard(fut)

    def shutdown(self) -> None:
        """Drain queued saves for at most ``shutdown_drain_s``, abandon the rest (counted), close
        the client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        with self._lock:
            jobs = list(self._save_jobs)
        _, left = wait_futures(jobs, timeout=self.cfg.shutdown_drain_s)
        self._saver.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
        if left:
            self.counters.fail("save_abandoned_jobs", "%d save jobs still pending after the %.1f s shutdown "
                               "drain; abandoned", len(left), self.cfg.shutdown_drain_s, n=len(left))
        if self.client is not None:
            self.client.close()
        log.info("kvfabric worker shut down (%d save jobs drained in %.2f s, %d abandoned); counters: %s",
                 len(jobs) - len(left), time.monotonic() - t0, len(left), self.counters.snapshot())
