"""A pool server's KV events (issue 26 part 1; kvfabric/server/kv_events.py), on the real C data plane.

Each test starts a native server with ``kv_events`` (and an SSD tier where the tier matters),
subscribes with a plain ZMQ SUB socket, drives it with a real client and checks the stream against
what the server holds: by medium, once per group, removals on eviction, delete and retire, the
eviction-to-SSD move, replay of missed batches, a subscriber that never reads, and a lost event
published as AllBlocksCleared that never leaves a removed block in a consumer's view. The decoding by
vLLM's own classes is in tests/e2e/vllm/test_pool_events.py. No timed assertions: every wait is on a
condition.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvfabric import Client, namespace_tag
from kvfabric.protocol.kv_events import MEDIUM_DRAM, MEDIUM_SSD, decode_batch
from kvfabric.testing.kv_events import EventLog, apply, replay
from kvfabric.testing.poll import wait_for

pytest.importorskip("kvfabric._native", reason="KV events are the native server's")
pytest.importorskip("zmq", reason="KV events are published over ZMQ (pyzmq)")
from kvfabric.server.native import NativeServer  # noqa: E402

WAIT_S = 120
OBJ = 256 << 10


def _value(key: bytes, n: int = OBJ) -> bytes:
    return (key * (n // len(key) + 1))[:n]


def _server(tmp_path, *, ssd: bool = False, **kw) -> NativeServer:
    extra = {}
    if ssd:
        d = tmp_path / "ssd"
        d.mkdir(mode=0o700)
        extra = {"ssd_paths": [str(d)], "ssd_capacity": 64 << 20}
    kw.setdefault("capacity", 2 << 20)
    return NativeServer(kv_events="tcp://127.0.0.1:*", prefault=False, **extra, **kw).start()


def _dram_truth(srv: NativeServer) -> set[bytes]:
    return {k for k, _ in srv._srv.keys()}


def _settled(log: EventLog, srv: NativeServer) -> bool:
    """Every batch the server published has arrived."""
    seqs, _ = log.snapshot()
    return bool(seqs) and seqs[-1] == srv.stats()["kv_events"]["batches"] - 1


def _subscribe(srv: NativeServer) -> EventLog:
    """An EventLog that has seen a batch (a SUB socket connects asynchronously: probe objects are put
    until one arrives), the probes deleted again and their removals seen (not merely every batch
    published so far: a removal may still wait in the server's ring for the next control round)."""
    log = EventLog(srv.kv_events.endpoint)
    probes = []
    with Client([srv.address]) as c:
        while not log.snapshot()[0]:
            probes.append(b"probe-%d" % len(probes))
            assert c.put([probes[-1]], [b"x"]).stored == 1
            wait_for(lambda: log.snapshot()[0], 0.2)
            assert len(probes) < 2000, "the subscriber never received a batch"
        assert c.delete(probes) == len(probes)
    # published whatever the subscriber saw of their stores: each probe's removal is in the stream
    assert wait_for(lambda: all(_removed_seen(log, p) for p in probes), WAIT_S), ("the probes' removals", probes)
    return log


def _caught_up(log: EventLog, c: Client) -> None:
    """Every event recorded before now is published: a marker object put now is seen (the control thread
    drains the SSD ring before the store's each round; a marker of a round that lost events is not
    published, so markers are put until one is)."""
    for n in range(200):
        marker = b"marker-%d" % n
        assert c.put([marker], [b"m"]).stored == 1
        if wait_for(lambda: marker in log.snapshot()[1].get(MEDIUM_DRAM, ()), 5):
            return
    raise AssertionError(f"no marker published: {log.snapshot()[0][-5:]}")


def _removed_seen(log: EventLog, key: bytes) -> bool:
    """The DRAM removal of ``key`` was published. Used after a DELETE of the newest object, whose event the
    control thread drains after every SSD event recorded before it: the stream has caught up."""
    return any(e["type"] == "BlockRemoved" and e["medium"] == MEDIUM_DRAM and key in e["block_hashes"]
               for e in log.events())


def _contiguous(seqs: list[int]) -> bool:
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_dram_store_evict_delete_and_the_move_to_ssd(tmp_path):
    srv = _server(tmp_path, ssd=True)
    log = _subscribe(srv)
    try:
        with Client([srv.address]) as c:
            keys = [b"obj-%03d" % i for i in range(20)]   # 5 MiB into 2 MiB: most go to SSD
            for k in keys:
                assert c.put([k], [_value(k)]).stored == 1
            assert wait_for(lambda: srv.stats()["ssd_objects"] + len(_dram_truth(srv)) >= len(keys)
                            and srv.stats()["ssd_queue_bytes"] == 0, WAIT_S), "the write-behind to finish"
            assert c.delete([keys[-1]]) == 1
            assert wait_for(lambda: _removed_seen(log, keys[-1]), WAIT_S), "the delete's event"
            # the SSD is settled (nothing queued, nothing evicted since): its events arrive, in a round or two
            assert wait_for(lambda: len(log.snapshot()[1].get(MEDIUM_SSD, ())) == srv.stats()["ssd_objects"], WAIT_S), \
                (log.snapshot()[1].get(MEDIUM_SSD), srv.stats()["ssd_objects"])
        seqs, view = log.snapshot()
        assert _contiguous(seqs), seqs
        st = srv.stats()
        assert view[MEDIUM_DRAM] == _dram_truth(srv), (view[MEDIUM_DRAM], _dram_truth(srv))
        assert len(view.get(MEDIUM_SSD, ())) == st["ssd_objects"] > 0, (view.get(MEDIUM_SSD), st["ssd_objects"])
        evs = log.events()
        removed = [e["block_hashes"][0] for e in evs if e["type"] == "BlockRemoved" and e["medium"] == MEDIUM_DRAM]
        ssd = [e["block_hashes"][0] for e in evs if e["type"] == "BlockStored" and e["medium"] == MEDIUM_SSD]
        assert keys[0] in removed and keys[0] in ssd, (removed, ssd)
        at = {(e["type"], e["medium"], e["block_hashes"][0]): i for i, e in enumerate(evs) if "medium" in e}
        assert at[("BlockRemoved", MEDIUM_DRAM, keys[0])] < at[("BlockStored", MEDIUM_SSD, keys[0])]   # the move
        assert set(ssd) <= set(removed), "an SSD store of an object never evicted from DRAM"
        assert keys[-1] in removed
        for e in evs:   # the fields vLLM's BlockStored has no default for are all written
            if e["type"] == "BlockStored":
                assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name"} <= set(e), e
        assert st["kv_events"]["resets"] == 0 and st["kv_events"]["lost"] == 0, st["kv_events"]
    finally:
        log.close()
        srv.stop()


def test_a_group_is_one_block_once_whole_and_removed_once(tmp_path):
    srv = _server(tmp_path, ssd=True, capacity=4 << 20)
    log = _subscribe(srv)
    try:
        with Client([srv.address]) as c:
            chunks = [b"chunk-%02d" % g for g in range(6)]          # 6 groups x 4 parts x 256 KiB = 6 MiB
            for g in chunks:
                parts = [g + b"/layer-%d" % i for i in range(4)]
                assert c.put(parts, [_value(k) for k in parts], placement=[g] * 4).stored == 4
            assert wait_for(lambda: srv.stats()["ssd_queue_bytes"] == 0 and srv.stats()["ssd_objects"] >= 4, WAIT_S), \
                "evicted groups on SSD"
            assert c.delete([chunks[-1] + b"/layer-0"], placement=[chunks[-1]]) == 4   # the whole group
            assert wait_for(lambda: _removed_seen(log, chunks[-1]), WAIT_S), "the last group's removal"
            assert wait_for(lambda: 4 * len(log.snapshot()[1].get(MEDIUM_SSD, ())) == srv.stats()["ssd_objects"],
                            WAIT_S), (log.snapshot()[1].get(MEDIUM_SSD), srv.stats()["ssd_objects"])

        def stored_in_dram() -> list[bytes]:
            return [e["block_hashes"][0] for e in log.events()
                    if e["type"] == "BlockStored" and e["medium"] == MEDIUM_DRAM]

        assert wait_for(lambda: chunks[-1] in stored_in_dram(), WAIT_S), "the last group's store"
        stored = stored_in_dram()
        assert [k for k in stored if not k.startswith(b"probe")] == chunks, stored      # a group is named by its key, once
        view = log.snapshot()[1]
        st = srv.stats()
        on_ssd = view.get(MEDIUM_SSD, set())
        assert on_ssd and on_ssd <= set(chunks) and len(on_ssd) * 4 == st["ssd_objects"], (on_ssd, st["ssd_objects"])
        assert not (on_ssd & view[MEDIUM_DRAM]), (on_ssd, view[MEDIUM_DRAM])   # moved, not copied
        in_dram = {g for g in chunks if g + b"/layer-0" in _dram_truth(srv)}
        assert chunks[-1] not in in_dram and chunks[-1] not in on_ssd
        assert view[MEDIUM_DRAM] == in_dram, (view[MEDIUM_DRAM], in_dram)
    finally:
        log.close()
        srv.stop()


def test_retire_removes_what_it_drops(tmp_path):
    srv = _server(tmp_path, capacity=8 << 20)
    log = _subscribe(srv)
    tag = namespace_tag(b"kv events retire")
    try:
        with Client([srv.address]) as c:
            keys = [b"tagged-%d" % i for i in range(5)]
            assert c.put(keys, [_value(k, 4096) for k in keys], ns_tag=tag).stored == 5
            c.retire(tag)
            assert wait_for(lambda: not (_dram_truth(srv) & set(keys)) and _settled(log, srv)
                     and not (log.snapshot()[1][MEDIUM_DRAM] & set(keys)), WAIT_S), "the retired objects swept and published removed"
        assert log.snapshot()[1][MEDIUM_DRAM] == set()
    finally:
        log.close()
        srv.stop()


def test_replay_gives_a_late_subscriber_what_it_missed(tmp_path):
    srv = _server(tmp_path, capacity=8 << 20, kv_events_replay="tcp://127.0.0.1:*")
    try:
        with Client([srv.address]) as c:
            for i in range(10):
                assert c.put([b"early-%d" % i], [_value(b"e", 4096)]).stored == 1
        assert wait_for(lambda: srv.stats()["kv_events"]["events"] >= 10, WAIT_S), "the early events published"
        got = replay(srv.kv_events.replay_endpoint, 0)
        assert [s for s, _ in got] == list(range(len(got))) and got, got
        view: dict[str, set[bytes]] = {}
        for _, payload in got:
            apply(view, decode_batch(payload)[1])
        assert view[MEDIUM_DRAM] == {b"early-%d" % i for i in range(10)}, view
        later = replay(srv.kv_events.replay_endpoint, got[-1][0])
        assert [s for s, _ in later] == [got[-1][0]], later
        assert srv.stats()["kv_events"]["replays"] == 2
    finally:
        srv.stop()


def test_a_subscriber_that_never_reads_slows_nothing(tmp_path):
    """A SUB socket with a one-message queue that is never read: every PUT completes and the reading
    subscriber beside it gets every batch in order (ZMQ drops for the stuck one only)."""
    import zmq

    srv = _server(tmp_path, capacity=64 << 20)
    stuck = zmq.Context.instance().socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(srv.kv_events.endpoint)
    log = _subscribe(srv)
    try:
        with Client([srv.address]) as c:
            for i in range(3000):
                assert c.put([b"many-%05d" % i], [b"v" * 64]).stored == 1
            assert wait_for(lambda: _settled(log, srv) and len(log.snapshot()[1][MEDIUM_DRAM]) == 3000, WAIT_S), "every event at the reading subscriber"
        assert _contiguous(log.snapshot()[0])
    finally:
        stuck.close(0)
        log.close()
        srv.stop()


def test_lost_events_are_a_reset_never_a_stale_block(tmp_path):
    """A ring of 4 events: a burst loses events, which the stream says with AllBlocksCleared; whatever
    the consumer's view holds afterwards is held by the server (under-prediction only)."""
    srv = _server(tmp_path, ssd=True, capacity=2 << 20, kv_events_ring=4)
    log = _subscribe(srv)
    try:
        with Client([srv.address]) as c:
            keys = [b"burst-%03d" % i for i in range(48)]
            for frame in (keys[:24], keys[24:]):   # one frame, one burst; the second evicts to SSD
                assert c.put(frame, [_value(k, 64 << 10) for k in frame]).stored == 24
            assert c.delete(keys[:6]) == 6
            assert wait_for(lambda: srv.stats()["ssd_queue_bytes"] == 0, WAIT_S), "the write-behind to finish"
            _caught_up(log, c)
        st = srv.stats()["kv_events"]
        assert st["resets"] >= 1 and st["lost"] >= 1, st
        assert any(e["type"] == "AllBlocksCleared" for e in log.events())
        view = log.snapshot()[1]
        assert view.get(MEDIUM_DRAM, set()) <= _dram_truth(srv), (view.get(MEDIUM_DRAM), _dram_truth(srv))
        assert len(view.get(MEDIUM_SSD, ())) <= srv.stats()["ssd_objects"]
        assert not (view.get(MEDIUM_DRAM, set()) | view.get(MEDIUM_SSD, set())) & set(keys[:6])
    finally:
        log.close()
        srv.stop()


@pytest.mark.parametrize("args, message", [
    (["--kv-events", "127.0.0.1:5557"], "must be a ZMQ endpoint"),
    (["--kv-events-replay", "tcp://127.0.0.1:*"], "needs --kv-events"),
    (["--kv-events", "tcp://127.0.0.1:*", "--kv-events-ring", "0"], "--kv-events-ring"),
    (["--kv-events", "tcp://127.0.0.1:{taken}"], "cannot bind"),
])
def test_serve_refuses_bad_kv_events_options(args, message):
    with socket.socket() as taken:   # a port in use on loopback: the bind fails
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [a.format(taken=taken.getsockname()[1]) for a in args]
        proc = subprocess.run([sys.executable, "-m", "kvfabric", "serve", "--port", "0", "--capacity", "16MiB",
                               *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stdout, proc.stderr[-3000:])
