"""Two real servers with different auth tokens: the one that rejects is named, the backend serves with the other."""

from __future__ import annotations

import logging

import pytest
import torch

from kvfabric import sharding
from kvfabric.testing.servers import start_server
from lmcache_helpers import engine_config, kvfabric_connector, wait_until
from test_engine import CHUNK, TOKENS, chunk_keys, prompt

pytestmark = pytest.mark.lmcache


@pytest.fixture
def servers():
    a = start_server("64MiB", extra_args=["--auth-token", "tok-a"])
    b = start_server("64MiB", extra_args=["--auth-token", "tok-b"])
    try:
        yield a, b
    finally:
        a.kill()
        b.kill()


def _config(a, b, token: str):
    cfg = engine_config(f"kvfabric://{a.address},{b.address}?timeout_s=10&connect_timeout_s=5")
    cfg.extra_config["remote_storage_plugin.kvfabric.auth_token"] = token
    return cfg


def test_one_server_rejecting_the_token_is_named_and_the_backend_serves_with_the_other(servers, engines, caplog) -> None:
    a, b = servers
    with caplog.at_level(logging.ERROR, logger="kvfabric.client"):
        _, e1 = engines(_config(a, b, "tok-a"))
    conn = kvfabric_connector(e1)  # the backend is up
    assert any(b.address in r.getMessage() and "AUTH_FAILED" in r.getMessage() for r in caplog.records)
    shards = conn.client.stats()["client"]["shards"]
    assert shards[a.address]["up"] and not shards[b.address]["up"]

    # a prompt whose first chunk lives on a and a later one on b
    for seed in range(1, 200):
        tokens, kv = prompt(seed)
        owners = [row[0] for row in sharding.owner_table(conn.keymap.many(chunk_keys(e1, tokens)), [a.address, b.address])]
        if owners[0] == 0 and 1 in owners:
            break
    on_a = owners.count(0)
    e1.store(tokens, kv=kv)
    wait_until(lambda: conn.counts()["puts"] >= len(owners), what="the puts")
    assert (conn.counts()["puts_stored"], conn.counts()["puts_dropped"]) == (on_a, len(owners) - on_a)

    lead = owners.index(1) * CHUNK  # the leading run the pool can serve: the chunks before b's first one
    _, e2 = engines(_config(a, b, "tok-a"))
    out = torch.zeros_like(kv)
    assert int(e2.retrieve(tokens, kv=out).sum()) == lead
    assert torch.equal(out[:, :, :lead].view(torch.int16), kv[:, :, :lead].view(torch.int16))
    assert lead < TOKENS


def test_every_server_rejecting_names_one_and_the_engine_runs_without_the_backend(servers, engines, caplog) -> None:
    a, b = servers
    with caplog.at_level(logging.WARNING):  # LMCache logs a backend it cannot build as a warning
        _, e = engines(_config(a, b, "tok-c"))
    backend = e.storage_manager.storage_backends.get("RemoteBackend-kvfabric")
    assert backend is None or backend.connection is None
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "AUTH_FAILED" in text and (a.address in text or b.address in text), text[-2000:]
    tokens, kv = prompt(seed=5)
    e.store(tokens, kv=kv)  # nothing raises
    assert int(e.retrieve(tokens, kv=torch.zeros_like(kv)).sum()) == 0
