"""etcd over TLS (issue 22, part 2) against a real etcd serving ``https://`` with certificates made at test time by
openssl (``start_etcd(tls=True)``): servers register and clients follow with the CA; without it the connection
is refused with a one-line error (and ``Client()`` still does not raise); with ``--client-cert-auth`` a client
without a certificate cannot read members, one with it can. Skipped with the reason where etcd or openssl
is missing. Nothing waits a fixed time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.membership.etcd import EtcdClient, EtcdError
from kvfabric.tools.cluster import read_members
from kvfabric.testing.etcd import MISSING_REASON, etcd_binary, start_etcd
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

WAIT_S = 60.0
TOKEN = "tls-pool-token"


def _need_tools() -> None:
    if etcd_binary() is None:
        pytest.skip(MISSING_REASON)
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test certificates)")


@pytest.fixture(scope="module")
def tls_etcd():
    _need_tools()
    with start_etcd(tls=True) as etcd:
        yield etcd


@pytest.fixture(scope="module")
def mtls_etcd():
    _need_tools()
    with start_etcd(tls=True, client_cert_auth=True) as etcd:
        yield etcd


def _ls(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfabric", "cluster", "ls", "--timeout", "30", *args],
                          capture_output=True, text=True, timeout=120)


def test_tls_with_the_ca_works_and_without_it_is_refused_in_one_line(tls_etcd):
    etcd = tls_etcd
    assert etcd.url.startswith("https://")
    args = ["--etcd", etcd.url, "--etcd-ca", etcd.ca_file, "--cluster", "tls", "--auth-token", TOKEN]
    with start_server(capacity="16MiB", extra_args=args + ["--server-id", "t0"]) as srv:
        cfg = ClientConfig(etcd_ca=etcd.ca_file, auth_token=TOKEN, timeout_s=10.0, connect_timeout_s=5.0)
        with Client(etcd=etcd.url, cluster="tls", config=cfg) as client:
            assert wait_for(lambda: client.members == ("t0",), WAIT_S), (client.members, srv.stderr_text()[-2000:])
            assert client.put([b"t" * 16], [b"over tls"]).stored == 1
            assert client.get([b"t" * 16]) == [b"over tls"]
        ok = _ls("--etcd", etcd.url, "--etcd-ca", etcd.ca_file, "--cluster", "tls", "--token", TOKEN)
        assert ok.returncode == 0 and "1 member(s)" in ok.stdout and " up " in ok.stdout, (ok.stdout, ok.stderr)

        # without the CA: refused, one line, and a Client neither raises nor routes anywhere
        with pytest.raises(EtcdError, match="CERTIFICATE_VERIFY_FAILED") as e:
            EtcdClient(etcd.url).range_prefix(b"/kvfabric/")
        assert "\n" not in str(e.value)
        with Client(etcd=etcd.url, cluster="tls", config=ClientConfig(auth_token=TOKEN, timeout_s=5.0)) as blind:
            assert blind.members == () and blind.get([b"t" * 16]) == [None]
        bad = _ls("--etcd", etcd.url, "--cluster", "tls", "--token", TOKEN)
        assert bad.returncode == 1 and bad.stdout == "", (bad.stdout, bad.stderr)
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and "CERTIFICATE_VERIFY_FAILED" in lines[0], bad.stderr
    # a server without the CA keeps serving and says why it cannot register, on one line
    with start_server(capacity="16MiB", extra_args=["--etcd", etcd.url, "--cluster", "tls", "--server-id", "t1"]) as srv:
        assert wait_for(lambda: "cannot register t1" in srv.stderr_text(), WAIT_S), srv.stderr_text()
        line = next(x for x in srv.stderr_text().splitlines() if "cannot register t1" in x)
        assert "CERTIFICATE_VERIFY_FAILED" in line, line
        assert [m.server_id for m, _ in read_members(EtcdClient(etcd.url, ca_file=etcd.ca_file), "tls")] == []


def test_client_certificate_auth_without_a_certificate_cannot_read_members(mtls_etcd):
    etcd = mtls_etcd
    certs = ["--etcd-ca", etcd.ca_file, "--etcd-cert", etcd.client_cert, "--etcd-key", etcd.client_key]
    with start_server(capacity="16MiB", extra_args=["--etcd", etcd.url, "--cluster", "mtls", "--server-id", "c0",
                                                    "--auth-token", TOKEN, *certs]) as srv:
        full = EtcdClient(etcd.url, ca_file=etcd.ca_file, cert_file=etcd.client_cert, key_file=etcd.client_key)
        assert wait_for(lambda: [m.server_id for m, _ in read_members(full, "mtls", TOKEN)] == ["c0"], WAIT_S), \
            srv.stderr_text()[-2000:]
        # the CA alone: etcd wants a certificate; nothing is read
        with pytest.raises(EtcdError, match="etcd unreachable") as e:
            read_members(EtcdClient(etcd.url, ca_file=etcd.ca_file), "mtls")
        assert "\n" not in str(e.value)
        cfg = ClientConfig(etcd_ca=etcd.ca_file, auth_token=TOKEN, timeout_s=5.0)
        with Client(etcd=etcd.url, cluster="mtls", config=cfg) as blind:
            assert blind.members == ()
        bad = _ls("--etcd", etcd.url, "--etcd-ca", etcd.ca_file, "--cluster", "mtls", "--token", TOKEN)
        assert bad.returncode == 1 and "etcd unreachable" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
        # with the certificate (from the environment, as an engine would set it): members and data
        env = {"KVFABRIC_ETCD_CA": etcd.ca_file, "KVFABRIC_ETCD_CERT": etcd.client_cert,
               "KVFABRIC_ETCD_KEY": etcd.client_key}
        cfg = ClientConfig.from_env(env, auth_token=TOKEN, timeout_s=10.0, connect_timeout_s=5.0)
        with Client(etcd=etcd.url, cluster="mtls", config=cfg) as client:
            assert wait_for(lambda: client.members == ("c0",), WAIT_S), client.members
            assert client.put([b"m" * 16], [b"mutual"]).stored == 1 and client.get([b"m" * 16]) == [b"mutual"]
        ok = subprocess.run([sys.executable, "-m", "kvfabric", "cluster", "ls", "--etcd", etcd.url, "--cluster", "mtls",
                             "--token", TOKEN, "--timeout", "30"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
        assert ok.returncode == 0 and "1 member(s)" in ok.stdout, (ok.stdout, ok.stderr)
