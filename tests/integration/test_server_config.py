"""``kvfabric serve`` settings: one ServerConfig from defaults, a TOML file, KVFABRIC_SERVE_* and flags."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.server.config import ServerConfig, defaults
from kvfabric.testing import start_server


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_SERVE_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvfabric", "serve", *args], capture_output=True, text=True,
                          env=full, timeout=120)


def test_flags_override_env_override_file_override_defaults(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('capacity = 33554432\npolicy = "s3fifo"\nport = 7100\nidle_timeout = 12\n'
                   'transports = ["tcp", "native"]\nserver_id = "from-file"\n')
    r = serve("--config", str(cfg), "--port", "7300", "--print-config",
              env={"KVFABRIC_SERVE_PORT": "7200", "KVFABRIC_SERVE_POLICY": "tail-lru"})
    assert r.returncode == 0, r.stderr
    eff = tomllib.loads(r.stdout)
    assert eff["port"] == 7300                     # flag over env over file
    assert eff["policy"] == "tail-lru"                 # env over file
    assert eff["capacity"] == "33554432"           # file over default (bytes from a file are kept as text)
    assert eff["idle_timeout"] == 12.0 and eff["transports"] == "tcp,native" and eff["server_id"] == "from-file"
    assert eff["drain_timeout"] == defaults()["drain_timeout"]  # untouched: the default
    # every setting is printed, and the printed file reads back as a config
    assert set(eff) == {k for k, v in defaults().items() if v is not None} | {"server_id"}
    again = tmp_path / "again.toml"
    again.write_text(r.stdout)
    assert tomllib.loads(serve("--config", str(again), "--print-config").stdout) == eff


@pytest.mark.parametrize("text, env, needle", [
    ('capacity = "1GiB"\nbogus_key = 1\nother = 2\n', {}, "unknown setting(s) bogus_key, other"),
    ("port = \"seven\"\n", {}, "port"),
    ("zerocopy = \"maybe\"\n", {}, "zerocopy"),
    ("", {"KVFABRIC_SERVE_NOPE": "1"}, "KVFABRIC_SERVE_NOPE"),
    ("", {"KVFABRIC_SERVE_PORT": "x"}, "port"),
    ("max_lease_ms = 3600001\n", {}, "--max-lease-ms must be in 0..3600000"),
    ("this is not toml", {}, "serve.toml"),
])
def test_bad_settings_exit_2_naming_them(tmp_path, text, env, needle):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(text)
    r = serve("--config", str(cfg), "--print-config", env=env)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)


def test_every_setting_has_a_flag_and_a_reason():
    text = serve("--help").stdout
    for name in defaults():
        assert "--" + name.replace("_", "-") in text
    from dataclasses import fields

    assert all(f.metadata["why"] for f in fields(ServerConfig))


def test_server_runs_with_a_config_file(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('server_id = "pool-a"\npolicy = "s3fifo"\n')
    with start_server("16MiB", policy="lru", extra_args=["--config", str(cfg)]) as srv:
        with Client([srv.address], config=ClientConfig(timeout_s=30, connect_timeout_s=30)) as c:
            st = c.stats()["servers"][srv.address]
    assert st["server_id"] == "pool-a"   # from the file
    assert st["policy"] == "lru"         # the flag start_server passes wins over the file
    assert st["capacity"] == 16 << 20
