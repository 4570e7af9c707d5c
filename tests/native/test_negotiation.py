"""Transport choice through the public client: auto picks the fastest that works, forcing never falls back."""

import pytest

from kvfabric import Client, ClientConfig
from kvfabric.errors import TransportUnavailable
from kvfabric.testing.servers import start_server


@pytest.fixture(scope="module")
def py_server():
    with start_server(capacity="16MiB", module="kvfabric.testing.reference") as srv:  # offers tcp only
        yield srv


def test_auto_uses_shm_for_a_local_native_server_and_both_sides_report_it(server):
    with Client([server.address], config=ClientConfig(transport="auto")) as c:
        c.put([b"k" * 16], [b"v" * 5000])
        assert c.get([b"k" * 16]) == [b"v" * 5000]
        st = c.stats()
        assert st["client"]["transports"] == ["shm"]
        assert st["client"]["shards"][server.address]["transport"] == "shm"
        assert st["servers"][server.address]["transports_in_use"]["shm"] >= 1


def test_auto_uses_native_for_the_python_server(py_server):
    with Client([py_server.address], config=ClientConfig(transport="auto")) as c:
        c.put([b"k" * 16], [b"v" * 100])
        assert c.get([b"k" * 16]) == [b"v" * 100]
        assert c.stats()["client"]["transports"] == ["native"]


def test_forced_native_against_the_native_server_is_counted_as_native(server):
    with Client([server.address], config=ClientConfig(transport="native")) as c:
        assert c.exists([b"nothing"]) == [False]
        st = c.stats()
        assert st["client"]["transports"] == ["native"]
        assert st["servers"][server.address]["transports_in_use"]["native"] >= 1


def test_forcing_shm_where_it_is_unavailable_raises(py_server, monkeypatch):
    monkeypatch.setenv("KVFABRIC_TRANSPORT", "shm")
    cfg = ClientConfig.from_env()
    assert cfg.transport == "shm"
    with pytest.raises(TransportUnavailable):
        with Client([py_server.address], config=cfg) as c:
            c.get([b"k" * 16])
