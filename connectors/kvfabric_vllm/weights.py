"""Live weight versions: the pool's keys follow the weights an engine holds in memory, not its files.

RL post-training updates a running engine's weights in place (vLLM ``collective_rpc`` /
``load_weights`` / ``update_weights``) and then resets vLLM's prefix cache. KV computed with
the old weights must never be served under the new ones, and engines that hold the same new
weights should share KV. What vLLM 0.32 offers the connector:

* ``KVConnectorBase_V1.reset_cache()``, called on the SCHEDULER-side connector by
  ``reset_prefix_cache(reset_connector=True)`` and by ``pause_generation(clear_cache=True)``
  (``EngineCore._reset_caches``). Plain ``reset_prefix_cache()`` does not call it
  (``reset_connector`` defaults to False). Nothing reaches the worker-side connector.
* No connector hook is given the model (neither side): only a function run on the workers
  (``LLM.collective_rpc``) can read the parameters.

So the version is measured on the workers and bound on the scheduler:

1. The RL driver runs ``llm.collective_rpc(refresh_weights_version)`` after loading new weights
   (optionally with ``kwargs={"version": "step-42"}``, which is bound too). Each worker hashes
   sampled bytes of its rank's parameters (``params_fingerprint``), keeps the result and a
   reference to the model, and from then on REFUSES every load and save the scheduler
   planned under another version (``weights_refused_chunks``): a request in flight across the
   update is never served, nor saves, KV of the other version.
2. The workers report their fingerprints back (``KVFabricWorkerMeta``, vLLM's
   ``build_connector_worker_meta`` channel, at the next engine step). The scheduler binds the
   engine's version (``LiveWeights.tag``: a digest of every TP rank's fingerprint) into the
   namespace of every request looked up from then on; a request is bound to the version it was
   looked up under (``LoadSpec.weights`` / ``SaveSpec.weights``).
3. ``reset_prefix_cache(reset_connector=True)`` (or a pause with ``clear_cache``) makes the
   scheduler hold new lookups (bounded by ``lookup_timeout_ms`` from the first lookup held: an idle
   engine runs no step to measure in) until every worker has
   measured its weights again (``KVFabricMetadata.weights_epoch``): after a first
   ``refresh_weights_version`` the reset alone suffices for later in-place updates of the same
   model object. A reset on workers that were never given the model leaves the version
   unknown: the pool is off (``weights_unversioned``) until ``refresh_weights_version`` runs.

4. With ``weights_retire`` (config.py) saves are tagged with their namespace and the scheduler
   retires the previous namespace pool-wide when the version changes (``Client.retire``).

Before any of this the namespace binds the model files' fingerprint
(``config.weights_fingerprint``), as engines that never update always did.

Not detected: weights changed in memory with neither ``refresh_weights_version`` nor a reset
with ``reset_connector=True``. The fingerprint samples bytes (``_SAMPLES`` runs of
``_SAMPLE_ELEMS`` elements of every parameter), it is not a full hash: an update that changes
no sampled element goes unseen unless the driver passes a new ``version``. Engines of
different TP sizes hold different shards and so never share KV after an update.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["params_fingerprint", "refresh_weights_version", "KVFabricWorkerExtension", "LiveWeights", "WeightsReport"]

_SAMPLES, _SAMPLE_ELEMS = 8, 256
_VERSION_MAX = 256   # characters of a driver-given version string


def params_fingerprint(params: Iterable[tuple[str, torch.Tensor]], version: str = "") -> str:
    """A digest of named parameters: per parameter (sorted by name) its name, dtype, shape and
    ``_SAMPLES`` runs of ``_SAMPLE_ELEMS`` elements at evenly spaced offsets (first and last
    included); ``version`` (the driver's, may be empty) is bound as well. Reads a few KiB per
    parameter (copied to the host), whatever the model's size."""
    import torch   # here, not at import: the scheduler's bookkeeping (LiveWeights) needs no torch

    if not isinstance(version, str) or len(version) > _VERSION_MAX:
        raise ValueError(f"weights version must be a string of at most {_VERSION_MAX} characters")
    h = hashlib.sha256(b"kvfabric-live-weights-v1\0" + version.encode() + b"\0")
    for name, p in sorted(params, key=lambda np: np[0]):
        t = p.detach().reshape(-1)
        h.update(b"%s\0%s\0%s\0" % (name.encode(), str(t.dtype).encode(), str(tuple(p.shape)).encode()))
        n = t.numel()
        if not n:
            continue
        runs = []
        for i in range(_SAMPLES):
            off = max(0, (n - _SAMPLE_ELEMS) * i // (_SAMPLES - 1))
            runs.append(t[off:off + _SAMPLE_ELEMS])
        sample = torch.cat(runs).to("cpu").contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def refresh_weights_version(worker: Any, version: str = "") -> str:
    """``llm.collective_rpc(refresh_weights_version[, kwargs={"version": v}])``: measure this
    worker's weights now and bind them (module docstring); returns this rank's fingerprint.

    Raises (into the driver's RPC) when vLLM runs without the kvfabric connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from .connector import KVFabricConnector

    if not has_kv_transfer_group() or not isinstance(get_kv_transfer_group(), KVFabricConnector):
        raise RuntimeError("refresh_weights_version: this engine does not run the kvfabric connector")
    return get_kv_transfer_group().bind_weights(worker.get_model(), version)


@dataclass
class WeightsReport:
    """What the workers measured: per TP rank ``(epoch, fingerprint)``; ``fingerprint`` "" when the
    rank was asked (a reset) but has no model to measure (never given one)."""

    ranks: dict[int, tuple[int, str]] = field(default_factory=dict)

    def merge(self, other: WeightsReport) -> WeightsReport:
        ranks = dict(self.ranks)
        for r, (e, fp) in other.ranks.items():
            if r not in ranks or e >= ranks[r][0]:
                ranks[r] = (e, fp)
        return WeightsReport(ranks)


class LiveWeights:
    """The scheduler's view of the weights its workers hold (pure bookkeeping; module docstring).

    ``current``: ``()`` the files' weights (nothing measured yet), a tuple of the TP ranks'
    fingerprints, or None: unknown (the pool is off for new requests). ``pending``: a reset was
    seen and not every rank has reported since."""

    def __init__(self, tp_size: int, files_tag: str = "") -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.files_tag = files_tag
        self.epoch = 0                   # resets seen (sent to the workers in the metadata)
        self.current: tuple[str, ...] | None = ()
        self._ranks: dict[int, tuple[int, str]] = {}
        self._pending_since = 0.0        # monotonic time of the unanswered reset (0: none)
        self._held_since = 0.0           # when a lookup first waited for it (0: none yet)

    @property
    def pending(self) -> bool:
        return bool(self._pending_since)

    def reset(self, now: float | None = None) -> int:
        """vLLM reset the connector's cache (maybe after a weight update): hold until every rank
        has measured its weights again; the new epoch."""
        self.epoch += 1
        self._pending_since = time.monotonic() if now is None else now
        self._held_since = 0.0
        return self.epoch

    def report(self, rep: WeightsReport) -> bool:
        """Take the workers' report; True if ``current`` changed."""
        for r, (e, fp) in rep.ranks.items():
            if 0 <= r < self.tp_size and (r not in self._ranks or e >= self._ranks[r][0]):
                self._ranks[r] = (e, fp)
        if len(self._ranks) < self.tp_size:
            return False
        if self.pending and any(self._ranks[r][0] < self.epoch for r in range(self.tp_size)):
            return False
        fps = tuple(self._ranks[r][1] for r in range(self.tp_size))
        new = None if not all(fps) else fps
        self._pending_since = self._held_since = 0.0
        changed, self.current = new != self.current, new
        return changed

    def expire(self, limit_s: float, now: float | None = None) -> bool:
        """Called by a lookup that waits for the reset's measurement: the reset unanswered ``limit_s``
        after the first such lookup makes the version unknown (pool off); True if so now.

        The clock starts at the first waiting lookup, not at the reset: the workers measure at the
        next engine step, and an idle engine (an RL driver resets between rollouts) runs none until
        a request comes, however long after the reset that is."""
        now = time.monotonic() if now is None else now
        if not self.pending:
            return False
        if not self._held_since:
            self._held_since = now
        if now - self._held_since <= limit_s:
            return False
        self._pending_since = self._held_since = 0.0
        self.current = None
        return True

    def tag(self) -> str | None:
        """What the namespace binds as ``weights``: the files' fingerprint before any measurement,
        else a digest of the ranks' fingerprints; None when unknown."""
        if self.current is None:
            return None
        if not self.current:
            return self.files_tag
        return "live-" + hashlib.sha256("\0".join(self.current).encode()).hexdigest()[:32]


class KVFabricWorkerExtension:
    """Worker methods an OpenAI server can run by name: start vLLM with ``--worker-extension-cls
    kvfabric_vllm.weights.KVFabricWorkerExtension`` and ``VLLM_SERVER_DEV_MODE=1``, then
    ``POST /collective_rpc {"method": "refresh_weights_version"}`` (optionally ``"kwargs":
    {"version": "step-42"}``).

    vLLM 0.32's ``/collective_rpc`` endpoint calls a worker attribute named by a string with string
    arguments only (no pickled function), so the function above cannot be sent over HTTP; vLLM mixes
    this class into its worker class, which gives the name. ``reload_weights`` (``{"kwargs":
    {"weights_path": DIR}}``) is vLLM's own and needs nothing from here."""

    def refresh_weights_version(self, version: str = "") -> str:
        """:func:`refresh_weights_version` on this worker (raises without the kvfabric connector)."""
        return refresh_weights_version(self, version)

    def kvfabric_weights_fingerprint(self) -> str:
        """This worker's :func:`params_fingerprint` now, bound nowhere: a check any engine (with or
        without the connector) can answer that its weights in memory changed."""
        return params_fingerprint(self.get_model().named_parameters())
