"""Scheduler side: pool lookups, and per request which chunks to load and to save.

Per request the scheduler keeps the chunk keys of its prompt (computed once by
``keys.prompt_keys`` over the prompt token ids, the same for every TP rank and
every TP size: ``layout``, layout version 3; never vLLM's own block hashes) and
a lookup of how many leading chunks the pool holds. The request's namespace binds vLLM's per-request ``cache_salt``
(``config.request_namespace``): salted requests never share KV with requests
of another salt or none, as in vLLM's own prefix cache.

Lookup never blocks the scheduler for long: the first call starts the lookup
on a background thread and waits at most ``lookup_wait_ms`` for it (a
loopback lookup answers well within that); if it has not answered, vLLM is
told "ask again later" (``None``) and skips the request for this step (each
later call waits at most 2 ms more); past ``lookup_timeout_ms`` the answer
is "no hit". A lookup that fails is "no hit" too (counted, warned once). The
lookup asks for every object of every chunk that the engine's ranks need
together (``layout``: one object per (chunk, layer, KV head), chunk-major), so
a chunk counts only when the pool holds all its layers and heads, whatever TP
size saved them, and takes a lease so the objects found are not evicted before
the load. It asks for them only up to the first chunk that a cheaper probe
(an EXISTS of the first layer's objects, one per KV-head column) finds missing
(``lookup_probe``, ``_lookup_all_parts``). Each chunk's objects are routed by
its placement key (``layout``: segments of ``segment_tokens``), so the lookup
of a prompt is one request per shard (per stage), and the plan sent to the
workers carries the placement keys with the chunk keys.
Every request is looked up, also when vLLM's local prefix cache covers all
it could load and in save-only roles: then only to learn what the pool
already holds (no lease), so nothing it holds is gathered and sent again.
A request that vLLM preempted (its blocks freed, ``num_preemptions`` up) is
looked up again when it is rescheduled: the pool may hold more by then (its
own chunks saved before the preemption, or another engine's).

Loads: only whole chunks, only beyond vLLM's local hit, and never the last
prompt token (vLLM must compute at least one token to sample from). With
``load_async`` (default) the hit is loaded between steps
(``load_kv_async=True``): vLLM parks the request in
``WAITING_FOR_REMOTE_KVS``, the workers load on a background thread and
report it through ``get_finished``, and no step of the batch waits on the
pool. A request finished (aborted) while its load is in flight keeps its
blocks until the load reports (``request_finished`` returns True). A chunk
that fails to load is reported through ``get_block_ids_with_load_errors``
and vLLM recomputes it.

Saves: after every step, the prompt chunks that became fully computed in
that step (chunked prefill included) and that the pool did not already hold
at lookup time are handed to the workers, which gather and put them. A save
whose lookup has not answered yet waits for it at most ``lookup_wait_ms``,
then goes out unchecked (counted: ``save_unchecked_jobs``).

Prefill/decode disaggregation (PD): a producer's ``request_finished``
returns ``kv_transfer_params`` ``{"kvfabric": {"chunks": N, "chunk_tokens":
C, "key": hex}}``: N leading chunks of the prompt are in the pool or being
put, ``key`` is chunk N-1's key. vLLM puts them in the producer's
response before the puts are acknowledged (its output is emitted when the
request stops; ``delay_free_blocks`` only holds the blocks), so a proxy that
passes them to the consumer lets the consumer tell "not there yet" from "not
saved": when its lookup finds fewer than N chunks it looks up again every
``_PD_RETRY_S`` for at most ``pd_wait_ms`` (the request waits, returning
"ask again later"; the batch does not), then recomputes what is missing
(``pd_wait_timeouts``). When every server owning the first missing chunk
is marked down (the client's lookup failed there) the wait ends at once
(``pd_pool_down``): a dead pool costs a consumer no wait, only the
recompute. A request vLLM reads no cached prefix for (``prompt_logprobs``:
``skip_reading_prefix_cache``) is looked up for saves only: nothing is
loaded, counted or waited for. A ``key`` that is not the consumer's own key for
chunk N-1 (another model, chunk size, salt...) means it can never hit: no
wait, warned once. With ``hold_until_saved`` (default for ``kv_producer``)
a finished request that sent saves keeps its blocks (``request_finished``
returns True) until every worker reports its saves acknowledged in
``get_finished``'s ``finished_sending`` (the ids go to the workers in the
next step's ``KVFabricMetadata.hold``).

The same ``kv_transfer_params`` are a ticket between an agent's turns: a
``kv_both`` instance returns them too, and a next turn (its prompt extends
the previous one) sent with them to any instance waits for the previous
turn's chunks exactly as a PD consumer does (the code path above).

Live weight versions (``weights``): a request's keys are derived under the
weights the workers last reported (``LiveWeights``), bound when it is looked
up (again after a preemption: re-keyed if the weights changed meanwhile) and
sent with its loads and saves (``LoadSpec.weights``), so a worker holding
other weights refuses them. A request keyed under weights the workers no
longer hold saves nothing more. After vLLM resets the connector's cache
(``reset_weights``) new lookups answer "ask again later" until every worker
has measured its weights (at the next step; at most ``lookup_timeout_ms``,
then the version is unknown and the pool is off for new requests).

Counters are honest: ``lookup_hit_tokens`` is added once per lookup (not per
scheduler call: vLLM asks again every step a request waits), and
``scheduled_load_tokens`` once per load vLLM accepted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfabric import LookupRun
from kvfabric.keys import Namespace, namespace_tag

from .config import ConnectorConfig
from .guard import LoadGuard
from .keys import EngineKeys, PromptKeys, prompt_keys
from .meta import KVFabricMetadata, KVFabricWorkerMeta, LoadSpec, SaveSpec
from .metrics import Counters, log
from .weights import LiveWeights

if TYPE_CHECKING:
    from kvfabric import Client
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

_POLL_WAIT_S = 0.002   # per later call while a lookup is pending
_PD_RETRY_S = 0.010    # PD consumer: interval between lookups while the producer's chunks are missing
_PD_BATCH_MAX = 1024   # PD consumer: entries of a batch's kv_transfer_params looked at


@dataclass
class _Req:
    prompt_len: int
    keys: list[bytes]                # per whole chunk of the prompt (the same for every TP rank)
    placement: list[bytes] | None = None  # per chunk: its placement key (layout.chunk_placement)
    lookup: Future | None = None
    lookup_t0: float = 0.0
    lookup_epoch: int = -1           # request.num_preemptions when the lookup was started
    pool_run: int | None = None      # leading chunks the pool holds (None: not known yet)
    pool_ssd: int | None = None      # of those, chunks with objects on a server's SSD tier (None: unknown)
    hit_counted: bool = False        # lookup_hit_tokens added for this lookup
    local_computed: int = 0          # vLLM's local hit passed to the last lookup call
    saved_upto: int = 0              # chunks [0, saved_upto) are in the pool or being put
    load: LoadSpec | None = None     # planned by update_state_after_alloc, sent next meta
    loading: bool = False            # an async load was planned and has not reported back
    expect_chunks: int = 0           # PD: leading chunks the producer reported in the pool (0: none)
    pd_deadline: float = 0.0         # PD: monotonic time the wait for them ends (0.0: not waiting)
    saves_sent: bool = False         # a SaveSpec of this request went to the workers
    weights: tuple[str, ...] = ()    # the weights its keys were derived under (weights.py), bound at lookup
    ns_tag: bytes | None = None      # weights_retire: the tag of the namespace its keys were derived in
    guard: tuple[int, int] | None = None  # the load guard's plan for this lookup: (hit tokens, tokens to load)
    stats: dict[str, int] = field(default_factory=dict)


def _skips_prefix_cache(request: Request) -> bool:
    """vLLM reads no cached prefix for this request (``skip_reading_prefix_cache``: set when it asks
    for prompt logprobs, which need every prompt token computed) and discards a connector's answer."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


