"""Helpers shared by the LMCache plugin tests (engine config, engine building, waiting)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvfabric_lmcache import KVFabricConnector
from kvfabric_lmcache.cpu_kv import CPUKVConnector

# A small model shape: 4 layers, 2 KV heads of 64 -> 1 KiB of KV per token per K/V, 512 KiB per 256-token chunk.
LAYERS, KV_HEADS, HEAD_SIZE, CHUNK = 4, 2, 64, 256
DTYPE = torch.float16
HIDDEN = KV_HEADS * HEAD_SIZE
PLUGIN_EXTRA = {
    "remote_storage_plugin.kvfabric.module_path": "kvfabric_lmcache",
    "remote_storage_plugin.kvfabric.class_name": "KVFabricConnectorAdapter",
}


def metadata(model: str = "kvfabric/test-model") -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=DTYPE, kv_shape=CPUKVConnector.kv_shape(LAYERS, KV_HEADS, HEAD_SIZE, CHUNK), chunk_size=CHUNK,
    )


def engine_config(url: str, **overrides) -> LMCacheEngineConfig:
    """Local CPU cache off (every hit must come from the pool), partial chunks saved."""
    kw = dict(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, save_unfull_chunk=True,
        remote_serde="naive", remote_storage_plugins=["kvfabric"],
        extra_config={**PLUGIN_EXTRA, "remote_storage_plugin.kvfabric.url": url},
    )
    kw.update(overrides)
    return LMCacheEngineConfig.from_defaults(**kw)


def build_engine(config: LMCacheEngineConfig, md: LMCacheMetadata | None = None) -> tuple[str, LMCacheEngine]:
    name = f"kvfabric-test-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        name, config, md or metadata(), CPUKVConnector(LAYERS, HIDDEN, DTYPE), lambda t, r: None, lambda o, r: o
    )
    engine.post_init()
    return name, engine


def kvfabric_connector(engine: LMCacheEngine) -> KVFabricConnector:
    """The plugin's connector inside an engine (raises if the plugin did not load)."""
    backend = engine.storage_manager.storage_backends["RemoteBackend-kvfabric"]
    assert backend.connection is not None, "the kvfabric plugin was not built (see LMCache's log)"
    conn = backend.connection.getWrappedConnector()
    assert isinstance(conn, KVFabricConnector)
    return conn


def wait_until(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll ``pred`` until true; fail the test after ``timeout_s`` (a deadline, not a timing assertion)."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
