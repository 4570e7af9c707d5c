"""The connector's counters in vLLM's own stats: the log line and ``/metrics``.

vLLM 0.32's KV-connector stats interface (``vllm/distributed/kv_transfer/
kv_connector/v1/metrics.py``): every step, the model runner calls the worker
connector's ``get_kv_connector_stats()`` and the scheduler its own; vLLM
aggregates the two (``KVConnectorStats.aggregate``), ships the dict
(``to_dict()``) to its stat loggers, which rebuild it with the connector class's
``build_kv_connector_stats`` (the periodic "KV Transfer metrics" log line, from
``reduce()``) and hand it to the object the class's ``build_prom_metrics``
made (``observe()``), which feeds the Prometheus metrics served at the
OpenAI server's ``/metrics``.

What travels is one interval's increments (``Counters.take_interval``): each
counter's increase (ints) and the load / save timings observed (lists of
seconds). :class:`KVFabricPromMetrics` adds them to ``vllm:kvfabric_<name>``
counters and ``vllm:kvfabric_load_seconds`` / ``vllm:kvfabric_save_seconds``
histograms, labelled like vLLM's own (``model_name``, ``engine``). Names and
meanings come from ``kvfabric/metrics.py`` (``VLLM``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvfabric.metrics import COUNTER, HISTOGRAM, VLLM

PROM_PREFIX = "vllm:kvfabric_"
#: Buckets of the load / save timings (seconds): a 2 MiB chunk over loopback is ~1 ms, a big
#: prefix from a remote pool ~100 ms, a timed-out load its deadline (seconds).
TIMING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class KVFabricStats(KVConnectorStats):
    """One or more intervals' increments: ``data`` maps a counter name to its increase and a timing
    name to the list of seconds observed (both from ``kvfabric/metrics.py`` ``VLLM``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, list):
                self.data[k] = list(self.data.get(k, [])) + list(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: each counter's sum, and count / mean milliseconds of each timing."""
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, list):
                out[f"{k}_n"] = len(v)
                out[f"{k}_mean_ms"] = round(1000 * sum(v) / len(v), 3) if v else 0.0
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVFabricPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvfabric_*`` Prometheus metrics, fed one interval at a time by ``observe``."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for name, m in VLLM.items():
            if m.kind == COUNTER:
                self._families[name] = self._counter_cls(
                    name=PROM_PREFIX + name, documentation=m.help, labelnames=labelnames)
            elif m.kind == HISTOGRAM:
                self._families[name] = self._histogram_cls(
                    name=PROM_PREFIX + name, documentation=m.help, labelnames=labelnames,
                    buckets=list(TIMING_BUCKETS))
        # (engine, name) -> the metric with that engine's labels bound
        self._bound = {(e, name): fam.labels(*values)
                       for e, values in per_engine_labelvalues.items() for name, fam in self._families.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, v in transfer_stats_data.items():
            metric = self._bound.get((engine_idx, name))
            if metric is None:  # a name this version does not know: nothing to add it to
                continue
            if isinstance(v, list):
                for seconds in v:
                    metric.observe(seconds)
            elif v > 0:
                metric.inc(v)


__all__ = ["KVFabricPromMetrics", "KVFabricStats", "PROM_PREFIX", "TIMING_BUCKETS"]
