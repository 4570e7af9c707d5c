"""`kvfabric ping|exists|get|put|del` and the tools' one-line errors, against real pool servers.

Every command runs as the user runs it (``python -m kvfabric ...`` in a subprocess, the environment's
``KVFABRIC_*`` variables removed unless a test sets them). Nothing here depends on timing: the
``--timeout`` given is generous, and the one "no answer" case is a socket that never answers at all.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvfabric import Client, ClientConfig, __version__, protocol
from kvfabric.membership.etcd import EtcdClient
from kvfabric.testing import start_server
from kvfabric.testing.etcd import etcd  # noqa: F401  (the fixture)
from kvfabric.testing.poll import wait_for
from kvfabric.tools.cluster import read_members

TOKEN = "s3cret-token"
T = "30"  # --timeout: generous, a loaded machine must pass; never asserted on
KEY = "000102030405060708090a0b0c0d0e0f"  # 16 bytes: an xxh3_128 block key
CLIENT_TOOLS = ("ping", "exists", "get", "put", "del", "stats", "top")


def kv(*args: str, env: dict[str, str] | None = None, stdin: bytes = b"",
       timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m kvfabric ARGS`` with no KVFABRIC_* variable but ``env``'s; stdout as bytes, stderr as text."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    p = subprocess.run([sys.executable, "-m", "kvfabric", *args], input=stdin, capture_output=True,
                       env={**base, **(env or {})}, timeout=timeout)
    p.stderr = p.stderr.decode(errors="replace")
    return p


def show(p: subprocess.CompletedProcess) -> str:
    out = p.stdout.decode(errors="replace") if isinstance(p.stdout, bytes) else p.stdout
    return f"{p.args}\nrc={p.returncode}\nstdout:\n{out[:4000]}\nstderr:\n{p.stderr}"


def one_line_error(p: subprocess.CompletedProcess, rc: int, *needles: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == rc and len(lines) == 1 and "Traceback" not in p.stderr, show(p)
    for n in needles:
        assert n in lines[0], show(p)


def tool_args(tool: str, address: str) -> list[str]:
    """A valid invocation of ``tool`` against ``address`` (its key, its count)."""
    return {"ping": ["ping", address], "exists": ["exists", address, KEY], "get": ["get", address, KEY],
            "put": ["put", address, KEY], "del": ["del", address, KEY], "stats": ["stats", address],
            "top": ["top", address, "--count", "1", "--interval", "0.1"]}[tool]


@pytest.fixture(scope="module")
def srv():
    with start_server(capacity="16MiB", extra_args=["--auth-token", TOKEN, "--server-id", "alpha"]) as s:
        yield s


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_put_get_round_trip_is_byte_exact_via_files_and_via_stdin_stdout(srv, token_file, tmp_path):
    value = bytes(range(256)) * 1200 + b"\r\n\x00end"  # every byte value, newlines, a NUL, 300 KiB
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(value)
    key = "aa" * 16
    p = kv("put", srv.address, key, "-i", str(src), "--token-file", token_file, "--timeout", T)
    assert p.returncode == 0 and b"stored %d bytes" % len(value) in p.stdout, show(p)
    p = kv("get", srv.address, key, "-o", str(dst), "--token-file", token_file, "--timeout", T)
    assert p.returncode == 0 and p.stdout == b"", show(p)
    assert dst.read_bytes() == value

    key2 = "0x" + "bb" * 32  # a 32-byte key (blake3/sha256 size), with the 0x prefix
    p = kv("put", srv.address, key2, "--token", TOKEN, "--timeout", T, stdin=value[::-1])
    assert p.returncode == 0, show(p)
    p = kv("get", srv.address, key2, "--timeout", T, env={"KVFABRIC_AUTH_TOKEN": TOKEN})
    assert p.returncode == 0 and p.stdout == value[::-1], show(p)

    # a put never overwrites: the first value stays, and the tool says so
    p = kv("put", srv.address, key, "--token", TOKEN, "--timeout", T, stdin=b"other")
    assert p.returncode == 0 and b"already held" in p.stdout, show(p)
    p = kv("get", srv.address, key, "--token", TOKEN, "--timeout", T)
    assert p.returncode == 0 and p.stdout == value, show(p)


def test_exists_and_size_before_and_after_del(srv, token_file):
    auth = ["--token-file", token_file, "--timeout", T]
    key, other = "cc" * 16, "dd" * 16
    p = kv("put", srv.address, key, *auth, stdin=b"x" * 1000)
    assert p.returncode == 0, show(p)
    p = kv("exists", srv.address, key, other, *auth)
    assert p.returncode == 3 and p.stdout.decode().splitlines() == [f"{key} present", f"{other} absent"], show(p)
    p = kv("exists", srv.address, key, "--size", *auth)
    assert p.returncode == 0 and p.stdout.decode().splitlines() == [f"{key} present 1000"], show(p)
    p = kv("del", srv.address, key, other, *auth)
    assert p.returncode == 0 and p.stdout.decode().strip() == "deleted 1", show(p)
    p = kv("exists", srv.address, key, *auth)
    assert p.returncode == 3 and p.stdout.decode().splitlines() == [f"{key} absent"], show(p)
    p = kv("get", srv.address, key, *auth)
    one_line_error(p, 3, "kvfabric get:", key, "not found")
    p = kv("del", srv.address, key, *auth)  # deleting what is not there is no error
    assert p.returncode == 0 and p.stdout.decode().strip() == "deleted 0", show(p)


def test_ping_reports_round_trip_server_id_version_and_transport(srv, token_file):
    p = kv("ping", srv.address, "--token-file", token_file, "--timeout", T, "--transport", "tcp")
    assert p.returncode == 0, show(p)
    header, row = p.stdout.decode().splitlines()
    assert header.split() == ["server", "server_id", "version", "protocol", "transport", "rtt", "ms"], show(p)
    cells = row.split()
    assert cells[:5] == [srv.address, "alpha", f"kvfabric-native/{__version__}", str(protocol.VERSION), "tcp"], show(p)
    assert float(cells[5]) >= 0, show(p)


@pytest.mark.parametrize("tool", CLIENT_TOOLS)
def test_wrong_or_missing_token_is_one_line_auth_error(srv, tool):
    for auth in (["--token", "wrong"], []):
        p = kv(*tool_args(tool, srv.address), *auth, "--timeout", T, stdin=b"v")
        one_line_error(p, 1, f"kvfabric {tool}: {srv.address}: authentication failed (wrong or missing --token)")


@pytest.mark.parametrize("tool", CLIENT_TOOLS)
def test_connection_refused_is_one_line_error(tool):
    p = kv(*tool_args(tool, "127.0.0.1:1"), "--timeout", T, stdin=b"v")
    one_line_error(p, 1, f"kvfabric {tool}: 127.0.0.1:1: connection refused")


@pytest.mark.parametrize("tool", ("ping", "get", "put", "stats"))
def test_a_server_that_never_answers_is_a_one_line_timeout(tool):
    with socket.socket() as s:  # accepts (the kernel's backlog) and never says a word: HELLO never comes
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        address = f"127.0.0.1:{s.getsockname()[1]}"
        p = kv(*tool_args(tool, address), "--timeout", "1", stdin=b"v")
    one_line_error(p, 1, f"kvfabric {tool}: {address}: no answer within 1s")


@pytest.mark.parametrize("bad, why", [("zz" * 16, "not a hex string"), ("abc", "odd number of hex digits"),
                                      ("ab" * 65, "65 bytes"), ("0x", "not a hex string")])
def test_a_bad_hex_key_exits_2_with_what_is_wrong(bad, why):
    for cmd in ("get", "exists", "del"):
        p = kv(cmd, "127.0.0.1:1", bad)  # checked before anything connects
        one_line_error(p, 2, f"kvfabric {cmd}: bad key", why, "hex")


def test_bad_arguments_exit_2():
    one_line_error(kv("get", "127.0.0.1:1", KEY, "ee" * 16), 2, "get takes one key")
    one_line_error(kv("get", KEY), 2, "KVFABRIC_SERVERS")  # no address and none in the environment
    one_line_error(kv("ping"), 2, "KVFABRIC_SERVERS")
    one_line_error(kv("get", "nohost:", KEY), 2, "host:port")
    one_line_error(kv("get", "127.0.0.1:1", KEY, "--token", "a", "--token-file", "f"), 2, "not both")
    one_line_error(kv("get", "127.0.0.1:1", KEY, "--token-file", "/nonexistent/token"), 2, "--token-file")
    one_line_error(kv("get", "127.0.0.1:1", KEY, env={"KVFABRIC_TIMEOUT_S": "soon"}), 2, "KVFABRIC_TIMEOUT_S")


def test_address_and_token_from_the_environment(srv):
    env = {"KVFABRIC_SERVERS": srv.address, "KVFABRIC_AUTH_TOKEN": TOKEN, "KVFABRIC_TIMEOUT_S": T}
    key = "ee" * 16
    p = kv("put", key, env=env, stdin=b"from the environment")
    assert p.returncode == 0, show(p)
    p = kv("get", key, env=env)
    assert p.returncode == 0 and p.stdout == b"from the environment", show(p)
    p = kv("ping", env=env)
    assert p.returncode == 0 and srv.address in p.stdout.decode(), show(p)
    p = kv("stats", env=env)
    assert p.returncode == 0 and p.stdout.decode().splitlines()[1].split()[0] == srv.address, show(p)
    p = kv("top", "--count", "1", "--interval", "0.1", env=env)
    assert p.returncode == 0 and srv.address in p.stdout.decode(), show(p)
    # a flag wins over the variable
    one_line_error(kv("get", key, "--token", "wrong", env=env), 1, "authentication failed")


def test_a_key_routes_to_its_owner_in_a_pool_and_a_dead_owner_is_an_error_not_a_miss():
    with start_server(capacity="16MiB") as a, start_server(capacity="16MiB") as b:
        pool = f"{a.address},{b.address}"
        keys = [bytes([i]) * 16 for i in range(32)]  # 32 keys: both servers own some (rendezvous)
        with Client([a.address, b.address], config=ClientConfig(transport="tcp", timeout_s=30)) as c:
            assert c.put(keys, keys).stored == 32
            owner = dict(zip(keys, (row[0] for row in c.route(keys))))
        on_a = [k for k in keys if owner[k] == a.address]
        on_b = [k for k in keys if owner[k] == b.address]
        assert on_a and on_b, owner
        p = kv("exists", a.address, *(k.hex() for k in keys), "--timeout", T)
        present = [line.split()[0] for line in p.stdout.decode().splitlines() if line.endswith(" present")]
        assert p.returncode == 3 and present == [k.hex() for k in on_a], show(p)
        p = kv("get", pool, on_b[0].hex(), "--timeout", T)
        assert p.returncode == 0 and p.stdout == on_b[0], show(p)
        b.kill()
        p = kv("get", pool, on_a[0].hex(), "--timeout", T)
        assert p.returncode == 0 and p.stdout == on_a[0], show(p)
        p = kv("get", pool, on_b[0].hex(), "--timeout", T)
        one_line_error(p, 1, f"kvfabric get: {b.address}: connection refused")
        p = kv("exists", pool, on_b[0].hex(), "--timeout", T)
        one_line_error(p, 1, f"kvfabric exists: {b.address}: connection refused")


def test_cluster_ls_names_a_member_that_refuses_the_token(etcd):  # noqa: F811
    with start_server(capacity="16MiB", extra_args=["--etcd", etcd.url, "--cluster", "tok", "--server-id", "m0",
                                                    "--auth-token", TOKEN]) as s:
        members = lambda: [m.server_id for m, _ in read_members(EtcdClient(etcd.url), "tok")]  # noqa: E731
        assert wait_for(lambda: members() == ["m0"], 60), members()
        ok = kv("cluster", "ls", "--etcd", etcd.url, "--cluster", "tok", "--timeout", T, "--token", TOKEN)
        assert ok.returncode == 0 and b"1 member(s)" in ok.stdout and b" up " in ok.stdout, show(ok)
        p = kv("cluster", "ls", "--cluster", "tok", "--token", "wrong", "--timeout", T, env={"KVFABRIC_ETCD": etcd.url})
        assert p.returncode == 0 and "Traceback" not in p.stderr, show(p)
        # its record is signed with the pool's token: under another token it is refused, and never contacted
        assert b"0 member(s)" in p.stdout and b"refused: m0: wrong proof" in p.stdout, show(p)
        assert s.alive
    one_line_error(kv("cluster", "ls", "--etcd", "http://127.0.0.1:1"), 1, "kvfabric cluster ls:", "etcd unreachable")


def test_get_into_a_pipe_that_closes_early_exits_0(srv, token_file):
    key = "ab" * 16
    p = kv("put", srv.address, key, "--token-file", token_file, "--timeout", T, stdin=b"z" * (4 << 20))
    assert p.returncode == 0, show(p)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    cmd = (f"{sys.executable} -m kvfabric get {srv.address} {key} --token-file {token_file} --timeout {T}"
           " | head -c 3")
    p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, env=base, timeout=120)
    assert p.returncode == 0 and p.stdout == b"zzz" and p.stderr == b"", p