class SchedulerSide:
    """The connector's scheduler half (see the module docstring)."""

    def __init__(self, cfg: ConnectorConfig, client: Client | None, keys: EngineKeys | None,
                 block_size: int, counters: Counters,
                 cache_manager: Callable[[], KVCacheManager | None], weights: LiveWeights | None = None) -> None:
        self.cfg = cfg
        self.keys = keys              # what the prompts' keys depend on (None: only for tests without prompts)
        # the weights the workers hold (weights.py); the namespace binds weights.tag() over the base's
        self.weights = weights if weights is not None else LiveWeights(
            1, keys.namespace.extras.get("weights", "") if keys is not None else "")
        self._base_keys = keys
        self._weights_waited = False  # this step already paused for the workers' measurement
        self.client = client
        self.block_size = block_size
        self.counters = counters
        self._cache_manager = cache_manager
        self._reqs: dict[str, _Req] = {}
        self._loading: set[str] = set()   # requests whose async load has not reported yet
        self._hold: list[str] = []        # finished, blocks held: sent to the workers next step
        self._warned_pd_key = False
        self._warned_guard = False
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfabric-lookup")
        self._retires: list[Future] = []  # weights_retire: retires of previous namespaces (on self._pool)
        self.guard = LoadGuard(min_tokens=cfg.load_guard_min_tokens, probe_s=cfg.load_guard_probe_s,
                               enabled=cfg.load_guard and cfg.load_async)
        self._ssd_counted = (0, 0)        # (ssd_load_us, ssd_load_tokens) counted so far

    # ------------------------------------------------------------------ state

    def _state(self, request: Request) -> _Req | None:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        tokens = request.prompt_token_ids
        if tokens is None:           # prompt embeddings: no token ids to key on
            return None
        st = _Req(prompt_len=len(tokens), keys=[])
        self._bind_keys(st, request)
        self._reqs[request.request_id] = st
        return st

    def _bind_keys(self, st: _Req, request: Request) -> None:
        """(Re)derive the request's keys under the weights the workers hold now (weights.py): what
        the pool holds or was sent under other keys is nothing to this request."""
        assert self.keys is not None and self.weights.current is not None
        pk = prompt_keys(self.keys, request.prompt_token_ids, getattr(request, "cache_salt", None))
        st.keys, st.placement, st.weights = pk.chunk_keys, pk.placement, self.weights.current
        st.ns_tag = namespace_tag(self.keys.namespace) if self.cfg.weights_retire else None
        st.saved_upto, st.pool_run, st.expect_chunks, st.pd_deadline = 0, None, 0, 0.0
        if self.cfg.load and request.kv_transfer_params and not _skips_prefix_cache(request):
            st.expect_chunks = self._expected_chunks(request.kv_transfer_params, st.keys)

    # ------------------------------------------------------------------ live weight versions

    def reset_weights(self) -> None:
        """vLLM reset the connector's cache (``reset_cache``; maybe weights were updated): hold new
        lookups until every worker has measured its weights again (weights.py)."""
        epoch = self.weights.reset()
        log.info("kvfabric: cache reset %d: waiting for the workers to measure their weights", epoch)

    def take_worker_meta(self, meta: KVFabricWorkerMeta) -> None:
        """The workers' measurement (vLLM's ``kv_connector_worker_meta``, through ``update_connector_output``)."""
        assert isinstance(meta, KVFabricWorkerMeta), type(meta)
        if self.weights.report(meta.weights):
            self._weights_changed()

    def _weights_changed(self) -> None:
        tag = self.weights.tag()
        if tag is None:
            self.counters.fail("weights_unversioned", "the weights the workers hold are unknown (reset on "
                               "workers never given the model: run refresh_weights_version); pool off")
            return
        self.counters.add("weights_updates")
        base = self._base_keys
        assert base is not None and self.keys is not None
        old = self.keys.namespace
        ns = base.namespace
        extras = {k: v for k, v in ns.extras.items() if k != "weights"}
        if tag:
            extras["weights"] = tag
        self.keys = dataclasses.replace(base, namespace=dataclasses.replace(ns, extras=extras))
        log.info("kvfabric: keys now bind weights %s", tag or "of the model files")
        if self.cfg.weights_retire and self.client is not None and old != self.keys.namespace:
            self._retires = [f for f in self._retires if not f.done()]
            self._retires.append(self._pool.submit(self._retire, old))

    def _retire(self, namespace: Namespace) -> None:
        """``weights_retire``: drop the previous weights' namespace pool-wide (its saves were tagged)."""
        assert self.client is not None
        tag = namespace_tag(namespace)
        try:
            gens = self.client.retire(tag, timeout_s=self.cfg.save_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a background retire must never crash the scheduler
            self.counters.add("weights_retire_errors")
            log.warning("kvfabric: retiring the previous weights' namespace %s failed (its KV ages out by "
                        "eviction where it was not retired): %r", tag.hex(), exc)
            return
        self.counters.add("weights_retires")
        log.info("kvfabric: previous weights' namespace %s retired on %d servers", tag.hex(), len(gens))

    def _weights_known(self) -> bool | None:
        """True: requests can be keyed; None: a reset waits for the workers' measurement; False: the
        version is unknown (the pool is off for new requests)."""
        w = self.weights
        if w.pending and w.expire(self.cfg.lookup_timeout_ms / 1000):
            self._weights_changed()
        if w.pending:
            return None
        return w.current is not None

    def _expected_chunks(self, params: object, keys: list[bytes]) -> int:
        """PD: the producer's chunk count from ``kv_transfer_params`` when its keys are ours, else 0.

        ``{"kvfabric": {"chunks": N, "key": hex, ...}}`` names one prompt's chunks;
        ``{"kvfabric": {"batch": [entry, ...]}}`` (the proxy's merge of one producer answer per
        prompt of a batch request: vLLM gives every prompt of a batch the request's params) names
        several, and each prompt takes the entry whose key is its own (at most ``_PD_BATCH_MAX``
        entries are looked at).
        """
        kvf = params.get("kvfabric") if isinstance(params, dict) else None
        if not isinstance(kvf, dict):
            return 0
        batch = kvf.get("batch")
        entries = batch[:_PD_BATCH_MAX] if isinstance(batch, list) else [kvf]
        named = None
        for e in entries:
            n = e.get("chunks") if isinstance(e, dict) else None
            if type(n) is not int or n <= 0:
                continue
            if n <= len(keys) and keys[n - 1].hex() == e.get("key"):
                return n
            named = e
        if named is not None and not self._warned_pd_key:
            self._warned_pd_key = True
            log.warning("kvfabric: the producer's kv_transfer_params name chunks this engine cannot key "
                        "alike (chunk_tokens %r vs %d, or another model, weights version, dtype, "
                        "layout, tenant or cache_salt): not waiting for them", named.get("chunk_tokens"),
                        self.cfg.chunk_tokens)
        return 0

    # ------------------------------------------------------------------ lookup

    def _lookup_all_parts(self, keys: list[bytes], lease_ms: int, placement: list[bytes] | None = None) -> LookupRun:
        """Leading chunks the pool holds whole (``PromptKeys.held_run``: every object the engine's
        ranks need, in two stages when ``lookup_probe``), within ``lookup_timeout_ms``. With the load
        guard on, the servers say which chunks are on their SSD tier and read nothing for the lookup
        (guard.py: an SSD hit is weighed on its own rate); otherwise they prefetch them into DRAM."""
        assert self.client is not None and self.keys is not None
        return PromptKeys(keys, placement).held_run(self.client, self.keys, lease_ms=lease_ms,
                                                    timeout_s=self.cfg.lookup_timeout_ms / 1000,
                                                    probe=self.cfg.lookup_probe, media=self.guard.enabled)

    def _start_lookup(self, st: _Req, epoch: int, lease: bool) -> bool:
        """Start (again, after a preemption) the lookup of every whole prompt chunk; True if started."""
        if st.lookup is not None and st.lookup_epoch == epoch:
            return False
        if st.lookup is not None:    # preempted since: what the pool holds may have grown
            self.counters.add("relookups")
            if not st.lookup.done():
                st.lookup.cancel()
        self.counters.add("lookups")
        st.lookup_epoch = epoch
        st.pool_run = st.pool_ssd = None
        st.hit_counted = False
        st.guard = None
        st.lookup_t0 = time.monotonic()
        st.lookup = self._pool.submit(self._lookup_all_parts, st.keys, self.cfg.lease_ms if lease else 0, st.placement)
        return True

    def _pool_run(self, st: _Req, wait_s: float) -> int | None:
        """Leading chunks held by the pool, or None while the lookup is still pending."""
        if st.pool_run is not None:
            return st.pool_run
        assert st.lookup is not None
        if wait_s and not st.lookup.done():
            try:
                st.lookup.result(timeout=wait_s)
            except Exception:  # noqa: BLE001 - timeout or failure, both handled below
                pass
        if st.lookup.done():
            try:
                st.pool_run, st.pool_ssd = st.lookup.result()
            except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss, never vLLM's error
                self.counters.fail("lookup_errors", "pool lookup failed: %r", exc)
                st.pool_run = 0
        elif time.monotonic() - st.lookup_t0 > self.cfg.lookup_timeout_ms / 1000:
            self.counters.fail("lookup_timeouts", "pool lookup took longer than %d ms",
                               self.cfg.lookup_timeout_ms)
            st.pool_run = 0
        if st.pool_run is not None and st.pool_run > st.saved_upto:
            if self.cfg.save:
                self.counters.add("save_known_chunks", st.pool_run - st.saved_upto)
            st.saved_upto = st.pool_run
        return st.pool_run

    def _unreachable(self, st: _Req, chunk: int) -> bool:
        """Whether some object of prompt chunk ``chunk`` (any layer, any head) has every owner down."""
        assert self.client is not None and self.keys is not None
        objs, place, _ = PromptKeys(st.keys[chunk:chunk + 1],
                                    None if st.placement is None else st.placement[chunk:chunk + 1]).objects(self.keys)
        return any(self.client.unreachable(objs, placement=place))

    def _pd_wait(self, st: _Req, run: int, n_load: int) -> bool:
        """PD: True while the request should wait for the producer's chunks (a lookup is started
        again every ``_PD_RETRY_S``); False once they are all found or the wait has run out."""
        want = min(st.expect_chunks, n_load)
        if run >= want or self.cfg.pd_wait_ms == 0:
            return False
        if self._unreachable(st, run):
            self.counters.fail("pd_pool_down", "the pool held %d of the %d chunks the producer reported and the "
                               "servers owning the next one are down", run, want)
            st.expect_chunks = 0
            return False
        now = time.monotonic()
        if not st.pd_deadline:
            st.pd_deadline = now + self.cfg.pd_wait_ms / 1000
            self.counters.add("pd_waits")
        if now >= st.pd_deadline:
            self.counters.fail("pd_wait_timeouts", "the pool held %d of the %d chunks the producer reported "
                               "after %d ms", run, want, self.cfg.pd_wait_ms)
            st.expect_chunks = 0
            return False
        if now - st.lookup_t0 < _PD_RETRY_S:
            time.sleep(_POLL_WAIT_S)   # vLLM asks again at once when idle: do not spin its loop
            return True
        self.counters.add("pd_relookups")
        st.pool_run = st.pool_ssd = None
        st.lookup_t0 = now
        st.lookup = self._pool.submit(self._lookup_all_parts, st.keys, self.cfg.lease_ms, st.placement)
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's question (``KVConnectorBase_V1``); the time spent here is the connector's, not the
        engine step's (the load guard's prefill clock leaves it out)."""
        if self.client is None:
            return 0, False
        t0 = time.monotonic()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self.guard.inline(time.monotonic() - t0)

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        known = self._weights_known()
        if not known:
            if known is None:            # the workers measure at the next step (it runs while we wait)
                if not self._weights_waited:  # once a step, not once a request: do not spin vLLM's loop
                    self._weights_waited = True
                    time.sleep(_POLL_WAIT_S)
                return None, False
            return 0, False              # weights unknown: no load, and no state, so no save
        st = self._state(request)       # also for save-only roles: saves need the keys
        if st is None:
            return 0, False
        epoch = getattr(request, "num_preemptions", 0)
        if st.weights != self.weights.current and (st.lookup is None or st.lookup_epoch != epoch):
            self._bind_keys(st, request)   # looked up again (preempted) under new weights
        if not st.keys or st.weights != self.weights.current:
            return 0, False                # (keyed under weights no longer held: its load would be refused)
        chunk = self.cfg.chunk_tokens
        n_load = (st.prompt_len - 1) // chunk    # whole chunks, last prompt token always computed
        # a request vLLM reads no cached prefix for (prompt logprobs) is looked up for saves only
        loadable = self.cfg.load and not _skips_prefix_cache(request) and n_load * chunk > num_computed_tokens
        # Looked up even when nothing is loadable: saves must know what the pool holds.
        started = self._start_lookup(st, epoch, lease=loadable)
        if not loadable:
            return 0, False
        # vLLM asks again at its next step; when nothing else is running that
        # is at once, so a later call waits a little (GIL released) instead of
        # letting the engine loop spin against the lookup thread.
        wait_s = self.cfg.lookup_wait_ms / 1000
        if not started:
            wait_s = min(_POLL_WAIT_S, wait_s)
        run = self._pool_run(st, wait_s)
        if run is None or (st.expect_chunks and self._pd_wait(st, run, n_load)):
            return None, False
        st.local_computed = num_computed_tokens
        hit = min(run, n_load) * chunk
        ext = max(0, hit - num_computed_tokens)
        if not st.hit_counted:        # once per lookup, however often vLLM asks
            st.hit_counted = True
            if ext:
                self.counters.add("lookup_hit_tokens", ext)
        if ext and self.guard.enabled:
            ext = self._guarded(st, num_computed_tokens, ext)
        return ext, bool(ext) and self.cfg.load_async

    def _guarded(self, st: _Req, computed: int, ext: int) -> int:
        """The tokens of an ``ext``-token hit to load (guard.py): decided once per lookup (again when
        the hit changed, a PD wait's later lookup), ending on a chunk boundary; cuts are counted."""
        if st.guard is None or st.guard[0] != ext:
            ssd = (st.pool_ssd or 0) * self.cfg.chunk_tokens   # where in the hit is not known: any makes it an SSD load
            keep = self.guard.plan(ext, time.monotonic(), ssd_tokens=min(ssd, ext))
            if keep is not None:
                end = (computed + keep) // self.cfg.chunk_tokens * self.cfg.chunk_tokens
                keep = max(0, end - computed)
                self.counters.add("loads_guarded")
                if keep < ext:
                    self.counters.add("loads_skipped_slower")
                    self.counters.add("skipped_load_tokens", ext - keep)
                    if not self._warned_guard:   # once: the cause of a hit recomputed
                        self._warned_guard = True
                        log.info("kvfabric: loading %d of %d hit tokens, recomputing the rest: loading is "
                                 "predicted slower than recomputing (%s); further cuts are counted "
                                 "(loads_skipped_slower), not logged", keep, ext, self.guard.to_json())
            st.guard = (ext, ext if keep is None else keep)
        return st.guard[1]

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        chunk, bs = self.cfg.chunk_tokens, self.block_size
        start = st.local_computed
        end = start + num_external_tokens
        assert start % bs == 0 and end % chunk == 0, (start, end)
        c0, c1 = start // chunk, end // chunk
        block_ids = blocks.get_block_ids()[0]
        per = chunk // bs
        st.load = LoadSpec(
            req_id=request.request_id,
            keys=st.keys[c0:c1],
            block_ids=[list(block_ids[c * per : (c + 1) * per]) for c in range(c0, c1)],
            placement=None if st.placement is None else st.placement[c0:c1],
            skip_blocks=(start - c0 * chunk) // bs,
            async_load=self.cfg.load_async,
            weights=st.weights,
        )
        if self.cfg.load_async:
            st.loading = True
            self._loading.add(request.request_id)
            self.guard.load_started(request.request_id, num_external_tokens, time.monotonic(),
                                    LoadGuard.kind(st.pool_ssd))
        self.counters.add("scheduled_load_tokens", num_external_tokens)

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        """The workers reported these async loads done (or failed): their blocks are vLLM's again."""
        now = time.monotonic()
        for rid in finished_recving or ():
            self._loading.discard(rid)
            self.guard.load_finished(rid, now)
            st = self._reqs.get(rid)
            if st is not None:
                st.loading = False
                # Offer no hit again in this epoch: a load that failed from its first
                # block leaves the request at 0 computed tokens, and vLLM then asks
                # again; the same hit would be loaded (and fail) forever.
                st.pool_run = 0
                st.hit_counted = True
        if finished_recving:
            self._count_ssd_loads()

    def _count_ssd_loads(self) -> None:
        """The guard's SSD loads' clock and tokens as counters: what kvfabric route prices SSD tokens with."""
        busy_s, tokens = self.guard.totals("ssd")
        if tokens > self._ssd_counted[1]:
            us = int(busy_s * 1e6)
            self.counters.add("ssd_load_us", us - self._ssd_counted[0])
            self.counters.add("ssd_load_tokens", tokens - self._ssd_counted[1])
            self._ssd_counted = (us, tokens)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, so: SchedulerOutput) -> KVFabricMetadata:
        """This step's loads, saves and holds for the workers; the time spent here is the connector's
        (the load guard's prefill clock leaves it out)."""
        t0 = time.monotonic()
        try:
            return self._build_meta(so, t0)
        finally:
            self.guard.inline(time.monotonic() - t0)

    def _build_meta(self, so: SchedulerOutput, t0: float) -> KVFabricMetadata:
        meta = KVFabricMetadata(hold=self._hold, weights_epoch=self.weights.epoch)
        self._weights_waited = False
        self._hold = []
        for st in self._reqs.values():
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
        if self.guard.enabled:
            self._time_step(so, meta, t0)
        if not self.cfg.save or self.client is None:
            return meta
        progress: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens + so.num_scheduled_tokens.get(r.req_id, 0))
            for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        progress += [
            (rid, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
            for i, rid in enumerate(cached.req_ids)
        ]
        manager = self._cache_manager()
        for rid, computed in progress:
            st = self._reqs.get(rid)
            if st is None or manager is None:
                continue
            if st.weights != self.weights.current:
                continue    # keyed under weights the workers no longer hold: its new KV is not that version's
            done = min(computed, st.prompt_len) // self.cfg.chunk_tokens
            if done <= st.saved_upto:
                continue
            if st.lookup is not None and st.pool_run is None:
                # What does the pool hold already? Wait a little for the lookup
                # (started when the request was scheduled), then send unchecked.
                self._pool_run(st, self.cfg.lookup_wait_ms / 1000)
                if st.pool_run is None:
                    self.counters.add("save_unchecked_jobs")
                elif done <= st.saved_upto:
                    continue
            spec = self._save_spec(rid, st, st.saved_upto, done, manager.get_block_ids(rid)[0])
            meta.saves.append(spec)
            st.saves_sent = True
            st.saved_upto = done
        return meta

    def _time_step(self, so: SchedulerOutput, meta: KVFabricMetadata, t0: float) -> None:
        """The load guard's prefill clock (guard.py): this step's prompt tokens and requests."""
        prompt = 0
        rids: list[str] = []
        for r in so.scheduled_new_reqs:
            st = self._reqs.get(r.req_id)
            plen = st.prompt_len if st is not None else len(r.prompt_token_ids or ())
            prompt += min(so.num_scheduled_tokens.get(r.req_id, 0), max(0, plen - r.num_computed_tokens))
            rids.append(r.req_id)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is not None:
                prompt += min(so.num_scheduled_tokens.get(rid, 0), max(0, st.prompt_len - cached.num_computed_tokens[i]))
            rids.append(rid)
        sync = any(not spec.async_load for spec in meta.loads)
        self.guard.step(t0, prompt, rids, countable=not sync)

    def _save_spec(self, rid: str, st: _Req, c0: int, c1: int, block_ids: list[int]) -> SaveSpec:
        per = self.cfg.chunk_tokens // self.block_size
        return SaveSpec(
            req_id=rid,
            keys=st.keys[c0:c1],
            parents=[st.keys[c - 1] if c else None for c in range(c0, c1)],
            block_ids=[list(block_ids[c * per : (c + 1) * per]) for c in range(c0, c1)],
            placement=None if st.placement is None else st.placement[c0:c1],
            weights=st.weights,
            ns_tag=st.ns_tag,
        )

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; (hold its blocks?, ``kv_transfer_params`` for its response).

        Held (True) while an async load still writes into the request's blocks
        (aborted while loading: vLLM frees them when the worker reports the
        load), or, with ``hold_until_saved``, while its saves may be in flight:
        the workers report it in ``finished_sending`` once its put jobs are
        done. Without that, saves already gathered stay in flight and the
        blocks are freed now: the workers copy a chunk out of vLLM's blocks
        during the step that completes it.

        A saving request's response carries ``{"kvfabric": {...}}`` (module
        docstring, PD) for a consumer to know what to wait for."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self.guard.finished(rid)
        if st is not None and st.lookup is not None and not st.lookup.done():
            st.lookup.cancel()
        if rid in self._loading:     # never both: vLLM frees the blocks on the first report
            return True, None
        if st is None or not self.cfg.save or not st.saved_upto:
            return False, None
        params = {"kvfabric": {"chunks": st.saved_upto, "chunk_tokens": self.cfg.chunk_tokens,
                               "key": st.keys[st.saved_upto - 1].hex()}}
        hold = self.cfg.hold_until_saved and st.saves_sent
        if hold:
            self._hold.append(rid)
            self.counters.add("held_requests")
        return hold, params

    def shutdown(self) -> None:
        # a retire in flight finishes first (bounded: its own deadline), or the old weights' KV would stay
        wait(self._retires, timeout=self.cfg.save_timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            self.client.close()
        log.info("kvfabric scheduler counters: %s", self.counters.snapshot())
        if self.guard.enabled:
            log.info("kvfabric load guard: measured rates %s", self.guard.to_json())
