"""kvfabric as an LMCache remote storage plugin (LMCache 0.5.6).

Select it in LMCache's config (YAML or ``LMCACHE_*`` environment variables),
no patch to LMCache needed::

    remote_storage_plugins: ["kvfabric"]
    extra_config:
      remote_storage_plugin.kvfabric.module_path: kvfabric_lmcache
      remote_storage_plugin.kvfabric.class_name: KVFabricConnectorAdapter
      remote_storage_plugin.kvfabric.url: kvfabric://127.0.0.1:7070,127.0.0.1:7071

Modules: :mod:`.config` (URL and option parsing), :mod:`.keymap`
(CacheEngineKey -> kvfabric key), :mod:`.value` (stored object format),
:mod:`.connector` (the RemoteConnector), :mod:`.memguard` (no access to
LMCache's memory after its teardown frees it), :mod:`.adapter` (the
ConnectorAdapter LMCache loads), :mod:`.scratch` (staging buffers),
:mod:`.l2_adapter` (the L2 adapter of LMCache's multiprocess server, loaded
separately as ``kvfabric_lmcache.l2_adapter``), :mod:`.cpu_kv` (a CPU
stand-in for LMCache's GPU connector, for tests and benchmarks without a GPU).
"""

from __future__ import annotations

from .adapter import KVFabricConnectorAdapter
from .connector import KVFabricConnector

__all__ = ["KVFabricConnector", "KVFabricConnectorAdapter"]
