"""Worker side: move KV between vLLM's paged blocks and pool objects.

Pool objects are one per (chunk, layer, KV head) (``layout``, layout version 3:
head ``h``'s share of the chunk's pages in that layer, keys derived from the
chunk's prefix key, the layer and the model's head index, never the TP rank), so
a rank saves and loads exactly its own heads' objects, and ranks of engines of
any TP size find the same objects. Internally each (layer, head of this rank)
is a *part* (each group of ``kv_heads_per_object`` heads, 1 by default): the
per-layer KV tensor ``[B, H, N, C]`` narrowed to those heads (``kv.narrow(1, j,
g)``: on the CPU backend one contiguous run of each page, so loads still
receive in place), and everything below moves parts as it moved layers.
MLA (``layout.HeadSplit`` unsplit): the parts are the layers, whole pages, which
every rank holds; rank 0 saves them. Replicated KV heads (fewer heads than
ranks): only the first rank holding a head saves it. The namespace binds the
layout name, the model's KV heads, head sizes, block size and layer count, so
engines whose pages differ never share keys.

Loads (``load``): an async spec (``load_async``, the default) is queued on
one loader thread and reported through ``finished_loads`` (vLLM's
``get_finished``), so no step of the batch waits on the pool; a step waits
for a load still in flight at most ``load_poll_ms`` (2 ms). A sync spec runs
in ``start_load_kv``, before the forward that reads it. Either way one
batched ``Client.get_into`` per request (bounded by ``load_timeout_s``).
With one block per chunk (the default chunk size) every object is one page
and is received straight into the paged KV cache: no staging buffer, no
copy; the layer tensors are registered with the client
(``register_load_buffer``), so ``native`` connections receive with io_uring
READ_FIXED. A chunk of several blocks is received into a reused staging
buffer and copied page by page. A chunk that misses or has the wrong size in
any layer, or a load whose read raises, is reported in ``failed_block_ids``
and vLLM recomputes those tokens (bytes a failed receive left in a block are
overwritten by that recompute); the failure is counted and warned once,
never raised into vLLM's step. The first load logs the transport each pool
server's loads use (``shm`` for a server on this host that offers it: one
copy out of its arena, the fastest way here), and a hint when a server on
this host does not offer ``shm`` to an ``auto`` client.

Saves: ``gather_layer`` copies the chunks completed by this step out of a
layer's blocks right after that layer's attention wrote them
(``save_kv_layer``), straight into the objects' layout; ``submit_saves``
(``wait_for_save``) gathers any layer not seen yet and hands the staging
tensors to one background thread that ``put``s the per-part objects
from them (no further copy). Since the bytes are copied out during the step,
vLLM may free or reuse the blocks as soon as the step ends: putting straight
from the blocks would need every request (also a preempted one, whose blocks
vLLM frees without asking the connector) to hold its blocks until the put
is done. Pending save bytes are bounded: past ``max_pending_save_bytes`` new
chunks are skipped and counted.

Held requests (PD, ``hold_until_saved``): the scheduler kept the blocks of
a finished request that sent saves and names it in the next step's
``KVFabricMetadata.hold`` (the same step whose ``finished_req_ids`` holds
it); ``finished_saves`` reports it (vLLM's ``finished_sending``) once every
put job of that request is done, whatever its outcome (a dropped put is a
future miss, not a reason to keep blocks), so its blocks go back to vLLM
only after the pool acknowledged the puts (or ``save_timeout_s`` ran out).

KV cache on a GPU (or a CPU layout whose pages are several runs,
``pages.PageLayout``): ``.numpy()`` of a CUDA tensor raises, so saves and
loads go through the transfer buffer (``transfer``): ``transfer_buffer_mb``
of host memory (pinned for a GPU, registered with the client) leased per
step's saves and per load. ``save_kv_layer`` launches one batched gather of
the layer's save pages into the lease on a dedicated CUDA stream, after an
event on vLLM's compute stream (the layer's forward wrote them);
``wait_for_save`` makes the compute stream wait for every gather of the step
(no block rewritten before its bytes left it); the put thread waits for them
before putting from the lease. A load receives into its lease, then one
batched scatter per layer, after an event recorded on the compute stream when
the load started (its blocks may still be read by kernels queued for their
previous owner): a sync load's attention waits for its layer's
scatter in ``wait_for_layer_load`` (vLLM calls it before each attention
layer, ``model_executor/layers/attention/kv_transfer_utils.py:51``), an async
load is waited for on the loader thread before it is reported. A lease that
does not fit skips the step's saves (``save_no_buffer_chunks``) or fails the
load (``load_no_buffer_chunks``, recomputed); nothing waits for memory.
``load_layerwise`` (receiving layer by layer) applies to the in-place CPU
path only. The CUDA path has not run on a real GPU yet (2026-12-05; tests/gpu,
scripts/gpu-check.sh).

Live weight versions (``weights``): once ``refresh_weights_version`` gave a
rank its model, the rank serves only loads and saves the scheduler planned
under the fingerprint it measured (``LoadSpec.weights``); others are refused
(``weights_refused_chunks``: a load's blocks are reported failed and
recomputed, a save is dropped). A new reset epoch in the metadata makes it
measure the model again, and the next ``build_connector_worker_meta``
reports the result.

Shutdown (vLLM calls it on SIGTERM in every mode, then kills the process 5 s
later) drains queued saves for at most ``shutdown_drain_s``; what is still
queued or running then is abandoned and counted (``save_abandoned_jobs``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import torch

from kvfabric import ConfigError, KeyHasher, KVFabricError

from .config import ConnectorConfig
from .layout import HeadSplit, chunk_object_keys, object_placement, part_group
from .meta import KVFabricWorkerMeta, LoadSpec, SaveSpec
from .metrics import Counters, log
from .weights import WeightsReport, params_fingerprint
from .transfer import CudaLane, HostLane, Lease, PagedKV, SlotPool, layer_layout, page_rows

if TYPE_CHECKING:
    from kvfabric import Client

__all__ = ["WorkerSide"]


class _Staged:
    """One save spec's staging (a buffer per chunk) and which layers are already gathered in it."""

    def __init__(self, spec: SaveSpec, chunks: list[torch.Tensor]) -> None:
        self.spec = spec
        self.chunks = chunks          # per chunk: uint8 [parts, P, page_bytes]; object (c, part) is chunks[c][part]
        self.host = [c.numpy() for c in chunks]   # the same bytes, for single-threaded copies (_gather)
        self.layers: set[int] = set()  # parts gathered
        self.queued = False           # handed to the putter, which gives the buffers back


