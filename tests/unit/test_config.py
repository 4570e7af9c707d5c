"""ClientConfig parsing: env vars, overrides, and clear errors."""

import pytest

from kvfabric.config import ENV_VARS, ClientConfig, parse_servers, parse_size
from kvfabric.errors import ConfigError


def test_sizes():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MB") == 512_000_000
    assert parse_size("64KiB") == 65536
    assert parse_size("1.5MiB") == 1572864
    assert parse_size(1024) == 1024
    for bad in ("", "4XB", "-1", "GiB", "1 2"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    # the client's settings and the benchmarks read sizes as the server does: 4G is refused, not 4e9
    with pytest.raises(ConfigError, match="did you mean 4GiB"):
        parse_size("4G")


def test_servers():
    assert parse_servers("127.0.0.1:7070, localhost:7071") == ("127.0.0.1:7070", "localhost:7071")
    assert parse_servers(["h:1"]) == ("h:1",)
    for bad in ("h", "h:0", "h:70000", ":1", "h:1,h:1"):
        with pytest.raises(ConfigError):
            parse_servers(bad)


def test_env_then_overrides():
    env = {"KVFABRIC_SERVERS": "a:1,b:2", "KVFABRIC_TIMEOUT_S": "0.25", "KVFABRIC_REPLICAS": "2",
           "KVFABRIC_VERIFY_CHECKSUMS": "off", "KVFABRIC_TRANSPORT": "tcp", "UNRELATED": "x"}
    c = ClientConfig.from_env(env, replicas=3, auth_token=None)
    assert c.servers == ("a:1", "b:2") and c.timeout_s == 0.25 and c.replicas == 3
    assert c.verify_checksums is False and c.transport == "tcp" and c.auth_token is None


@pytest.mark.parametrize(
    "env",
    [{"KVFABRIC_TIMEOUT_S": "soon"}, {"KVFABRIC_TIMEOUT_S": "0"}, {"KVFABRIC_TRANSPORT": "carrier-pigeon"},
     {"KVFABRIC_REPLICAS": "0"}, {"KVFABRIC_KEY_ALGORITHM": "md5"}, {"KVFABRIC_VERIFY_CHECKSUMS": "maybe"},
     {"KVFABRIC_MAX_BATCH_KEYS": "5000"}],
)
def test_bad_env_is_a_clear_error(env):
    with pytest.raises(ConfigError):
        ClientConfig.from_env(env)


def test_unknown_override():
    with pytest.raises(ConfigError):
        ClientConfig.from_env({}, colour="blue")


def test_every_env_var_maps_to_a_field():
    names = set(ClientConfig.__dataclass_fields__)
    assert set(ENV_VARS.values()) <= names
