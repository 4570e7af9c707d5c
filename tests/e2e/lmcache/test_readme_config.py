"""The documented named-instance config, loaded by LMCache's own config loader, gives working backends.

The YAML is taken from the documentation itself (README.md once the LMCache
section holds it, and the README text kept in docs/notes/lmcache.md), so an
example that LMCache cannot load fails here. Only the addresses (to the live
test pools) and ``max_local_cpu_size`` (the example's 5 GB would pin 5 GB
here) are changed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from lmcache.v1.config import LMCacheEngineConfig

from kvfabric import Client
from kvfabric.testing.servers import start_pool
from kvfabric_lmcache import KVFabricConnector
from lmcache_helpers import DTYPE, HIDDEN, LAYERS, wait_until

pytestmark = pytest.mark.lmcache

ROOT = Path(__file__).resolve().parents[3]
MARK = 'remote_storage_plugins: ["kvfabric.a"'


def _examples(path: Path) -> list[str]:
    return [b for b in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S) if MARK in b]


DOCS = [p for p in (ROOT / "README.md", ROOT / "docs/notes/lmcache.md") if _examples(p)]


def _connector(engine, instance: str) -> KVFabricConnector:
    backend = engine.storage_manager.storage_backends[f"RemoteBackend-{instance}"]
    assert backend.connection is not None, f"LMCache did not build the {instance} backend (see its log)"
    conn = backend.connection.getWrappedConnector()
    assert isinstance(conn, KVFabricConnector)
    return conn


def test_the_docs_hold_the_named_instance_example() -> None:
    assert ROOT / "docs/notes/lmcache.md" in DOCS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_named_instance_config_loads_working_backends(doc: Path, tmp_path, engines) -> None:
    (text,) = _examples(doc)
    urls = re.findall(r"kvfabric://[^\s?\"']+", text)
    assert len(urls) == 2, urls
    with start_pool(1, capacity="64MiB") as pa, start_pool(1, capacity="64MiB") as pb:
        for url, pool in zip(urls, (pa, pb)):
            text = text.replace(url, "kvfabric://" + ",".join(pool.addresses))
        cfg = yaml.safe_load(text)
        cfg["max_local_cpu_size"] = 0.05
        path = tmp_path / "lmcache.yaml"
        path.write_text(yaml.safe_dump(cfg))
        config = LMCacheEngineConfig.from_file(str(path))  # LMCache's own loader
        assert config.remote_storage_plugins == ["kvfabric.a", "kvfabric.b"]

        _, engine = engines(config)
        ca, cb = _connector(engine, "kvfabric.a"), _connector(engine, "kvfabric.b")
        assert ca.client.servers == tuple(pa.addresses) and cb.client.servers == tuple(pb.addresses)
        assert ca.client.config.timeout_s == cb.client.config.timeout_s == 1.0  # the shared setting

        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 32000, (512,), generator=g)
        kv = torch.randint(-(2**15), 2**15, (2, LAYERS, 512, HIDDEN), dtype=torch.int16, generator=g).view(DTYPE)
        engine.store(tokens, kv=kv)
        for c in (ca, cb):
            wait_until(lambda: c.counts()["puts"] >= 2, what="both instances' puts")
            assert c.counts()["puts_stored"] == 2
        for pool in (pa, pb):
            with Client(pool.addresses) as probe:
                assert sum(s["objects"] for s in probe.stats()["servers"].values()) == 2

        _, e2 = engines(config)
        out = torch.zeros_like(kv)
        assert int(e2.retrieve(tokens, kv=out).sum()) == 512
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
