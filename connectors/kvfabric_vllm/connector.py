"""``KVFabricConnector``: vLLM's ``KVConnectorBase_V1`` wired to a kvfabric pool.

Enable with ``"kv_connector": "KVFabricConnector", "kv_connector_module_path":
"kvfabric_vllm.connector"`` in ``--kv-transfer-config`` (see ``config`` for
``kv_connector_extra_config``). vLLM builds one instance with the SCHEDULER
role (``scheduler.SchedulerSide``) and one per worker with the WORKER role
(``worker.WorkerSide``); this class only routes vLLM's calls to them.

Failure policy: configuration errors and unsupported models (LoRA enabled,
multimodal models, several KV cache groups, pipeline parallelism) raise
``kvfabric.ConfigError`` when vLLM builds the connector: their KV depends on
more than the token ids and the namespace, so sharing it would be wrong. After that nothing
raises into vLLM: a pool that cannot be reached (at start or later), a dead
shard, a checksum failure or a slow pool become misses or failed loads that
vLLM recomputes. Failed loads are reported per block, which vLLM turns into a
recompute only under ``kv_load_failure_policy="recompute"``; kvfabric is a
cache, so the connector sets that policy (and says so in the log) when the
flag left vLLM's default ``"fail"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

from kvfabric import ConfigError, KVFabricError
from kvfabric import Client

from .config import ConnectorConfig, kv_layout_name, make_namespace, parse_extra_config, weights_fingerprint
from .keys import EngineKeys
from .layout import HeadSplit
from .meta import KVFabricMetadata
from .metrics import Counters, log
from .scheduler import SchedulerSide
from .stats import KVFabricPromMetrics, KVFabricStats
from .weights import LiveWeights
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVFabricConnector"]


def _open_client(cfg: ConnectorConfig, counters: Counters) -> Client | None:
    """A client on the pool, or None (connector runs without a pool) when it cannot be built."""
    try:
        return Client(config=cfg.client)
    except KVFabricError as exc:
        counters.fail("client_errors", "cannot use the pool %s: %s; serving without it",
                      ",".join(cfg.client.servers), exc)
        return None


class KVFabricConnector(KVConnectorBase_V1):
    """vLLM KV connector on a kvfabric pool (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
            raise ConfigError("kvfabric: only models with one attention KV cache group are supported "
                              f"(got {len(groups)} groups)")
        spec = groups[0].kv_cache_spec
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise ConfigError("kvfabric: pipeline parallelism is not supported yet")
        if getattr(par, "decode_context_parallel_size", 1) != 1:
            raise ConfigError("kvfabric: decode context parallelism is not supported (a rank's pages hold "
                              "only some of a block's tokens)")
        mc = vllm_config.model_config
        if vllm_config.lora_config is not None:
            raise ConfigError("kvfabric: LoRA is not supported (an adapter changes the KV of the same tokens "
                              "and is not bound into the pool's keys yet); start vLLM without --enable-lora "
                              "or without the kvfabric connector")
        if mc is not None and mc.is_multimodal_model:
            raise ConfigError(f"kvfabric: multimodal models are not supported ({mc.model}: image/audio "
                              "inputs change the KV of the same placeholder tokens and are not bound into "
                              "the pool's keys yet); use a text-only model or run without the connector")
        xfer = self._kv_transfer_config
        self._cfg = parse_extra_config(xfer.kv_connector_extra_config, xfer.kv_role, spec.block_size)
        if xfer.kv_load_failure_policy != "recompute":
            log.warning("kvfabric: setting kv_load_failure_policy=recompute (was %r): a chunk that fails "
                        "to load from the cache pool is recomputed, never fatal", xfer.kv_load_failure_policy)
            xfer.kv_load_failure_policy = "recompute"
        layer_names = list(groups[0].layer_names)
        # Layout 3 (layout.py): objects per KV head of the model, keys without the TP rank or size;
        # MLA: whole pages (every rank holds the same latent)
        tp = par.tensor_parallel_size
        heads = HeadSplit.for_model(mc.get_total_num_kv_heads(), tp,
                                    mla=bool(mc.use_mla) or isinstance(spec, MLAAttentionSpec),
                                    per_object=self._cfg.kv_heads_per_object)
        if heads.split and spec.num_kv_heads != len(heads.heads(0)):
            raise ConfigError(f"kvfabric: a TP rank holds {spec.num_kv_heads} KV heads, but {heads.total_heads} "
                              f"heads over tensor_parallel_size {tp} give {len(heads.heads(0))}")
        layout = kv_layout_name(str(kv_cache_config.kv_cache_layout), num_kv_heads=heads.total_heads,
                                head_size=spec.head_size, head_size_v=spec.head_size_v,
                                block_size=spec.block_size, num_layers=len(layer_names), split_heads=heads.split,
                                heads_per_object=heads.per_object)
        files_weights = weights_fingerprint(mc.model)
        namespace = make_namespace(self._cfg, model=mc.model, revision=mc.revision, dtype=str(spec.dtype),
                                   kv_layout=layout, weights=files_weights)
        self._counters = Counters()
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        client = _open_client(self._cfg, self._counters)
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self._cfg, client,
                                        EngineKeys.from_config(self._cfg, namespace, len(layer_names), heads),
                                        spec.block_size, self._counters, lambda: self._kv_cache_manager,
                                        LiveWeights(tp, files_weights))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(self._cfg, client, get_tensor_model_parallel_rank(), spec.block_size,
                                      layer_names, self._counters, heads=heads)
        log.info("kvfabric connector (%s): servers %s, chunk %d tokens, %s, namespace %s", role.name,
                 ",".join(self._cfg.client.servers), self._cfg.chunk_tokens,
                 f"one object per layer and {heads.per_object} KV head(s) ({heads.total_heads} heads, TP {tp})"
                 if heads.split
                 else "one object per layer (MLA)", namespace)

    @property
    def requires_kv_delivery(self) -> bool:
        return False   # a cache: a dropped save is only a future miss

    def counters(self) -> dict[str, int]:
        """This instance's counters (``metrics.COUNTER_NAMES``)."""
        return self._counters.snapshot()

    # ------------------------------------------------------------------ vLLM's stats (kvfabric_vllm.stats)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this instance counted since vLLM last asked (called every step on both sides)."""
        data = self._counters.take_interval()
        return KVFabricStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVFabricStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVFabricPromMetrics:
        return KVFabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def _meta(self) -> KVFabricMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFabricMetadata), type(meta)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._meta()
        self._worker.weights_epoch(meta.weights_epoch)   # a reset: measure the weights again (weights.py)
        if meta.loads:
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Async loads (the default) run between steps and are reported by
        # get_finished; sync loads complete in start_load_kv, unless
        # load_layerwise: then this layer's attention waits for its own objects
        # only, and later layers arrive meanwhile.
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._meta()
        if meta.saves:
            self._worker.gather_layer(layer_name, meta.saves)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._meta()
        if meta.saves:
            self._worker.submit_saves(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Sending: requests the scheduler held for their saves (hold_until_saved,
        # named in the metadata's ``hold``) once their put jobs are done. Async
        # loads report here once done (failed blocks are handed to
        # get_block_ids_with_load_errors, which vLLM calls right after).
        assert self._worker is not None
        sent = self._worker.finished_saves(finished_req_ids, self._meta().hold)
        return sent or None, self._worker.finished_loads() or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.take_worker_meta()

    def bind_weights(self, model: torch.nn.Module, version: str = "") -> str:
        """Worker side: measure and bind the weights this rank holds (``weights.refresh_weights_version``)."""
        assert self._worker is not None, "bind_weights runs on the workers (collective_rpc)"
        return self._worker.bind_weights(model, version)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_block_ids()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        try:
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 - a lookup never fails vLLM's step
            self._counters.fail("lookup_errors", "lookup failed: %r", exc)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        if connector_output.kv_connector_worker_meta is not None:
            self._sched.take_worker_meta(connector_output.kv_connector_worker_meta)
        self._sched.update_connector_output(connector_output.finished_recving)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` / ``pause_generation(clear_cache=True)``:
        the weights may have changed; new lookups wait for the workers to measure them (weights.py).
        The pool itself is not cleared: what it holds is keyed by the weights it was computed with."""
        assert self._sched is not None
        self._sched.reset_weights()
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        # True while an async load still writes into the request's blocks (it
        # was aborted while loading) or, with hold_until_saved, until its saves
        # are acknowledged: vLLM frees them when get_finished reports it. The
        # params ({"kvfabric": ...}) tell a PD consumer what the pool will hold.
        return self._sched.request_finished(request)