class _ChunkBuffers:
    """Save staging buffers of one chunk each, reused: a fresh multi-MiB allocation per save is page-faulted
    in by the gather's copy, which cost 136-691 us of CPU per 128 KiB page in the engine here (kvfabric bench
    serve, 4 sessions in flight) against ~10 for a copy into pages already present. Holds at most ``keep``
    idle buffers (the rest are freed); thread-safe (the putter gives buffers back)."""

    def __init__(self, shape: tuple[int, ...], keep: int) -> None:
        self.shape, self.keep = shape, keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[torch.Tensor]:
        with self._lock:
            got = [self._idle.pop() for _ in range(min(n, len(self._idle)))]
        return got + [torch.empty(self.shape, dtype=torch.uint8) for _ in range(n - len(got))]

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            self._idle.extend(bufs[: max(0, self.keep - len(self._idle))])


class _StepSave:
    """Through the transfer buffer (``transfer``): one step's save chunks, all specs together.

    ``lease`` rows are layer-major: object (chunk ``c`` of the step, layer
    ``l``) is row ``l * n + c``, so one layer's gather fills one contiguous
    range. ``marks[l]``: completion of layer ``l``'s gather. The lease goes
    back when the last put job reading it is done (``refs``).
    """

    def __init__(self, specs: list[SaveSpec], lease: Lease | None) -> None:
        self.specs = specs
        self.n = sum(len(s.block_ids) for s in specs)
        self.lease = lease
        self.marks: dict[int, object] = {}
        self.refs = 0


