"""`kvfabric serve` is the one product server: the C io_uring data plane, offering tcp and native."""

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.testing.servers import start_server

native = pytest.importorskip("kvfabric._native", reason="the C extension is not built")


def test_serve_runs_the_native_server_with_tcp_and_native_only():
    with start_server("16MiB") as srv:
        with Client([srv.address], config=ClientConfig(transport="auto", timeout_s=10)) as c:
            keys = [bytes([i]) * 16 for i in range(4)]
            values = [bytes([i]) * (100_000 + i) for i in range(4)]
            assert c.put(keys, values).stored == 4
            assert c.get(keys) == values
            st = c.stats()
            stats = st["servers"][srv.address]
            assert stats["data_plane"].startswith("io_uring")
            assert stats["objects"] == 4
            assert sorted(stats["transports"]) == ["native", "tcp"]  # shm only when asked for
            assert st["client"]["transports"] == ["native"]


@pytest.mark.parametrize("args", [["--data-plane", "python"], ["--transports", "tcp,carrier-pigeon"],
                                  ["--transports", "native"], ["--auth-token", ""], ["--auth-token", "  "]])
def test_serve_refuses_bad_options_with_a_message(args):
    with pytest.raises(RuntimeError, match="exited with status 2"):
        start_server("16MiB", extra_args=args, timeout_s=20)


def test_the_reference_server_still_runs_for_the_tests():
    with start_server("16MiB", module="kvfabric.testing.reference") as srv:
        with Client([srv.address], config=ClientConfig(transport="tcp", timeout_s=10)) as c:
            assert c.put([b"k" * 16], [b"v" * 10]).stored == 1
            assert c.get([b"k" * 16]) == [b"v" * 10]
            assert "data_plane" not in c.stats()["servers"][srv.address]


def test_serve_without_the_extension_says_what_to_install(tmp_path):
    """A package whose C extension did not build: one clear error and exit 2, no other server.

    The subprocess hides ``kvfabric._native`` with an import hook (an editable
    install would otherwise find the built one whatever the path says)."""
    import subprocess
    import sys

    script = tmp_path / "no_native.py"
    script.write_text(
        "import sys\n"
        "class NoNative:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name == 'kvfabric._native':\n"
        "            raise ImportError('kvfabric._native was not built (hidden by the test)')\n"
        "sys.meta_path.insert(0, NoNative)\n"
        "from kvfabric.cli import main\n"
        "sys.exit(main(['serve', '--port', '0', '--capacity', '1MiB']))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "gcc python3-dev" in out.stderr and "build_ext" in out.stderr and "hidden by the test" in out.stderr
    assert "listening" not in out.stdout
