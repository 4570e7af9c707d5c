"""etcd auth (user and password in the etcd URL, kvfabric/membership/etcd.py) against a real etcd with auth
enabled: servers register, a client follows, ``kvfabric cluster ls`` lists, a token etcd invalidates is
replaced without anyone failing, and no password is shown. Skipped with the reason where etcd is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.membership.etcd import EtcdClient, EtcdError
from kvfabric.testing.etcd import MISSING_REASON, etcd_binary, start_etcd
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

WAIT_S = 60.0
PASSWORD = "s3cr:t@x"  # needs percent-encoding in the URL


@pytest.fixture(scope="module")
def auth_etcd():
    if etcd_binary() is None:
        pytest.skip(MISSING_REASON)
    with start_etcd() as etcd:
        admin = EtcdClient(etcd.url)
        admin._call("/v3/auth/role/add", {"name": "root"})
        admin._call("/v3/auth/user/add", {"name": "root", "password": PASSWORD})
        admin._call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        admin._call("/v3/auth/enable", {})
        yield etcd, etcd.url.replace("http://", "http://root:s3cr%3At%40x@")


def test_auth_register_follow_list_and_token_renewal(auth_etcd):
    etcd, url = auth_etcd
    with pytest.raises(EtcdError, match="user name is empty"):
        EtcdClient(etcd.url).range_prefix(b"/kvfabric/")
    with pytest.raises(EtcdError, match="authentication failed"):
        EtcdClient(etcd.url.replace("http://", "http://root:wrong@")).range_prefix(b"/kvfabric/")
    assert PASSWORD not in EtcdClient(url).url and "s3cr" not in EtcdClient(url).url

    def serve(sid: str):
        return start_server(capacity="16MiB", extra_args=["--etcd", url, "--cluster", "auth", "--server-id", sid])

    servers = [serve("a0"), serve("a1")]
    try:
        with Client(etcd=url, cluster="auth", config=ClientConfig(transport="tcp")) as client:
            assert wait_for(lambda: sorted(client.members) == ["a0", "a1"], WAIT_S), client.members
            keys = [bytes([i]) * 16 for i in range(100)]
            client.put(keys, keys)
            assert client.get(keys) == keys
            # etcd invalidates every token of the user (same password set again): the servers' keepalives,
            # a new server's registration and the client's watch all authenticate again by themselves
            EtcdClient(url)._call("/v3/auth/user/changepw", {"name": "root", "password": PASSWORD})
            servers.append(serve("a2"))
            assert wait_for(lambda: sorted(client.members) == ["a0", "a1", "a2"], WAIT_S), client.members
            assert client.get(keys) == keys
        ls = subprocess.run([sys.executable, "-m", "kvfabric", "cluster", "ls", "--etcd", url, "--cluster", "auth"],
                            capture_output=True, text=True, timeout=60)
        assert ls.returncode == 0, ls.stderr
        assert "3 member(s)" in ls.stdout and "s3cr" not in ls.stdout + ls.stderr
        assert "root:***@" in ls.stdout.splitlines()[0], ls.stdout
        js = subprocess.run([sys.executable, "-m", "kvfabric", "cluster", "ls", "--etcd", url, "--cluster", "auth",
                             "--json"], capture_output=True, text=True, timeout=60)
        assert js.returncode == 0 and "s3cr" not in js.stdout + js.stderr, js.stderr
        assert "root:***@" in json.loads(js.stdout)["etcd"], js.stdout
        for s in servers:
            assert s.alive
    finally:
        for s in servers:
            s.kill()
    for s in servers:
        assert "s3cr" not in s.stderr_text()
