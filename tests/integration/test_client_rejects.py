"""A server that rejects the client's auth token: named in the error; with ``allow_rejects`` the others serve."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvfabric import Client, ClientConfig, sharding
from kvfabric.errors import RemoteError
from kvfabric.testing.servers import start_server


@pytest.fixture
def two_tokens():
    a = start_server("8MiB", extra_args=["--auth-token", "token-a"])
    b = start_server("8MiB", extra_args=["--auth-token", "token-b"])
    try:
        yield a, b
    finally:
        a.kill()
        b.kill()


def _cfg(token: str) -> ClientConfig:
    return ClientConfig(auth_token=token, timeout_s=10.0, connect_timeout_s=5.0)


def test_a_rejecting_server_is_named_and_the_others_serve_with_allow_rejects(two_tokens, caplog) -> None:
    a, b = two_tokens
    with pytest.raises(RemoteError) as e:
        Client([a.address, b.address], config=_cfg("token-a"))
    assert e.value.code.name == "AUTH_FAILED" and b.address in str(e.value) and a.address not in str(e.value)

    with caplog.at_level(logging.ERROR, logger="kvfabric.client"):
        client = Client([a.address, b.address], config=_cfg("token-a"), allow_rejects=True)
    with client:
        assert any(b.address in r.getMessage() and "AUTH_FAILED" in r.getMessage() for r in caplog.records)
        shards = client.stats()["client"]["shards"]
        assert shards[a.address]["up"] and not shards[b.address]["up"]
        # protocol 3: b cannot prove it holds token-a, so this client refuses it
        assert "did not prove it holds the pool token" in shards[b.address]["last_error"]
        assert client.stats()["client"]["servers_refused"] >= 1
        rng = np.random.default_rng(3)
        keys = [rng.bytes(16) for _ in range(40)]
        on_a = [sharding.owner_table([k], [a.address, b.address])[0][0] == 0 for k in keys]
        assert 0 < sum(on_a) < len(keys)
        res = client.put(keys, [k * 4 for k in keys])
        assert (res.stored, res.dropped) == (sum(on_a), len(keys) - sum(on_a))  # b's keys are dropped, never an error
        assert client.get(keys) == [k * 4 if ok else None for k, ok in zip(keys, on_a)]


def test_allow_rejects_still_raises_when_every_server_rejects(two_tokens) -> None:
    a, b = two_tokens
    with pytest.raises(RemoteError) as e:
        Client([a.address, b.address], config=_cfg("token-c"), allow_rejects=True)
    assert e.value.code.name == "AUTH_FAILED" and a.address in str(e.value)
