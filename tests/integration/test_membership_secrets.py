"""The etcd password is masked everywhere (issue 22, part 2): ``kvfabric serve --print-config`` (flag and
environment), the errors for a bad URL (server, client, ``cluster ls``), the server's and the client's logs,
``cluster ls`` (its table and JSON: ``test_membership_auth.py``, against an etcd with auth), and
``ClientConfig``'s repr. The password is chosen so that a
leak of any part of it shows (``s3cr``), including a port-like part urllib would quote.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from kvfabric import Client, ClientConfig, ConfigError
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

SECRET = "s3cr"
UNREACHABLE = f"http://root:{SECRET}et@127.0.0.1:1"


def _kvfabric(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfabric", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _masked(text: str) -> None:
    assert SECRET not in text, text


def test_print_config_masks_the_etcd_password():
    for args, env in (([f"--etcd={UNREACHABLE}"], {}), ([], {"KVFABRIC_SERVE_ETCD": UNREACHABLE})):
        p = _kvfabric("serve", "--print-config", "--auth-token", "tok-" + SECRET, *args, env=env)
        assert p.returncode == 0, p.stderr
        _masked(p.stdout + p.stderr)
        assert 'etcd = "http://root:***@127.0.0.1:1"' in p.stdout and 'auth_token = "***"' in p.stdout, p.stdout


@pytest.mark.parametrize("url", [f"ftp://root:{SECRET}@127.0.0.1:1", f"http://root:{SECRET}/x@127.0.0.1:1",
                                 f"http://root:{SECRET}@127.0.0.1:99999"])
def test_errors_for_a_bad_url_mask_the_password(url):
    serve = _kvfabric("serve", "--port", "0", "--capacity", "16MiB", "--etcd", url)
    assert serve.returncode == 2 and "kvfabric serve: " in serve.stderr, serve.stderr
    _masked(serve.stdout + serve.stderr)
    ls = _kvfabric("cluster", "ls", "--etcd", url)
    assert ls.returncode == 2 and ls.stderr.count("\n") == 1 and "***" in ls.stderr, ls.stderr
    _masked(ls.stdout + ls.stderr)
    with pytest.raises(ConfigError) as e:
        Client(etcd=url, cluster="c")
    _masked(str(e.value))


def test_logs_and_cluster_ls_mask_the_password(caplog):
    caplog.set_level(logging.DEBUG, logger="kvfabric")
    cfg = ClientConfig(etcd=UNREACHABLE, auth_token="tok-" + SECRET, key_secret="k-" + SECRET, timeout_s=2.0)
    _masked(repr(cfg))
    assert "root:***@" in repr(cfg)
    with Client(config=cfg) as client:
        assert client.members == ()
        _masked(repr(client._membership))
    assert "cannot read cluster" in caplog.text and "root:***@" in caplog.text, caplog.text
    _masked(caplog.text)
    with start_server(capacity="16MiB", extra_args=["--etcd", UNREACHABLE, "--log-level", "debug"]) as srv:
        assert wait_for(lambda: "cannot register" in srv.stderr_text(), 60), srv.stderr_text()
        assert "root:***@" in srv.stderr_text()
        assert srv.stop() == 0
        _masked(srv.stderr_text())
    ls = _kvfabric("cluster", "ls", "--etcd", UNREACHABLE, "-v")
    assert ls.returncode == 1 and "etcd unreachable" in ls.stderr, ls.stderr
    _masked(ls.stdout + ls.stderr)

