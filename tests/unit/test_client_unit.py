"""Client logic that needs no server: chunk planning, lookup combination, put folding,
transport registry and the transport's buffer planning."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric import protocol, sharding, transport
from kvfabric.client import PutResult, combine_puts, leading_run, plan_chunks
from kvfabric.config import ClientConfig
from kvfabric.errors import ConfigError, ProtocolError, TransportUnavailable
from kvfabric.protocol import PutStatus
from kvfabric.transport.base import get_sinks, parse_address


def test_plan_chunks_by_key_count():
    assert plan_chunks(range(10), 4, 1 << 30) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert plan_chunks([], 4, 100) == []


def test_plan_chunks_by_payload():
    sizes = {0: 60, 1: 50, 2: 10, 3: 200, 4: 1}
    assert plan_chunks(range(5), 100, 100, sizes.__getitem__) == [[0], [1, 2], [3], [4]]


def test_plan_chunks_respects_protocol_limit():
    chunks = plan_chunks(range(10_000), protocol.MAX_KEYS_PER_BATCH, protocol.MAX_PAYLOAD_BYTES)
    assert [len(c) for c in chunks] == [4096, 4096, 1808]
    assert [i for c in chunks for i in c] == list(range(10_000))


def _lookup_by_hand(present, servers):
    """The definition: first global key not held."""
    return next((i for i, p in enumerate(present) if not p), len(present))


def _lookup_per_shard(keys, present, servers):
    """What the client does: each shard counts its own leading held keys."""
    first_missing = []
    for shard, idx in sharding.group_by_owner(keys, servers).items():
        count = 0
        for i in idx:
            if not present[i]:
                break
            count += 1
        if count < len(idx):
            first_missing.append(idx[count])
    return leading_run(len(keys), first_missing)


def test_leading_run_matches_definition_on_random_patterns():
    rng = np.random.default_rng(7)
    servers = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    keys = [rng.bytes(16) for _ in range(64)]
    for trial in range(500):
        # Present prefix of random length, then random holes and random hits.
        cut = int(rng.integers(0, 65))
        present = [i < cut or bool(rng.integers(0, 2)) for i in range(64)]
        assert _lookup_per_shard(keys, present, servers) == _lookup_by_hand(present, servers), trial


def test_leading_run_edges():
    assert leading_run(5, []) == 5
    assert leading_run(5, [3, 1, 4]) == 1
    assert leading_run(0, []) == 0


def test_combine_puts():
    S, E, N, T = PutStatus.STORED, PutStatus.EXISTS, PutStatus.NO_SPACE, PutStatus.TOO_LARGE
    res, replica_drops = combine_puts([[S, -1], [E, E], [N, -1], [T, S], [-1, -1]])
    assert res == PutResult(stored=2, existed=1, dropped=2)
    assert replica_drops == 6


def test_registry_has_tcp_and_refuses_unknown_or_unavailable():
    assert "tcp" in transport.available()
    assert set(transport.available()) <= set(transport.names())
    with pytest.raises(ConfigError):
        transport.connect("carrier-pigeon", "127.0.0.1:1", ClientConfig())
    for name, reason in transport.unavailable().items():
        with pytest.raises(TransportUnavailable, match=name):
            transport.connect(name, "127.0.0.1:1", ClientConfig())
        assert reason


def test_parse_address():
    assert parse_address("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ["127.0.0.1", ":80", "h:0", "h:70000", "h:x", 7070]:
        with pytest.raises(ConfigError):
            parse_address(bad)


def test_get_sinks_places_objects_in_key_order():
    a, b, c = bytearray(8), np.zeros(16, np.uint8), bytearray(4)
    sinks, problem = get_sinks([5, -1, 3], [a, b, c], 8)
    assert problem is None
    assert [n for n, _ in sinks] == [5, 3]
    sinks[0][1][:] = b"hello"
    sinks[1][1][:] = b"abc"
    assert bytes(a[:5]) == b"hello" and bytes(c[:3]) == b"abc"


def test_get_sinks_flags_small_or_readonly_buffers_and_bad_replies():
    sinks, problem = get_sinks([5], [bytearray(4)], 5)
    assert sinks[0][1] is None and "4 bytes" in problem
    sinks, problem = get_sinks([2], [b"xx"], 2)
    assert sinks[0][1] is None and "read-only" in problem
    with pytest.raises(ProtocolError):
        get_sinks([1, 2], [bytearray(4)], 3)
    with pytest.raises(ProtocolError):
        get_sinks([1], [bytearray(4)], 3)
