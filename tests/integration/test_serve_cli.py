"""``kvfabric serve`` as an operator meets it: start-up lines, sizes, bind errors, memory, --help, stale sockets.

Real server processes (``kvfabric.testing.start_server`` waits for the listening line); nothing here
measures time. A server that should not start is run to its exit with its whole stderr in the
assertion message.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.server import memory
from kvfabric.server.eviction import POLICIES
from kvfabric.server.native import default_shm_dir
from kvfabric.testing import start_server


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_SERVE_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvfabric", "serve", *args], capture_output=True, text=True,
                          env=full, timeout=300, stdin=subprocess.DEVNULL)


def _stats(address: str) -> dict:
    with Client([address], config=ClientConfig(transport="tcp", timeout_s=60, connect_timeout_s=60)) as c:
        return c.stats()["servers"][address]


def test_a_normal_start_logs_at_info_and_shows_the_capacity_in_its_unit():
    with start_server("64MB", timeout_s=120) as srv:
        st = _stats(srv.address)
        log = srv.stderr_text()
    assert st["capacity"] == 64_000_000, st
    assert f"INFO kvfabric.server.native: native server {srv.address}: capacity 64MB (64000000 bytes)" in log, log
    # a real warning (a low open-files hard limit on this host) may stay, and without --auth-token the one
    # that says what that means (once); nothing else is WARNING
    assert log.count("WARNING kvfabric.server: no --auth-token: any peer that can reach") == 1, log
    warnings = [ln for ln in log.splitlines() if " WARNING " in ln and "open-files" not in ln
                and "no --auth-token" not in ln]
    assert not warnings, log


def test_log_level_warning_quiets_the_start_up_lines():
    with start_server("16MiB", extra_args=["--log-level", "warning"], timeout_s=120) as srv:
        assert srv.address.startswith("127.0.0.1:")  # the listening line is printed whatever the level
        log = srv.stderr_text()
    assert "native server" not in log, log


@pytest.mark.parametrize("args, env, line", [
    (["--capacity", "4G"], {}, "--capacity 4G: did you mean 4GiB (4294967296 bytes) or 4GB (4000000000)?"),
    (["--capacity", "4g"], {}, "--capacity 4g: did you mean 4GiB (4294967296 bytes) or 4GB (4000000000)?"),
    ([], {"KVFABRIC_SERVE_CAPACITY": "8G"}, "--capacity 8G: did you mean 8GiB (8589934592 bytes) or 8GB"),
    (["--min-rate", "1M"], {}, "--min-rate 1M: did you mean 1MiB (1048576 bytes) or 1MB (1000000)?"),
    (["--reply-budget", "32M"], {}, "--reply-budget 32M: did you mean 32MiB"),
    (["--reply-budget-conn", "1M"], {}, "--reply-budget-conn 1M: did you mean 1MiB"),
    (["--request-budget", "32M"], {}, "--request-budget 32M: did you mean 32MiB"),
    (["--reserve-budget", "16M"], {}, "--reserve-budget 16M: did you mean 16MiB"),
    (["--ssd-path", "/nonexistent", "--ssd-capacity", "1G"], {}, "--ssd-capacity 1G: did you mean 1GiB"),
    (["--ssd-path", "/nonexistent", "--ssd-capacity", "1GiB", "--ssd-write-queue", "64M"], {},
     "--ssd-write-queue 64M: did you mean 64MiB"),
    (["--capacity", "17TiB"], {}, "--capacity 17TiB: must be below 16TiB"),
])
def test_every_size_option_refuses_an_ambiguous_unit_with_a_hint(args, env, line):
    r = serve(*args, "--print-config", env=env)
    assert r.returncode == 2 and r.stderr.startswith(f"kvfabric serve: {line}"), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_a_decimal_unit_from_a_config_file_is_taken_as_written(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('capacity = "4GB"\nreply_budget = 1048576\n')
    r = serve("--config", str(cfg), "--print-config")
    assert r.returncode == 0, r.stderr
    assert 'capacity = "4GB"' in r.stdout and 'reply_budget = "1048576"' in r.stdout, r.stdout


def test_a_port_in_use_is_one_line_naming_it_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = serve("--port", str(port), "--capacity", "16MiB")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == f"kvfabric serve: cannot listen on 127.0.0.1:{port}: address already in use\n", r.stderr
    assert r.stdout == "", r.stdout


def test_help_lists_the_eviction_policies_with_a_line_each():
    r = serve("--help")
    assert r.returncode == 0, r.stderr
    for name, cls in POLICIES.items():
        assert any(ln.split()[:1] == [name] and cls.summary in ln for ln in r.stdout.splitlines()), r.stdout


def test_a_capacity_above_available_memory_warns_and_starts_without_faulting_the_arena_in():
    avail = memory.available_memory()
    if avail is None:
        pytest.skip("no MemAvailable or cgroup limit to read here")
    if avail[0] > 256 << 30:
        pytest.skip(f"{avail[0]} bytes available: a server above that would map a page map of GiBs")
    gib = -(-avail[0] * 5 // 4 // (1 << 30))  # 25% over, in whole GiB: memory freed meanwhile cannot make it fit
    with start_server(f"{gib}GiB", timeout_s=120) as srv:
        st = _stats(srv.address)
        rss = srv.rss_bytes()
        log = srv.stderr_text()
    assert st["capacity"] == gib << 30, st
    assert f"WARNING kvfabric.server: --capacity {gib}GiB plus" in log and "not faulted in ahead of use" in log, log
    assert rss < (gib << 30) // 4, (rss, log)  # the sparse arena was not populated


def _bound_unix(path: str, listen: bool) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    if listen:
        s.listen()
    return s


def test_a_shm_server_sweeps_stale_sockets_of_dead_servers_from_the_default_directory(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))  # a default directory of this test's own
    shm_dir = runtime / "kvfabric"
    shm_dir.mkdir(mode=0o700)
    stale = _bound_unix(str(shm_dir / "shm-1.sock"), listen=False)
    stale.close()  # a server SIGKILLed: the file stays, nobody listens
    live = _bound_unix(str(shm_dir / "shm-2.sock"), listen=True)
    outside = _bound_unix(str(tmp_path / "outside.sock"), listen=False)
    outside.close()
    (shm_dir / "shm-3.sock").symlink_to(tmp_path / "outside.sock")  # never followed
    (shm_dir / "shm-4.sock").write_text("not a socket")
    other = _bound_unix(str(shm_dir / "other.sock"), listen=False)  # not a name of ours
    other.close()
    try:
        with start_server("16MiB", extra_args=["--transports", "tcp,native,shm"], env=env, timeout_s=120) as srv:
            left = sorted(os.listdir(shm_dir))
            log = srv.stderr_text()
            assert _stats(srv.address)["transports"] == ["shm", "native", "tcp"]
    finally:
        live.close()
    assert left == sorted(["shm-2.sock", "shm-3.sock", "shm-4.sock", "other.sock", f"shm-{srv.port}.sock"]), (
        left, log)
    assert (tmp_path / "outside.sock").exists(), log
    assert f"removed 1 stale socket(s) of servers that died from {shm_dir}" in log, log
    assert default_shm_dir() != str(shm_dir)  # the test never swept the real default directory