class WorkerSide:
    """The connector's worker half for one TP rank (see the module docstring)."""

    def __init__(self, cfg: ConnectorConfig, client: Client | None, tp_rank: int, block_size: int,
                 layer_names: Sequence[str], counters: Counters, heads: HeadSplit | None = None) -> None:
        """``heads``: the engine's KV head split (``layout.HeadSplit``; default: one rank, whole pages,
        one object per (chunk, layer))."""
        if cfg.chunk_tokens % block_size:
            raise ConfigError(f"chunk_tokens {cfg.chunk_tokens} is not a multiple of block size {block_size}")
        self.cfg = cfg
        self.client = client
        self.tp_rank = tp_rank
        self.per_chunk = cfg.chunk_tokens // block_size
        self.layer_names = list(layer_names)
        self.counters = counters
        self.heads = heads if heads is not None else HeadSplit()
        # a chunk's objects of this rank as (layer, global head), layer-major: one part each
        self.parts = self.heads.parts(len(self.layer_names), tp_rank)
        self._saves = self.heads.saves(tp_rank)    # False: another rank saves this rank's (replicated) heads
        self.layers: list[torch.Tensor] = []       # per part: its KV tensor (the layer's, narrowed to its heads)
        self._kv: list[torch.Tensor] = []          # per layer: vLLM's KV tensor
        per_layer = len(self.parts) // max(1, len(self.layer_names))
        self._index = {name: list(range(i * per_layer, (i + 1) * per_layer)) for i, name in enumerate(self.layer_names)}
        self._failed: set[int] = set()
        self._staged: dict[int, _Staged] = {}   # id(spec) -> staging, for this step only
        self._chunk_bufs: _ChunkBuffers | None = None   # reused save staging (direct CPU path), once shaped
        self._pending_bytes = 0
        self._load_buf: torch.Tensor | None = None
        self._hasher = KeyHasher(cfg.client.key_algorithm, cfg.client.key_secret)
        self._page_bytes: list = []              # per layer: numpy uint8 view [blocks, H, N, C*esize]
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-save")
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfabric-load")
        self._loads: dict[str, Future] = {}      # req_id -> async load in flight, until reported
        self._layerwise: tuple[list[LoadSpec], dict[str, Future]] | None = None   # this step's, if any
        self._save_jobs: set[Future] = set()
        self._req_saves: dict[str, set[Future]] = {}   # req_id -> its put jobs not done yet
        self._held: set[str] = set()                   # finished, held for their saves, not reported
        self._closed = False
        self._transport_noted = False                  # the transports loads use were logged
        # through the transfer buffer (KV on a GPU, or pages of several runs): None otherwise
        self._xfer: PagedKV | None = None
        self._pool: SlotPool | None = None
        self._step_save: _StepSave | None = None       # this step's saves, through the transfer buffer
        self._load_marks: dict[int, list] = {}         # layer -> scatters attention must wait for (sync loads)
        self._deferred: list[tuple[Lease, list]] = []  # sync loads' leases, released after the forward
        self._load_after: object = None                # compute mark the loads' scatters wait for (a later
                                                       # load() replaces it: waiting longer is still safe)
        # live weight versions (weights.py): this rank's fingerprint ("": the files' weights, never
        # measured; None: unknown, every load and save refused), the model to measure again on a
        # reset, the driver's version string, the last reset epoch seen, the report not sent yet
        self.weights_fp: str | None = ""
        self._model: torch.nn.Module | None = None
        self._weights_version = ""
        self._weights_epoch = 0
        self._weights_report: WeightsReport | None = None

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
            if kv.stride() != first.stride():
                raise ConfigError(f"kvfabric: layer {name} KV strides {kv.stride()} differ from {first.stride()}")
        if self.heads.split:      # vLLM's per-layer view is [B, H, N, C]: one part per head group of this rank
            nh, g = len(self.heads.heads(self.tp_rank)), self.heads.per_object
            if first.dim() != 4 or first.shape[1] != nh:
                raise ConfigError(f"kvfabric: expected KV tensors [blocks, {nh} heads, tokens, bytes], got "
                                  f"{tuple(first.shape)}")
            parts = [kv.narrow(1, j, g) for kv in layers for j in range(0, nh, g)]
        else:
            parts = list(layers)
        try:
            layout = layer_layout(parts[0])      # a part's page as byte runs (pages.py)
        except ValueError as e:
            raise ConfigError(f"kvfabric: KV layout not supported: {e}") from e
        self._kv = layers
        self.layers = parts
        first = parts[0]
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.page_bytes = layout.page_bytes
        self.obj_bytes = self.per_chunk * layout.page_bytes
        self.chunk_bytes = len(parts) * self.obj_bytes
        on_gpu = first.device.type == "cuda"
        if first.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"kvfabric: KV cache on {first.device} is not supported (CPU and CUDA only)")
        if on_gpu or not layout.contiguous:
            self._start_transfer(parts, on_gpu)
            return
        # Each part's pages as uint8 rows [blocks, page_bytes] (a page is one run of
        # the tensor), so a page is a writable buffer the client can receive into.
        self._rows = [page_rows(kv, layout) for kv in parts]
        self._page_bytes = [r.numpy() for r in self._rows]
        self._direct = self.per_chunk == 1
        self._register_receive_buffers()
        log.info("kvfabric: %d layers, page %s %s, %d bytes per %d-token chunk (%d %d-byte objects, one per "
                 "%s), loads %s", len(layers), self.page_shape, self.dtype, self.chunk_bytes,
                 self.cfg.chunk_tokens, len(parts), self.obj_bytes,
                 f"layer and {self.heads.per_object} KV head(s)" if self.heads.split else "layer",
                 "straight into the KV blocks" if self._direct else "through a staging buffer")

    def _start_transfer(self, layers: list[torch.Tensor], on_gpu: bool) -> None:
        """KV on a GPU, or pages of several runs: saves and loads go through a bounded transfer
        buffer (pinned on a GPU) with batched gathers / scatters (``transfer``); ``layers``: the
        parts (a layer's tensor narrowed to a part's KV heads, or the layer's whole)."""
        n_slots = self.cfg.transfer_buffer_bytes // self.obj_bytes
        if n_slots < 1:
            raise ConfigError(f"kvfabric: transfer_buffer_mb ({self.cfg.transfer_buffer_bytes >> 20} MiB) is "
                              f"smaller than one {self.obj_bytes}-byte pool object")
        lane = CudaLane(layers[0].device) if on_gpu else HostLane()
        self._xfer = PagedKV(layers, lane)
        self._pool = SlotPool(n_slots, self.obj_bytes, pin=on_gpu)
        self._direct = False
        self.counters.add("transfer_buffer_bytes", self._pool.nbytes)
        if self.cfg.register_load_buffer and self.client is not None:
            try:
                self.client.register_buffers([self._pool.slab.numpy()])
            except ValueError as e:   # over the registration limits: loads use recvmsg
                log.warning("kvfabric: transfer buffer not registered (%s); loads use recvmsg", e)
        log.info("kvfabric: %d objects per chunk on %s, page %s %s (%d runs of %d bytes), %d bytes per "
                 "%d-token chunk; saves and loads through a %d MiB %stransfer buffer (%d objects), %s", len(layers),
                 layers[0].device, self.page_shape, self.dtype, self._xfer.layout.runs_per_page,
                 self._xfer.layout.run_bytes, self.chunk_bytes, self.cfg.chunk_tokens, self._pool.nbytes >> 20,
                 "pinned " if on_gpu else "", n_slots,
                 "on a dedicated CUDA stream (not yet verified on a real GPU)" if on_gpu else "copied on the CPU")

    def _register_receive_buffers(self) -> None:
        """Register what loads receive into: the layer tensors (direct loads) or the staging buffer.
        Over the client's limits (or layers not contiguous) loads still work, with recvmsg."""
        if not self.cfg.register_load_buffer or self.client is None:
            return
        if self._direct:
            bufs = [kv.view(torch.uint8).view(-1).numpy() if kv.is_contiguous() else None for kv in self._kv]
        else:
            bufs = [] if self._load_buf is None else [self._load_buf.numpy()]
        if not bufs:
            return
        try:
            if any(b is None for b in bufs):
                raise ValueError("a layer's KV tensor is not contiguous")
            self.client.register_buffers(bufs)
        except ValueError as e:  # over the registration limits: loads use recvmsg
            log.warning("kvfabric: load buffers not registered (%s); loads use recvmsg", e)

    # ------------------------------------------------------------------ live weight versions

    def bind_weights(self, model: torch.nn.Module, version: str = "") -> str:
        """Measure ``model``'s weights now (``weights.refresh_weights_version``) and keep it to measure
        again on the next reset; from now on only specs planned under this fingerprint are served.
        Returns the fingerprint, which the next step reports to the scheduler."""
        fp = params_fingerprint(model.named_parameters(), version)
        self._model, self._weights_version = model, version
        self._set_weights(fp)
        return fp

    def weights_epoch(self, epoch: int) -> None:
        """The scheduler's reset count (``KVFabricMetadata.weights_epoch``): on a new one measure the
        bound model again (none bound: the weights are unknown, everything refused) and report."""
        if epoch <= self._weights_epoch:
            return
        self._weights_epoch = epoch
        fp = None
        if self._model is not None:
            try:
                fp = params_fingerprint(self._model.named_parameters(), self._weights_version)
            except Exception as exc:  # noqa: BLE001 - an unmeasurable model is an unknown version
                self.counters.fail("weights_unversioned", "measuring the weights failed: %r", exc, exc=exc)
        self._set_weights(fp)

    def _set_weights(self, fp: str | None) -> None:
        if fp != self.weights_fp:
            log.info("kvfabric: rank %d now holds weights %s", self.tp_rank, fp or "of unknown version")
        self.weights_fp = fp
        self._weights_report = WeightsReport({self.tp_rank: (self._weights_epoch, fp or "")})

    def take_worker_meta(self) -> KVFabricWorkerMeta | None:
        """This rank's measurement not reported yet (vLLM's ``build_connector_worker_meta``)."""
        rep, self._weights_report = self._weights_report, None
        return None if rep is None else KVFabricWorkerMeta(rep)

    def _weights_match(self, spec: LoadSpec | SaveSpec) -> bool:
        """Whether ``spec`` was planned under the weights this rank holds (files' weights: ``()``)."""
        if self.weights_fp is None:
            return False
        if not spec.weights:
            return not self.weights_fp
        return self.tp_rank < len(spec.weights) and spec.weights[self.tp_rank] == self.weights_fp

    def _saves_matching(self, specs: Iterable[SaveSpec], count: bool) -> list[SaveSpec]:
        out = []
        for spec in specs:
            if self._weights_match(spec):
                out.append(spec)
            elif count and spec.block_ids:
                self.counters.fail("weights_refused_chunks", "a save planned under other weights than this "
                                   "rank holds was refused", n=len(spec.block_ids))
        return out

    def _refuse_load(self, spec: LoadSpec) -> None:
        """A load planned under other weights: every block it would write is recomputed."""
        self.counters.fail("weights_refused_chunks", "a load planned under other weights than this rank "
                           "holds was refused", n=len(spec.block_ids))
        failed = set(self._blocks_to_write(spec, range(len(spec.block_ids))))
        if spec.async_load:
            fut: Future = Future()
            fut.set_result(failed)
            self._loads[spec.req_id] = fut
        else:
            with self._lock:
                self._failed.update(failed)

    # ------------------------------------------------------------------ loads

    def load(self, specs: Iterable[LoadSpec]) -> None:
        """Receive every spec's chunks into vLLM's blocks (async specs: queue them; sync specs
        with ``load_layerwise``: start them layer by layer); failures land in
        ``failed_block_ids`` (async: when ``finished_loads`` reports the request). A spec planned
        under other weights than this rank holds is refused: its blocks fail (recomputed)."""
        layerwise: list[LoadSpec] = []
        specs = list(specs)
        for spec in [s for s in specs if not self._weights_match(s)]:
            self._refuse_load(spec)
        specs = [s for s in specs if self._weights_match(s)]
        if self._xfer is not None and specs:
            # The blocks a load writes may have held another request's KV that kernels already
            # queued on vLLM's compute stream still read (vLLM can run a step ahead of the GPU):
            # every scatter of these loads waits for the compute stream's work so far.
            self._load_after = self._xfer.lane.compute_mark()
        for spec in specs:
            if spec.async_load:
                self.counters.add("async_loads")
                self._loads[spec.req_id] = self._loader.submit(self._load_guarded, spec)
            elif self.cfg.load_layerwise and self._direct and self.client is not None and spec.block_ids:
                layerwise.append(spec)
            else:
                failed = self._load_guarded(spec)
                with self._lock:
                    self._failed.update(failed)
        if layerwise:
            self._start_layerwise(layerwise)

    # -------------------------------------------------- sync loads, layer by layer (load_layerwise)

    def _start_layerwise(self, specs: list[LoadSpec]) -> None:
        """One ``get_into`` per layer, in layer order, on the loader thread: the forward's
        attention of layer ``l`` waits only for layer ``l`` (``wait_layer``), so later layers
        arrive while earlier ones compute. All layers share one ``load_timeout_s`` deadline."""
        nl = len(self.layers)
        good_specs = []
        for spec in specs:
            keys = spec.keys
            if len(keys) != len(spec.block_ids) or any(len(b) != 1 for b in spec.block_ids):
                self.counters.fail("load_errors", "malformed load spec for %s", spec.req_id)
                with self._lock:
                    self._failed.update(self._blocks_to_write(spec, range(len(spec.block_ids))))
                continue
            good_specs.append(spec)
        keys = [chunk_object_keys(self._hasher, s.keys, self.parts) for s in good_specs]
        place = None if any(s.placement is None for s in good_specs) else [
            p for s in good_specs for p in s.placement]   # one per chunk: a part's objects
        deadline = time.monotonic() + self.cfg.load_timeout_s

        def one_layer(li: int) -> list[int | None]:
            assert self.client is not None
            ks = [k[c * nl + li] for k in keys for c in range(len(k) // nl)]
            bufs = [self._page_bytes[li][b[0]] for s in good_specs for b in s.block_ids]
            return self.client.get_into(ks, bufs, placement=place, timeout_s=max(0.001, deadline - time.monotonic()))

        futs = {li: self._loader.submit(one_layer, li) for li in range(nl)}   # part order
        self._layerwise = (good_specs, futs)

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's layer-by-layer load of ``layer_name`` is received (or failed).
        Through the transfer buffer: this layer's attention (vLLM's compute stream) waits for the
        layer's scatter of this step's sync loads, the CPU does not (later layers' copies overlap it)."""
        parts = self._index.get(layer_name, ())
        if self._xfer is not None and self._load_marks:
            for li in parts:
                for mark in self._load_marks.pop(li, ()):
                    self._xfer.lane.compute_wait(mark)
        if self._layerwise is None:
            return
        futs = [f for li in parts if (f := self._layerwise[1].get(li)) is not None]
        if futs:
            wait_futures(futs)

    def _finish_layerwise(self) -> None:
        """Wait for every layer of this step's layer-by-layer load; chunks whose objects did not
        all arrive whole become failed blocks (vLLM recomputes them)."""
        if self._layerwise is None:
            return
        specs, futs = self._layerwise
        self._layerwise = None
        if not self._transport_noted and self.client is not None:
            self._note_transport()
        sizes: list[list[int | None] | None] = []
        for fut in futs.values():     # layer order
            try:
                sizes.append(fut.result())
            except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's step
                self.counters.fail("load_errors", "loading a layer failed: %r", exc, exc=exc)
                sizes.append(None)
        off = 0
        for spec in specs:
            n = len(spec.block_ids)
            bad = [i for i in range(n)
                   if any(ls is None or ls[off + i] != self.obj_bytes for ls in sizes)]
            off += n
            if bad:
                self.counters.fail("load_failed_chunks", "%d of %d chunks were missing or malformed in the pool",
                                   len(bad), n, n=len(bad))
                with self._lock:
                    self._failed.update(self._blocks_to_write(spec, bad))
            self.counters.add("load_chunks", n - len(bad))
            self.counters.add("load_tokens", (n - len(bad)) * self.cfg.chunk_tokens)

    def _load_guarded(self, spec: LoadSpec) -> set[int]:
        """Load one spec; the blocks that must be recomputed (never raises)."""
        failed: set[int] = set()
        t0 = time.monotonic()
        try:
            self._load_one(spec, failed)
        except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's step
            self.counters.fail("load_errors", "loading %d chunks failed: %r", len(spec.block_ids), exc, exc=exc)
            failed.update(self._blocks_to_write(spec, range(len(spec.block_ids))))
        if not self._transport_noted and self.client is not None:
            self._note_transport()
        self.counters.observe("load_seconds", time.monotonic() - t0)
        return failed

    def _note_transport(self) -> None:
        """Log once (INFO) the transport each pool server's loads use, and when servers on this host
        do not give ``shm`` to an ``auto`` client, how to get it: a load over ``shm`` is one copy
        out of the server's arena; over loopback ``native``/``tcp`` it crosses the network stack
        (about 5x slower for the tiny Llama's loads here, docs/notes/vllm.md "Issue 13 figures")."""
        from kvfabric.transport.shm import on_this_host  # the check shm's connect makes

        assert self.client is not None
        used = {a: t for a, t in self.client.transports.items() if t}
        if not used:
            return                     # not connected yet: note it after a later load
        self._transport_noted = True
        log.info("kvfabric: loads use %s", ", ".join(f"{t} ({a})" for a, t in sorted(used.items())))
        local = sorted(a for a, t in used.items() if t != "shm" and on_this_host(a))
        if local and self.cfg.client.transport == "auto":
            log.info("kvfabric: pool server(s) %s are on this host but do not offer shm: start them with "
                     "`--transports tcp,native,shm` for faster loads (transport auto then picks shm)",
                     ", ".join(local))

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
        keys = spec.keys
        if len(keys) != n or any(len(b) != self.per_chunk for b in spec.block_ids):
            raise ValueError(f"malformed load spec for {spec.req_id}: {len(keys)} keys, {n} chunks")
        nl = len(self.layers)
        okeys = chunk_object_keys(self._hasher, keys, self.parts)
        lease = None
        if self._direct:      # object (i, l) is block_ids[i][0]'s page in layer l: receive in place
            bufs = [self._page_bytes[li][spec.block_ids[i][0]] for i in range(n) for li in range(nl)]
        elif self._xfer is not None:
            lease = self._take_lease(n * nl, "load_no_buffer_chunks", n)
            if lease is None:
                failed.update(self._blocks_to_write(spec, range(n)))
                return
            bufs = [lease.rows[li * n + i].numpy() for i in range(n) for li in range(nl)]   # layer-major rows
        else:
            raw = self._load_staging(n * nl)
            bufs = [raw[j].numpy() for j in range(n * nl)]
        place, _ = object_placement(keys, spec.placement, nl)
        try:
            sizes = self.client.get_into(okeys, bufs, placement=place, timeout_s=self.cfg.load_timeout_s)
        except BaseException:
            if lease is not None:      # no copy touched its rows yet
                self._pool.give_back(lease)
            raise
        bad = sorted({j // nl for j, s in enumerate(sizes) if s != self.obj_bytes})
        good = [i for i in range(n) if i not in set(bad)]
        if bad:
            self.counters.fail("load_failed_chunks", "%d of %d chunks were missing or malformed in the pool",
                               len(bad), n, n=len(bad))
            failed.update(self._blocks_to_write(spec, bad))
        if lease is not None:
            self._scatter_lease(spec, lease, good)
        if not good:
            return
        pages = sum(self.per_chunk - (spec.skip_blocks if i == 0 else 0) for i in good)
        if not self._direct and lease is None:
            data = raw.view(n, nl, self.per_chunk, self.page_bytes).numpy()
            # One numpy copy per page (contiguous on both sides): torch's copy_ and index_copy_ fan
            # out to torch's intra-op threads, which compete with vLLM's compute for its cores (_gather)
            for i in good:
                first = spec.skip_blocks if i == 0 else 0
                for li, rows in enumerate(self._page_bytes):
                    src = data[i, li]
                    for j in range(first, self.per_chunk):
                        rows[spec.block_ids[i][j]] = src[j]
        self.counters.add("load_chunks", len(good))
        self.counters.add("load_tokens", pages * (self.cfg.chunk_tokens // self.per_chunk))
        self.counters.add("load_bytes", pages * (self.chunk_bytes // self.per_chunk))

    def _take_lease(self, n_objects: int, counter: str, n_chunks: int) -> Lease | None:
        """``n_objects`` rows of the transfer buffer, or None (counted: the chunks are skipped or
        recomputed; nothing waits for memory)."""
        assert self._pool is not None
        lease = self._pool.take(n_objects) if n_objects <= self._pool.n_slots else None
        if lease is None:
            self.counters.fail(counter, "the transfer buffer (transfer_buffer_mb, %d objects) has no room for "
                               "%d more", self._pool.n_slots, n_objects, n=n_chunks)
        return lease

    def _scatter_lease(self, spec: LoadSpec, lease: Lease, good: list[int]) -> None:
        """Copy the good chunks of a load from its lease (layer-major rows) into their blocks, one
        batched scatter per layer. An async load (loader thread) waits for the copies and gives
        the lease back; a sync load leaves each layer's mark for that layer's attention
        (``wait_layer``) and the lease for ``take_failed_block_ids``, after the forward."""
        assert self._xfer is not None and self._pool is not None
        n, p = len(spec.block_ids), self.per_chunk
        pairs = [(i * p + j, spec.block_ids[i][j]) for i in good
                 for j in range(spec.skip_blocks if i == 0 else 0, p)]
        marks = []
        try:
            for li in range(len(self.layers)):
                mark = self._xfer.scatter(li, lease.rows[li * n:(li + 1) * n].view(-1), pairs,
                                          after=self._load_after)
                marks.append(mark)
                if not spec.async_load:
                    self._load_marks.setdefault(li, []).append(mark)
        finally:
            if spec.async_load:
                self._xfer.release(self._pool, lease, marks)
            else:
                self._deferred.append((lease, marks))

    def _release_deferred(self) -> None:
        """Give back the leases of this step's sync loads (their copies are waited for first)."""
        self._load_marks.clear()
        while self._deferred:
            lease, marks = self._deferred.pop()
            assert self._xfer is not None and self._pool is not None
            self._xfer.release(self._pool, lease, marks)

    def _load_staging(self, n: int) -> torch.Tensor:
        """A reused staging buffer for ``n`` objects (chunks of several blocks only): a fresh
        multi-MiB allocation would be page-faulted in by the receive on every load. Loads run one
        at a time (in the step, or on the one loader thread, and a step with sync loads has no
        async one running: vLLM plans a request's load one way), so one buffer suffices; it never
        outgrows the largest load seen (bounded by vLLM's KV cache)."""
        if self._load_buf is None or self._load_buf.shape[0] < n:
            self._load_buf = torch.empty((n, self.obj_bytes), dtype=torch.uint8)
            self._register_receive_buffers()
        return self._load_buf[:n]

    def take_failed_block_ids(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM asks after each forward)."""
        self._finish_layerwise()
        if self._deferred:
            self._release_deferred()
        with self._lock:
            out, self._failed = self._failed, set()
        return out

    # ------------------------------------------------------------------ saves

    def _staging(self, spec: SaveSpec) -> _Staged:
        st = self._staged.get(id(spec))
        if st is None:
            if self._chunk_bufs is None:   # idle buffers kept: a quarter of what pending saves may hold
                keep = max(1, self.cfg.max_pending_save_bytes // 4 // self.chunk_bytes)
                self._chunk_bufs = _ChunkBuffers((len(self.layers), self.per_chunk, self.page_bytes), keep)
            st = self._staged[id(spec)] = _Staged(spec, self._chunk_bufs.take(len(spec.block_ids)))
        return st

    def gather_layer(self, layer_name: str, specs: Iterable[SaveSpec]) -> None:
        """Copy this step's completed chunks of one layer (its parts) into staging (called per layer)."""
        parts = self._index.get(layer_name)
        if parts is None or not self._saves:
            return
        specs = self._saves_matching(specs, count=False)
        if self._xfer is not None:
            try:
                for li in parts:
                    self._gather_step(li, specs)
            except Exception as exc:  # noqa: BLE001
                self.counters.fail("save_errors", "gathering KV for a save failed: %r", exc, exc=exc)
            return
        for spec in specs:
            try:
                for li in parts:
                    self._gather(self._staging(spec), li)
            except Exception as exc:  # noqa: BLE001
                self.counters.fail("save_errors", "gathering KV for a save failed: %r", exc, exc=exc)

    def _gather(self, st: _Staged, li: int) -> None:
        if li in st.layers:
            return
        # Copied with numpy, never torch: a torch copy_ of more than 32 Ki elements fans out to torch's
        # intra-op threads, which vLLM's CPU backend binds to the cores its own compute runs on. Two
        # engines on two cores (kvfabric bench serve, 4 sessions in flight), into fresh staging: 1.2 ms
        # of CPU and 2.4 ms of wall time per 128 KiB page; numpy alone: 136-691 us of CPU (the rest was
        # fresh staging's page faults: _ChunkBuffers).
        rows = self._page_bytes[li]
        for i, blocks in enumerate(st.spec.block_ids):
            dst = st.host[i][li]
            for j, b in enumerate(blocks):
                dst[j] = rows[b]
        st.layers.add(li)

    def _gather_step(self, li: int, specs: Iterable[SaveSpec]) -> None:
        """Through the transfer buffer: launch layer ``li``'s gather of every save chunk of this step,
        after the compute that wrote the layer (one lease per step, taken at its first layer)."""
        assert self._xfer is not None
        st = self._step_save
        if st is None:
            todo = [s for s in specs if s.block_ids] if self.client is not None else []
            n = sum(len(s.block_ids) for s in todo)
            lease = self._take_lease(n * len(self.layers), "save_no_buffer_chunks", n) if n else None
            st = self._step_save = _StepSave(todo if lease is not None else [], lease)
        if st.lease is None or li in st.marks:
            return
        blocks = [b for s in st.specs for chunk in s.block_ids for b in chunk]
        st.marks[li] = self._xfer.gather(li, blocks, st.lease.rows[li * st.n:(li + 1) * st.n].view(-1),
                                         after=self._xfer.lane.compute_mark())

    def _submit_step_save(self, specs: list[SaveSpec]) -> None:
        """Through the transfer buffer: gather the layers not seen yet, make vLLM's compute wait for
        every gather of the step (no block is rewritten before its bytes left it), queue one put
        job per spec; the last job done gives the lease back."""
        assert self._xfer is not None and self._pool is not None
        lane, nl = self._xfer.lane, len(self.layers)
        try:
            for li in range(nl):
                self._gather_step(li, specs)
        finally:
            st, self._step_save = self._step_save, None
            if st is not None and st.lease is not None and len(st.marks) < nl:   # a gather raised
                for m in st.marks.values():
                    lane.compute_wait(m)
                self._xfer.release(self._pool, st.lease, list(st.marks.values()))
        if st is None or st.lease is None:
            return
        marks = [st.marks[li] for li in range(nl)]
        for m in marks:
            lane.compute_wait(m)
        st.refs = len(st.specs)

        def ready() -> None:
            for m in marks:
                lane.host_wait(m)

        def done(_: object = None) -> None:
            with self._lock:
                st.refs -= 1
                last = st.refs == 0
            if last:
                self._xfer.release(self._pool, st.lease, marks)

        off = 0
        for spec in st.specs:
            k = len(spec.block_ids)
            rows = st.lease.rows
            values = [rows[li * st.n + off + c].numpy() for c in range(k) for li in range(nl)]
            off += k
            if not self._reserve_pending(spec, k * self.chunk_bytes):
                done()
                continue
            self._queue_put(spec, values, k * self.chunk_bytes, ready, done)

    def submit_saves(self, specs: Iterable[SaveSpec]) -> None:
        """Finish gathering and hand this step's chunks to the background putter (nothing on a rank
        whose heads another rank saves)."""
        if not self._saves:
            return
        specs = self._saves_matching(specs, count=True)
        if self._xfer is not None:
            try:
                self._submit_step_save(specs)
            except Exception as exc:  # noqa: BLE001
                self.counters.fail("save_errors", "submitting saves failed: %r", exc, exc=exc)
            return
        try:
            for spec in specs:
                if self.client is None or not spec.block_ids:
                    continue
                st = self._staging(spec)
                for li in range(len(self.layers)):
                    self._gather(st, li)
                nbytes = len(st.chunks) * self.chunk_bytes
                if not self._reserve_pending(spec, nbytes):
                    continue
                values = [h[part].reshape(-1) for h in st.host for part in range(len(self.layers))]  # (chunk, part)
                bufs, pool = st.chunks, self._chunk_bufs
                assert pool is not None
                st.queued = True
                self._queue_put(spec, values, nbytes, release=lambda b=bufs: pool.give(b))
        except Exception as exc:  # noqa: BLE001
            self.counters.fail("save_errors", "submitting saves failed: %r", exc, exc=exc)
        finally:
            for st in self._staged.values():   # gathered but not handed to the putter: reusable at once
                if not st.queued and self._chunk_bufs is not None:
                    self._chunk_bufs.give(st.chunks)
            self._staged.clear()

    def _reserve_pending(self, spec: SaveSpec, nbytes: int) -> bool:
        """Count ``nbytes`` as pending puts, or skip the spec's chunks (counted) past the bound."""
        with self._lock:
            if self._pending_bytes + nbytes > self.cfg.max_pending_save_bytes:
                over = True
            else:
                over = False
                self._pending_bytes += nbytes
        if over:
            self.counters.fail("save_skipped_chunks", "saves are slower than prefill; skipping chunks "
                               "beyond %d pending bytes", self.cfg.max_pending_save_bytes, n=len(spec.block_ids))
        return not over

    def _queue_put(self, spec: SaveSpec, values: list, nbytes: int, ready: Callable[[], None] | None = None,
                   done: Callable[[], None] | None = None, release: Callable[[], None] | None = None) -> None:
        self.counters.add("save_jobs")
        fut = self._saver.submit(self._put, spec, values, nbytes, ready, release)
        with self._lock:
            self._save_jobs.add(fut)
        fut.add_done_callback(self._save_job_done)
        if done is not None:
            fut.add_done_callback(done)       # also when cancelled at shutdown
        self._track_save(spec.req_id, fut)

    def _put(self, spec: SaveSpec, values: list, nbytes: int, ready: Callable[[], None] | None = None,
             release: Callable[[], None] | None = None) -> None:
        """Put one spec's objects (``values``: chunk-major, part order), after ``ready`` (the
        transfer buffer's gathers are complete): each chunk's parts one group (``layout.part_group``).
        ``release`` gives back what holds ``values`` once the put is over, with the pending bytes and
        before the job counts as done."""
        t0 = time.monotonic()
        try:
            assert self.client is not None
            nl = len(self.layers)
            if ready is not None:
                ready()
            keys = chunk_object_keys(self._hasher, spec.keys, self.parts)
            parents = [p for c in spec.parents
                       for p in ([None] * nl if c is None else chunk_object_keys(self._hasher, [c], self.parts))]
            place, groups = object_placement(
                spec.keys, spec.placement, nl,
                groups=[part_group(self._hasher, k, self.heads, self.tp_rank) for k in spec.keys])
            res = self.client.put(keys, values, parents=parents, placement=place, groups=groups,
                                  ns_tag=spec.ns_tag, timeout_s=self.cfg.save_timeout_s)
            # Counted in chunks: a chunk is dropped when any of its objects is; the
            # result counts objects only, so d dropped objects count as ceil(d / parts)
            # chunks (exact when whole chunks are dropped, as with a dead shard or pool).
            dropped = -(-res.dropped // nl)
            self.counters.add("save_chunks", len(spec.block_ids) - dropped)
            self.counters.add("save_bytes", (len(spec.block_ids) - dropped) * (nbytes // max(1, len(spec.block_ids))))
            if dropped:
                self.counters.fail("save_dropped_chunks", "the pool did not take %d chunks (down, full or slow)",
                                   dropped, n=dropped)
        except Exception as exc:  # noqa: BLE001 - a background save must never crash the worker
            self.counters.fail("save_errors", "saving %d chunks failed: %r", len(spec.block_ids), exc, exc=exc)
        finally:
            with self._lock:
                self._pending_bytes -= nbytes
            if release is not None:
                release()
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
