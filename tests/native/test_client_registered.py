"""``Client.register_buffers``: the caller's reused staging buffer registered on every native connection.

Through the public client against the Python server and the native server
(transport ``native``): GETs into slices of a registered buffer are byte
exact and arrive through READ_FIXED (the connection's fixed-read counter
moves), a replaced set is picked up by connections already pooled, dropping
the set unregisters them, limits are checked before anything changes,
``tcp`` connections ignore the set, and a connection that cannot register
keeps serving GETs with recvmsg (logged and counted).
"""

from __future__ import annotations

import errno
import logging

import numpy as np
import pytest

from kvfabric import Client, ClientConfig
from kvfabric.errors import NativeError
from kvfabric.transport import native as tn

MiB = 1 << 20


def _data(seed: int, n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = [rng.integers(0, 256, size=16, dtype=np.uint8).tobytes() for _ in range(n)]
    vals = [rng.integers(0, 256, size=size, dtype=np.uint8).tobytes() for _ in range(n)]
    return keys, vals


def _conns(client: Client) -> list[tn.NativeConnection]:
    """The pooled (idle) connections of every shard: the client is idle between calls."""
    return [c for s in client._shards for c in s._idle]


def _client(address: str, transport: str = "native") -> Client:
    return Client([address], config=ClientConfig(transport=transport, connections_per_server=2, timeout_s=10))


def _get_slices(client: Client, keys: list[bytes], staging: np.ndarray, size: int) -> list[bytes]:
    views = [staging[i * size:(i + 1) * size] for i in range(len(keys))]
    assert client.get_into(keys, views) == [size] * len(keys)
    return [v.tobytes() for v in views]


def test_get_into_a_registered_staging_buffer_uses_fixed_reads(address):
    keys, vals = _data(1, 4, MiB)
    with _client(address) as client:
        assert client.put(keys, vals).stored == 4
        staging = np.zeros(4 * MiB, dtype=np.uint8)
        client.register_buffers([staging])
        assert _get_slices(client, keys, staging, MiB) == vals
        conns = _conns(client)
        assert conns and all(c.registered_stats() is not None for c in conns)
        assert sum(c.registered_stats()["fixed_reads"] for c in conns) >= 4
        assert sum(c.registered_stats()["fixed_bytes"] for c in conns) == 4 * MiB
        st = client.stats()["client"]
        assert st["registered_buffers"] == {"buffers": 1, "bytes": 4 * MiB}
        assert st["buffer_registrations"] >= 1 and st["buffer_registration_failures"] == 0


def test_a_replaced_set_reaches_pooled_connections_and_unregister_drops_it(address):
    keys, vals = _data(2, 2, 64 << 10)
    with _client(address) as client:
        client.put(keys, vals)
        first = np.zeros(2 * (64 << 10), dtype=np.uint8)
        client.register_buffers([first])
        assert _get_slices(client, keys, first, 64 << 10) == vals
        (conn,) = _conns(client)
        before = conn.registered_stats()["fixed_reads"]
        second = np.zeros(2 * (64 << 10), dtype=np.uint8)
        client.register_buffers([second])  # the pooled connection re-registers when next used
        assert _get_slices(client, keys, second, 64 << 10) == vals
        assert _conns(client) == [conn]
        st = conn.registered_stats()
        assert st["bytes"] == second.nbytes and st["fixed_reads"] >= 2  # a new ring: counters restart
        assert before >= 2
        client.unregister_buffers()
        assert _get_slices(client, keys, first, 64 << 10) == vals  # recvmsg again
        assert conn.registered_stats() is None
        assert client.stats()["client"]["registered_buffers"] == {"buffers": 0, "bytes": 0}


def test_limits_are_checked_before_anything_changes(py_server):
    with _client(py_server.address) as client:
        good = np.zeros(4096, dtype=np.uint8)
        client.register_buffers([good])
        with pytest.raises(ValueError, match="read-only"):
            client.register_buffers([bytes(4096)])
        with pytest.raises(ValueError, match="limit"):
            client.register_buffers([good, good], max_buffers=1)
        with pytest.raises(ValueError, match="no buffers"):
            client.register_buffers([])
        assert client.stats()["client"]["registered_buffers"] == {"buffers": 1, "bytes": 4096}


def test_tcp_connections_ignore_the_set(py_server):
    keys, vals = _data(3, 2, 4096)
    with _client(py_server.address, transport="tcp") as client:
        client.put(keys, vals)
        staging = np.zeros(2 * 4096, dtype=np.uint8)
        client.register_buffers([staging])
        assert _get_slices(client, keys, staging, 4096) == vals
        st = client.stats()["client"]
        assert st["buffer_registrations"] == 0 and st["buffer_registration_failures"] == 0


def test_a_connection_that_cannot_register_keeps_serving(py_server, monkeypatch, caplog):
    # Fault injection: the kernel refusing the pinning (ENOMEM over RLIMIT_MEMLOCK)
    # cannot be provoked as root, so the connection's registration raises it here.
    def refuse(self, buffers, **kw):
        raise NativeError(errno.ENOMEM, "io_uring buffer registration: Cannot allocate memory")

    monkeypatch.setattr(tn.NativeConnection, "register_buffers", refuse)
    keys, vals = _data(4, 3, 8192)
    with _client(py_server.address) as client, caplog.at_level(logging.WARNING, logger="kvfabric.client"):
        client.put(keys, vals)
        staging = np.zeros(3 * 8192, dtype=np.uint8)
        client.register_buffers([staging])
        for _ in range(3):  # logged and counted once per connection and set, not per GET
            assert _get_slices(client, keys, staging, 8192) == vals
        st = client.stats()["client"]
        assert st["buffer_registration_failures"] == 1 and st["buffer_registrations"] == 0
        assert sum("cannot register receive buffers" in r.message for r in caplog.records) == 1


def test_get_into_parts_reads_the_payload_part_into_a_registered_buffer_with_fixed_reads(address):
    # header + payload scatter (Client.get_into_parts): the payload pieces land in the registered
    # buffer through READ_FIXED, the small header pieces through recvmsg; bytes exact either way.
    keys, vals = _data(9, 3, MiB + 64)
    with _client(address) as client:
        assert client.put(keys, vals).stored == 3
        staging = np.zeros(3 * MiB, dtype=np.uint8)
        client.register_buffers([staging])
        heads = [bytearray(64) for _ in keys]
        bodies = [staging[i * MiB:(i + 1) * MiB] for i in range(3)]
        assert client.get_into_parts(keys, list(zip(heads, bodies))) == [MiB + 64] * 3
        assert [bytes(h) + b.tobytes() for h, b in zip(heads, bodies)] == vals
        conns = _conns(client)
        assert sum(c.registered_stats()["fixed_bytes"] for c in conns) == 3 * MiB
