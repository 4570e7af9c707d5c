"""What the scheduler-side connector tells the worker-side connector each step.

Plain dataclasses of ints and bytes, so they pickle across processes (vLLM's
multi-process executor sends them to every worker). ``keys[i]`` is chunk
``i``'s key, the same for every TP rank (``layout``, layout version 3): each
rank derives from it the object keys of its own KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .weights import WeightsReport

__all__ = ["LoadSpec", "SaveSpec", "KVFabricMetadata", "KVFabricWorkerMeta"]


@dataclass
class LoadSpec:
    """Read ``len(block_ids)`` chunks from the pool into vLLM blocks.

    Before this step's forward, or with ``async_load`` on the worker's loader
    thread, reported done through ``get_finished`` (vLLM's ``load_kv_async``).

    ``block_ids[i]`` are the vLLM blocks of chunk ``i`` (``chunk_tokens //
    block_size`` each). The first ``skip_blocks`` blocks of chunk 0 are
    already computed locally and are not written.
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[list[int]]
    skip_blocks: int = 0
    async_load: bool = False      # load between steps, report through get_finished
    placement: list[bytes] | None = None  # per chunk: its placement key (layout.py); None: per object
    # the weights the keys were derived under (weights.py): per TP rank its fingerprint; (): the files'
    weights: tuple[str, ...] = ()


@dataclass
class SaveSpec:
    """Gather chunks completed by this step from vLLM blocks and put them in the pool."""

    req_id: str
    keys: list[bytes]
    parents: list[bytes | None]   # per chunk: the previous chunk's key (None for chunk 0)
    block_ids: list[list[int]]
    placement: list[bytes] | None = None  # per chunk: its placement key (layout.py); None: per object
    weights: tuple[str, ...] = ()         # as LoadSpec.weights: a worker holding others refuses the save
    ns_tag: bytes | None = None           # weights_retire: the namespace tag every object is put with


@dataclass
class KVFabricMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Requests finished since the last step whose blocks vLLM keeps (``request_finished``
    # returned True) until every worker reports them in ``finished_sending``: once their
    # save jobs are acknowledged by the pool (``hold_until_saved``).
    hold: list[str] = field(default_factory=list)
    # resets of the connector's cache seen by the scheduler (weights.py): a worker that sees a
    # larger one measures its weights again and reports them (KVFabricWorkerMeta)
    weights_epoch: int = 0


@dataclass
class KVFabricWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler (vLLM aggregates every rank's): what the ranks measured (weights.py)."""

    weights: WeightsReport = field(default_factory=WeightsReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVFabricWorkerMeta), type(other)
        return KVFabricWorkerMeta(self.weights.merge(other.weights))
