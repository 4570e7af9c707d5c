"""The plugin follows a cluster's members in etcd: a real etcd, real ``kvfabric serve --etcd`` servers."""

from __future__ import annotations

import pytest
import torch

from kvfabric import Client
from kvfabric.testing.etcd import etcd  # noqa: F401  (the fixture; skips with the reason without etcd)
from kvfabric.testing.servers import start_server
from lmcache_helpers import PLUGIN_EXTRA, engine_config, kvfabric_connector, wait_until
from test_engine import CHUNKS, TOKENS, chunk_keys, prompt

pytestmark = pytest.mark.lmcache


@pytest.fixture
def members(etcd):  # noqa: F811
    procs = [start_server("64MiB", extra_args=["--etcd", etcd.url, "--cluster", "lmc", "--server-id", sid])
             for sid in ("lmc-a", "lmc-b")]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()


def test_engines_find_the_pool_through_etcd_by_url_and_by_config_keys(etcd, members, engines) -> None:  # noqa: F811
    _, e1 = engines(engine_config(f"kvfabric://?etcd={etcd.url}&cluster=lmc&timeout_s=10&connect_timeout_s=5"))
    c1 = kvfabric_connector(e1)
    wait_until(lambda: sorted(c1.client.members) == ["lmc-a", "lmc-b"], what="both members")
    wait_until(lambda: all(s["up"] for s in c1.client.stats()["client"]["shards"].values()), what="both up")
    assert c1.client.config.etcd == etcd.url and not c1.client.config.servers

    for seed in range(1, 100):  # a prompt whose chunks land on both members
        tokens, kv = prompt(seed)
        if len({row[0] for row in c1.client.route(c1.keymap.many(chunk_keys(e1, tokens)))}) == 2:
            break
    e1.store(tokens, kv=kv)
    wait_until(lambda: c1.counts()["puts"] >= CHUNKS, what="the puts")
    assert c1.counts()["puts_stored"] == CHUNKS
    with Client([p.address for p in members]) as probe:
        held = [s["objects"] for s in probe.stats()["servers"].values()]
    assert sum(held) == CHUNKS and all(held), held

    cfg = engine_config("unused")  # the second engine names etcd through config keys, no URL
    cfg.extra_config = {**PLUGIN_EXTRA, "remote_storage_plugin.kvfabric.etcd": etcd.url,
                        "remote_storage_plugin.kvfabric.cluster": "lmc", "remote_storage_plugin.kvfabric.timeout_s": 10}
    _, e2 = engines(cfg)
    c2 = kvfabric_connector(e2)
    wait_until(lambda: all(s["up"] for s in c2.client.stats()["client"]["shards"].values())
               and len(c2.client.members) == 2, what="the second engine's members")
    out = torch.zeros_like(kv)
    assert int(e2.retrieve(tokens, kv=out).sum()) == TOKENS
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
