"""The vLLM connector's ``kv_connector_extra_config`` with ``etcd`` + ``cluster`` instead of ``servers``:
the config part only (``kvfabric_vllm.config`` imports without vLLM), against a real etcd and real
``kvfabric serve --etcd`` processes. The client built from it is the one the connector builds
(``Client(config=cfg.client)``, connectors/kvfabric_vllm/connector.py).
"""

from __future__ import annotations

import random

import pytest

from kvfabric import Client, ConfigError
from kvfabric.testing.etcd import etcd  # noqa: F401  (the fixture)
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server
from kvfabric_vllm.config import parse_extra_config

WAIT_S = 60.0


def test_extra_config_with_etcd_routes_to_the_registered_servers(etcd, monkeypatch):
    monkeypatch.setenv("KVFABRIC_SERVERS", "127.0.0.1:1")  # the extra_config's etcd wins over the env list
    servers = [start_server(capacity="16MiB", extra_args=["--etcd", etcd.url, "--cluster", "vllm-a",
                                                          "--server-id", f"pool-{i}"]) for i in range(3)]
    try:
        cfg = parse_extra_config({"etcd": etcd.url, "cluster": "vllm-a", "transport": "tcp", "replicas": 1},
                                 "kv_both", 16)
        assert (cfg.client.etcd, cfg.client.cluster, cfg.client.servers) == (etcd.url, "vllm-a", ())
        with Client(config=cfg.client) as client:
            assert wait_for(lambda: sorted(client.members) == ["pool-0", "pool-1", "pool-2"], WAIT_S), client.members
            keys = [random.Random(i).randbytes(16) for i in range(300)]
            assert client.put(keys, [k * 4 for k in keys]).dropped == 0
            assert client.get(keys) == [k * 4 for k in keys]
            # every key sits on the server route() names (asked directly, one static client per server)
            by_id = {s["server_id"]: addr for addr, s in client.stats()["servers"].items()}
            owners = client.route(keys)
            for sid, addr in by_id.items():
                with Client([addr]) as direct:
                    held = direct.exists(keys)
                assert held == [o == [sid] for o in owners]
    finally:
        for s in servers:
            s.kill()


def test_extra_config_membership_errors(monkeypatch):
    monkeypatch.setenv("KVFABRIC_ETCD", "http://127.0.0.1:1")  # a static extra_config wins over the env etcd
    cfg = parse_extra_config({"servers": ["127.0.0.1:7070"]}, "kv_both", 16)
    assert (cfg.client.servers, cfg.client.etcd) == (("127.0.0.1:7070",), "")
    cfg = parse_extra_config({"etcd": "http://127.0.0.1:2379"}, "kv_both", 16)
    assert cfg.client.cluster == "default"
    for extra, msg in [
        ({"etcd": "http://e:2379", "servers": ["h:1"]}, "not both"),
        ({"cluster": "c", "servers": ["h:1"]}, "cluster needs etcd"),
        ({"etcd": ""}, "etcd must be"),
        ({"etcd": 5}, "etcd must be"),
        ({"etcd": "http://e:2379", "cluster": "bad name"}, "cluster"),
        ({}, "servers is required"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            parse_extra_config(extra, "kv_both", 16)
