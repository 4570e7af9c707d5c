"""URL/config parsing, the adapter's URL matching, and the plugin found from YAML or env alone."""

from __future__ import annotations

import json

import pytest

from kvfabric import ConfigError
from kvfabric_lmcache import KVFabricConnector, KVFabricConnectorAdapter
from kvfabric_lmcache.config import parse_url, settings_from_lmcache
from lmcache.v1.config import LMCacheEngineConfig
from lmcache_helpers import PLUGIN_EXTRA, kvfabric_connector

pytestmark = pytest.mark.lmcache

NO_ENV: dict[str, str] = {}


def test_parse_url_servers_and_options() -> None:
    servers, opts = parse_url("kvfabric://127.0.0.1:7070,10.0.0.2:7071/?timeout_s=0.5&lease_ms=100")
    assert servers == ("127.0.0.1:7070", "10.0.0.2:7071")
    assert opts == {"timeout_s": "0.5", "lease_ms": "100"}


@pytest.mark.parametrize(
    "url, match",
    [
        ("lm://127.0.0.1:7070", "starts with"),
        ("kvfabric://", "names no server"),
        ("kvfabric://127.0.0.1", "host:port"),
        ("kvfabric://127.0.0.1:99999", "host:port"),
        ("kvfabric://h:1,h:1", "duplicate"),
        ("kvfabric://h:1?bogus=1", "unknown kvfabric URL option"),
        ("kvfabric://h:1?auth_token=x", "must not be put in the URL"),
        ("kvfabric://h:1?timeout_s=1&timeout_s=2", "given twice"),
        ("kvfabric://h:1?etcd=http://127.0.0.1:2379", "names servers and etcd"),
        ("kvfabric://?cluster=c", "names no server"),
    ],
)
def test_parse_url_rejects(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_url(url)


def test_settings_from_plugin_url_and_extra_config() -> None:
    extra = {
        "remote_storage_plugin.kvfabric.url": "kvfabric://127.0.0.1:7070,127.0.0.1:7071?timeout_s=0.75",
        "remote_storage_plugin.kvfabric.timeout_s": 9,  # the URL wins
        "remote_storage_plugin.kvfabric.replicas": 2,
        "remote_storage_plugin.kvfabric.verify_checksums": "false",
        "remote_storage_plugin.kvfabric.auth_token": "s3cret",
        "remote_storage_plugin.kvfabric.io_threads": "2",
    }
    s = settings_from_lmcache("plugin://kvfabric", "kvfabric", extra, environ=NO_ENV)
    assert s.client.servers == ("127.0.0.1:7070", "127.0.0.1:7071")
    assert s.client.timeout_s == 0.75
    assert s.client.replicas == 2
    assert s.client.verify_checksums is False
    assert s.client.auth_token == "s3cret"
    assert s.io_threads == 2
    assert s.lease_ms == 10_000


def test_settings_instance_name_falls_back_to_type_keys() -> None:
    extra = {
        "remote_storage_plugin.kvfabric.primary.url": "kvfabric://127.0.0.1:1",
        "remote_storage_plugin.kvfabric.lease_ms": 5,
    }
    s = settings_from_lmcache("plugin://kvfabric.primary", "kvfabric.primary", extra, environ=NO_ENV)
    assert s.client.servers == ("127.0.0.1:1",)
    assert s.lease_ms == 5


def test_settings_etcd_membership_from_url_or_extra_config() -> None:
    env = {"KVFABRIC_SERVERS": "127.0.0.1:7070"}  # an explicit etcd wins over the environment's list
    s = settings_from_lmcache("kvfabric://?etcd=http://127.0.0.1:2379,http://127.0.0.1:2381&cluster=prod&timeout_s=2",
                              None, {}, environ=env)
    assert (s.client.servers, s.client.etcd, s.client.cluster, s.client.timeout_s) == (
        (), "http://127.0.0.1:2379,http://127.0.0.1:2381", "prod", 2.0)
    extra = {"remote_storage_plugin.kvfabric.etcd": "http://10.0.0.9:2379", "remote_storage_plugin.kvfabric.cluster": "c1"}
    s = settings_from_lmcache("plugin://kvfabric", "kvfabric", extra, environ=env)
    assert (s.client.servers, s.client.etcd, s.client.cluster) == ((), "http://10.0.0.9:2379", "c1")
    s = settings_from_lmcache("kvfabric://127.0.0.1:1", None, {}, environ={"KVFABRIC_ETCD": "http://h:2"})
    assert (s.client.servers, s.client.etcd) == (("127.0.0.1:1",), "")  # an explicit list wins over KVFABRIC_ETCD
    with pytest.raises(ConfigError, match="both set"):
        settings_from_lmcache("kvfabric://127.0.0.1:1", None, {"remote_storage_plugin.kvfabric.etcd": "http://h:2"},
                              environ={})


def test_settings_from_kvfabric_env_when_no_url() -> None:
    env = {"KVFABRIC_SERVERS": "127.0.0.1:7070", "KVFABRIC_TIMEOUT_S": "0.3", "KVFABRIC_KEY_ALGORITHM": "sha256"}
    s = settings_from_lmcache("plugin://kvfabric", "kvfabric", {}, environ=env)
    assert s.client.servers == ("127.0.0.1:7070",)
    assert s.client.timeout_s == 0.3
    assert s.client.key_algorithm == "sha256"


@pytest.mark.parametrize(
    "url, extra, match",
    [
        ("plugin://kvfabric", {}, "no kvfabric servers configured"),
        ("plugin://kvfabric", {"remote_storage_plugin.kvfabric.url": 7}, "must be a string"),
        ("plugin://other", {}, "cannot handle URL"),
        ("plugin://kvfabric", {"remote_storage_plugin.kvfabric.url": "kvfabric://h:1", "remote_storage_plugin.kvfabric.replicas": "two"}, "replicas"),
        ("plugin://kvfabric", {"remote_storage_plugin.kvfabric.url": "kvfabric://h:1", "remote_storage_plugin.kvfabric.lease_ms": -1}, "lease_ms"),
        ("plugin://kvfabric", {"remote_storage_plugin.kvfabric.url": "kvfabric://h:1", "remote_storage_plugin.kvfabric.timeout_s": True}, "timeout_s"),
    ],
)
def test_settings_errors_name_the_setting(url: str, extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        settings_from_lmcache(url, "kvfabric", extra, environ=NO_ENV)


@pytest.mark.parametrize(
    "url, ok",
    [
        ("kvfabric://127.0.0.1:7070", True),
        ("plugin://kvfabric", True),
        ("plugin://kvfabric.primary", True),
        ("plugin://kvfabricx", False),
        ("plugin://fs", False),
        ("lm://127.0.0.1:65432", False),
    ],
)
def test_adapter_accepts_its_urls_only(url: str, ok: bool) -> None:
    assert KVFabricConnectorAdapter().can_parse(url) is ok


YAML = """\
chunk_size: 256
local_cpu: false
max_local_cpu_size: 0.05
save_unfull_chunk: true
remote_serde: naive
remote_storage_plugins: ["kvfabric"]
extra_config:
  remote_storage_plugin.kvfabric.module_path: kvfabric_lmcache
  remote_storage_plugin.kvfabric.class_name: KVFabricConnectorAdapter
  remote_storage_plugin.kvfabric.url: "kvfabric://{servers}?timeout_s=1"
"""


def test_plugin_built_from_yaml_file_alone(tmp_path, pool, engines) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(YAML.format(servers=",".join(pool.addresses)))
    _, engine = engines(LMCacheEngineConfig.from_file(str(path)))
    conn = kvfabric_connector(engine)
    assert conn.client.servers == tuple(pool.addresses)
    assert conn.client.config.timeout_s == 1.0


def test_plugin_built_from_lmcache_env_alone(monkeypatch, pool, engines) -> None:
    extra = {**PLUGIN_EXTRA, "remote_storage_plugin.kvfabric.url": "kvfabric://" + ",".join(pool.addresses)}
    for var, val in {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05",
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_REMOTE_STORAGE_PLUGINS": "kvfabric",
        "LMCACHE_EXTRA_CONFIG": json.dumps(extra),
    }.items():
        monkeypatch.setenv(var, val)
    config = LMCacheEngineConfig.from_env()
    assert config.remote_storage_plugins == ["kvfabric"]
    _, engine = engines(config)
    conn = kvfabric_connector(engine)
    assert isinstance(conn, KVFabricConnector)
    assert conn.client.servers == tuple(pool.addresses)
