"""`kvfabric serve --data-plane native` starts the io_uring server behind the same command."""

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.testing.servers import start_server

native = pytest.importorskip("kvfabric._native", reason="the C extension is not built")


def test_serve_data_plane_native_runs_the_native_server():
    with start_server("16MiB", extra_args=["--data-plane", "native"]) as srv:
        with Client([srv.address], config=ClientConfig(transport="tcp", timeout_s=10)) as c:
            keys = [bytes([i]) * 16 for i in range(4)]
            values = [bytes([i]) * (100_000 + i) for i in range(4)]
            assert c.put(keys, values).stored == 4
            assert c.get(keys) == values
            stats = c.stats()["servers"][srv.address]
            assert stats["data_plane"].startswith("io_uring")
            assert stats["objects"] == 4


def test_serve_rejects_an_unknown_data_plane():
    with pytest.raises(RuntimeError):
        start_server("16MiB", extra_args=["--data-plane", "carrier-pigeon"], timeout_s=10)
