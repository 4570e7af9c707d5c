"""A ``kvfabric serve --kv-events`` process's stream decoded by vLLM's own event classes (issue 26 part 1).

vLLM's ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
(``vllm/distributed/kv_events.py``) are msgspec structs: decoding every batch the pool published with
``msgspec.msgpack.Decoder(KVEventBatch)`` is what llm-d's indexer or a vLLM-side consumer does. The
server is a real process with an SSD tier; the client puts plain objects and one placement group,
enough to evict some to SSD, and deletes one. The stream's stores and removals, applied in order,
must equal what the server holds by medium; replay answers a late subscriber with the same bytes.
"""

from __future__ import annotations

import msgspec
import pytest

from kvfabric import Client
from kvfabric.protocol.kv_events import MEDIUM_DRAM, MEDIUM_SSD
from kvfabric.testing.kv_events import EventLog, replay
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server

kv_events = pytest.importorskip("vllm.distributed.kv_events")

WAIT_S = 120
OBJ = 256 << 10


def test_pool_events_decode_with_vllm_classes(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir(mode=0o700)
    pub, rep = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    args = ["--kv-events", pub, "--kv-events-replay", rep, "--ssd-path", str(ssd), "--ssd-capacity", "64MiB"]
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    with start_server(capacity="2MiB", extra_args=args) as srv:
        log = EventLog(pub)
        try:
            with Client([srv.address]) as c:
                probes = 0
                while not log.snapshot()[0]:   # a SUB socket connects asynchronously
                    assert c.put([b"probe-%d" % probes], [b"p"]).stored == 1
                    probes += 1
                    wait_for(lambda: log.snapshot()[0], 0.2)
                    assert probes < 2000, srv.stderr_text()[-3000:]
                plain = [b"plain-%02d" % i for i in range(8)]
                for k in plain:
                    assert c.put([k], [bytes([len(k)]) * OBJ]).stored == 1
                parts = [b"chunk-A/layer-%d" % i for i in range(4)]
                assert c.put(parts, [b"g" * OBJ] * 4, placement=[b"chunk-A"] * 4).stored == 4
                for k in [b"plain-%02d" % i for i in range(8, 16)]:   # pushes the group out to SSD too
                    assert c.put([k], [b"q" * OBJ]).stored == 1
                assert c.delete([b"plain-15"]) == 1
                assert wait_for(lambda: c.stats()["servers"][srv.address]["ssd_queue_bytes"] == 0, WAIT_S), "write-behind"
                marker = b"marker"
                assert c.put([marker], [b"m"]).stored == 1
                assert wait_for(lambda: marker in log.snapshot()[1].get(MEDIUM_DRAM, ()), WAIT_S), \
                    (log.snapshot()[0][-3:], srv.stderr_text()[-3000:])
                held = {k for k in [*plain, *[b"plain-%02d" % i for i in range(8, 16)], b"chunk-A/layer-0", marker]
                        if c.exists([k])[0]}
                st = c.stats()["servers"][srv.address]
        finally:
            log.close()
        batches = [decoder.decode(p) for p in log.raw]
        kinds = {type(e) for b in batches for e in b.events}
        assert kinds <= {kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared}, kinds
        assert kv_events.BlockStored in kinds and kv_events.BlockRemoved in kinds, kinds
        view: dict[str, set[bytes]] = {}
        for b in batches:
            assert isinstance(b.ts, float)
            for e in b.events:
                if isinstance(e, kv_events.BlockStored):
                    assert e.medium in (MEDIUM_DRAM, MEDIUM_SSD) and e.token_ids == [] and e.block_size == 0, e
                    view.setdefault(e.medium, set()).update(e.block_hashes)
                elif isinstance(e, kv_events.BlockRemoved):
                    view.setdefault(e.medium, set()).difference_update(e.block_hashes)
        in_pool = view.get(MEDIUM_DRAM, set()) | view.get(MEDIUM_SSD, set())
        expect = {b"chunk-A" if k == b"chunk-A/layer-0" else k for k in held}
        assert in_pool - {b"probe-%d" % i for i in range(probes)} == expect, (sorted(in_pool), sorted(expect))
        assert view.get(MEDIUM_SSD) and len(view[MEDIUM_SSD] - {b"chunk-A"}) + 4 * (b"chunk-A" in view[MEDIUM_SSD]) \
            == st["ssd_objects"], (view.get(MEDIUM_SSD), st["ssd_objects"])
        got = replay(rep, 0)
        first = log.snapshot()[0][0]
        assert [p for s, p in got if s >= first] == log.raw, "replay gives the bytes published"
