"""ClientConfig's etcd TLS settings (declared once, with their KVFABRIC_* variables) and its masked repr."""

from __future__ import annotations

import pytest

from kvfabric import ClientConfig, ConfigError
from kvfabric.config import ENV_VARS


def test_etcd_tls_settings_from_the_environment():
    env = {"KVFABRIC_ETCD": "https://etcd:2379", "KVFABRIC_ETCD_CA": "/ca.pem", "KVFABRIC_ETCD_CERT": "/c.pem",
           "KVFABRIC_ETCD_KEY": "/k.pem"}
    cfg = ClientConfig.from_env(env)
    assert (cfg.etcd, cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key) == ("https://etcd:2379", "/ca.pem", "/c.pem", "/k.pem")
    assert {ENV_VARS[v] for v in env} == {"etcd", "etcd_ca", "etcd_cert", "etcd_key"}
    assert ClientConfig(etcd_cert="/c.pem").etcd_key == ""  # a key inside the certificate's file
    with pytest.raises(ConfigError, match="etcd_key needs etcd_cert"):
        ClientConfig(etcd="https://etcd:2379", etcd_key="/k.pem")
    with pytest.raises(ConfigError, match="etcd_ca must be a string"):
        ClientConfig(etcd_ca=5)


def test_repr_masks_every_secret():
    cfg = ClientConfig(etcd="https://root:pw-s3cr@etcd:2379", auth_token="tok-s3cr", key_secret="key-s3cr")
    shown = repr(cfg)
    assert "s3cr" not in shown, shown
    assert "etcd='https://root:***@etcd:2379'" in shown and "auth_token='***'" in shown and "key_secret='***'" in shown
    assert repr(ClientConfig()).count("***") == 0  # nothing to mask: nothing masked
