"""``KVFabricConnectorAdapter``: how LMCache finds and builds the kvfabric connector.

LMCache 0.5 loads it from config alone (no patch to LMCache)::

    remote_storage_plugins: ["kvfabric"]
    extra_config:
      remote_storage_plugin.kvfabric.module_path: kvfabric_lmcache
      remote_storage_plugin.kvfabric.class_name: KVFabricConnectorAdapter
      remote_storage_plugin.kvfabric.url: kvfabric://127.0.0.1:7070,127.0.0.1:7071

LMCache then asks every adapter ``can_parse("plugin://kvfabric")`` and calls
``create_connector`` on the first that accepts. This adapter accepts
``plugin://kvfabric``, ``plugin://kvfabric.<instance>`` and
``kvfabric://host:port,...`` (a URL given directly). ``create_connector``
parses the settings (:mod:`.config`; ``ConfigError`` for a bad or missing
URL, which LMCache logs before running without this backend) and builds a
``kvfabric.Client``; unreachable servers do not fail it: they start out
down, read as misses, and are reconnected in the background. Neither do
servers that reject the auth token or protocol version, as long as one
accepts: each is named in an error log and kept down (retried in the
background); when every server rejects, the ``RemoteError`` names one and
LMCache runs without this backend.
"""

from __future__ import annotations

from kvfabric import Client, KeyHasher
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext

from .config import SCHEME, is_plugin_url, settings_from_lmcache
from .connector import KVFabricConnector
from .keymap import KeyMapper


class KVFabricConnectorAdapter(ConnectorAdapter):
    """Builds :class:`KVFabricConnector` for ``kvfabric://`` and ``plugin://kvfabric[.x]`` URLs."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        return url.startswith(SCHEME) or is_plugin_url(url)

    def create_connector(self, context: ConnectorContext) -> KVFabricConnector:
        config, metadata = context.config, context.metadata
        if config is None or metadata is None:
            raise ValueError("the kvfabric LMCache plugin needs LMCache's engine config and metadata")
        settings = settings_from_lmcache(context.url, context.plugin_name, config.extra_config)
        keymap = KeyMapper(KeyHasher(settings.client.key_algorithm, settings.client.key_secret), int(config.chunk_size))
        # A server that rejects the token (or protocol version) stays down and is named in an
        # error log; the backend serves with the others. Only when all reject does this raise.
        client = Client(config=settings.client, allow_rejects=True)
        try:
            return KVFabricConnector(client, keymap, settings, context.loop, context.local_cpu_backend, config, metadata)
        except BaseException:
            client.close()
            raise


__all__ = ["KVFabricConnectorAdapter"]
