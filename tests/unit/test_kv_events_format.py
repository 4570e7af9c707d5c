"""The KV-events format (kvfabric/protocol/kv_events.py) and the publisher's pure parts
(kvfabric/server/kv_events.py): batch bound, SSD group accounting, loss handling. The stream of a real
server is tested in tests/native/test_kv_events.py and decoded by vLLM's classes in
tests/e2e/vllm/test_pool_events.py."""

from __future__ import annotations

import pytest

from kvfabric.errors import ConfigError
from kvfabric.protocol import kv_events as f
from kvfabric.server import kv_events as k


def test_a_full_batch_of_the_largest_events_fits_the_batch_bound():
    key = b"\xff" * 64   # the server's largest key (max_key_bytes)
    events = [f.all_blocks_cleared()] + [f.block_stored([key], f.MEDIUM_DRAM, parent=key)] * k.MAX_BATCH
    payload = f.encode_batch(1.0, events)
    assert len(payload) <= k.BATCH_BYTES_MAX, len(payload)
    ts, back = f.decode_batch(payload)
    assert ts == 1.0 and back == events


def test_decode_refuses_what_is_not_a_batch():
    for bad in (b"\xc1", f.encode_batch(0.0, [])[:1], b"\x93\x01\x02\x03"):
        with pytest.raises(f.EventError):
            f.decode_batch(bad)


def _ssd(pub, events, dropped=0):
    pub.round([], 0, events, dropped)
    with pub._cv:
        out = list(pub._queue)
        pub._queue.clear()
        lost, pub._lost = pub._lost, False
    return out, lost


@pytest.fixture
def pub():
    pytest.importorskip("zmq")
    return k.PoolEvents("tcp://127.0.0.1:*", ring=64)   # not started: no socket bound


def test_a_group_is_stored_on_ssd_once_whole_and_removed_at_its_first_part(pub):
    g, h = b"chunk", 12345
    parts = [(k.TIER_STORED, b"p%d" % i, 10, g, 3, h) for i in range(3)]
    assert _ssd(pub, parts[:2]) == ([], False)
    assert _ssd(pub, parts[2:]) == ([(True, f.MEDIUM_SSD, g, None)], False)
    assert _ssd(pub, [(k.TIER_REMOVED, b"p0", 10, None, 3, h)]) == ([(False, f.MEDIUM_SSD, g, None)], False)
    assert _ssd(pub, [(k.TIER_REMOVED, b"p1", 10, None, 3, h), (k.TIER_REMOVED, b"p2", 10, None, 3, h)]) == ([], False)
    assert not pub._ssd.groups
    # an ungrouped object is its own block
    assert _ssd(pub, [(k.TIER_STORED, b"solo", 10, None, 0, 0)]) == ([(True, f.MEDIUM_SSD, b"solo", None)], False)


def test_a_lost_ssd_event_is_a_reset_and_forgets_the_group_counts(pub):
    g, h = b"chunk", 7
    _ssd(pub, [(k.TIER_STORED, b"p0", 10, g, 2, h)])
    out, lost = _ssd(pub, [(k.TIER_STORED, b"p1", 10, g, 2, h)], dropped=1)
    assert out == [] and lost and not pub._ssd.groups        # this round's events may predate the loss
    # the group's other part is gone from the counts: it is never named whole from half its parts
    assert _ssd(pub, [(k.TIER_STORED, b"p1", 10, g, 2, h)], dropped=1) == ([], False)


def test_a_lost_store_event_drops_the_round_and_what_was_queued(pub):
    pub.round([(k.EV_INSERT, b"a", 1, None, None)], 0, [], 0)
    pub.round([(k.EV_INSERT, b"b", 1, None, None)], 3, [], 0)
    with pub._cv:
        assert list(pub._queue) == [] and pub._lost and pub.counts["lost"] == 1
    pub._lost = False
    pub.round([(k.EV_INSERT, b"c", 1, b"parent", None), (k.EV_ACCESS, b"c", 0, None, None),
               (k.EV_REMOVE, b"r", 0, None, b"grp")], 3, [(k.TIER_STORED, b"s", 1, None, 0, 0)], 0)
    with pub._cv:   # DRAM first, then SSD: a move's removal before its store
        assert list(pub._queue) == [(True, f.MEDIUM_DRAM, b"c", b"parent"), (False, f.MEDIUM_DRAM, b"grp", None),
                                    (True, f.MEDIUM_SSD, b"s", None)]


def test_a_full_queue_is_a_loss(pub):
    pub.round([(k.EV_INSERT, b"%d" % i, 1, None, None) for i in range(60)], 0, [], 0)
    pub.round([(k.EV_INSERT, b"x%d" % i, 1, None, None) for i in range(10)], 0, [], 0)
    with pub._cv:
        assert len(pub._queue) == 0 and pub._lost and pub.counts["lost"] == 70


@pytest.mark.parametrize("endpoint", ["127.0.0.1:1", "http://x", "tcp://", ""])
def test_bad_endpoints_are_config_errors(endpoint):
    pytest.importorskip("zmq")
    with pytest.raises(ConfigError, match="ZMQ endpoint"):
        k.PoolEvents(endpoint)


def test_the_memory_share_of_a_subscriber_that_does_not_read():
    assert k.subscriber_bytes() == k.DEFAULT_HWM * k.BATCH_BYTES_MAX == 16 << 20
