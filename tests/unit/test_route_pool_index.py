"""The router's index of what the pool servers hold, from their KV events (kvfabric/route/pool.py
``PoolIndex``): per server, per medium, AllBlocksCleared per server, bounded, bad events counted. The
stream of a real server into it is tested in tests/e2e/vllm/test_route.py."""

from __future__ import annotations

from kvfabric.protocol.kv_events import MEDIUM_DRAM, MEDIUM_SSD, all_blocks_cleared, block_removed, block_stored
from kvfabric.route.pool import PoolIndex


def test_stored_removed_by_medium_and_cleared_per_server():
    idx = PoolIndex()
    a, b = idx.source("a"), idx.source("b")
    a.apply([block_stored([b"k1", b"k2"], MEDIUM_DRAM)])
    b.apply([block_stored([b"k3"], MEDIUM_DRAM)])
    assert idx.holds(b"k1") and idx.holds(b"k3") and not idx.holds(b"k4")
    a.apply([block_stored([b"k1"], MEDIUM_SSD), block_removed([b"k1"], MEDIUM_DRAM)])   # moved to SSD
    assert idx.holds(b"k1")
    a.apply([block_removed([b"k1"], MEDIUM_SSD)])
    assert not idx.holds(b"k1")
    a.apply([all_blocks_cleared()])             # a's view lost: only a's blocks go
    assert not idx.holds(b"k2") and idx.holds(b"k3")
    assert idx.counts["cleared"] == 1 and idx.counts["bad_events"] == 0


def test_bounded_and_bad_events_counted():
    idx = PoolIndex(max_entries=2)
    src = idx.source("a")
    src.apply([block_stored([b"1"], MEDIUM_DRAM), block_stored([b"2"], MEDIUM_DRAM), block_stored([b"3"], MEDIUM_DRAM)])
    assert not idx.holds(b"1") and idx.holds(b"2") and idx.holds(b"3") and idx.counts["forgotten"] == 1
    src.apply([{"type": "Nonsense"}, {"type": "BlockStored"}, block_removed([b"zz"], MEDIUM_DRAM)])
    assert idx.counts["bad_events"] == 2 and idx.holds(b"3")


def test_media_are_per_key_over_every_server():
    idx = PoolIndex()
    a, b = idx.source("a"), idx.source("b")
    a.apply([{"type": "BlockStored", "block_hashes": [b"k"], "medium": "DRAM"}])
    b.apply([{"type": "BlockStored", "block_hashes": [b"k", b"s"], "medium": "SSD"}])
    assert idx.media(b"k") == {"DRAM", "SSD"} and idx.media(b"s") == {"SSD"} and idx.media(b"x") == set()
    a.apply([{"type": "BlockRemoved", "block_hashes": [b"k"], "medium": "DRAM"}])
    assert idx.media(b"k") == {"SSD"}


def test_events_view_counts_a_chunk_held_only_on_ssd(tmp_path):
    """PoolEventsView.leading_run: chunks 0-2 held (0 in DRAM, 1 on SSD only, 2 on both), 3 missing."""
    import json

    from kvfabric_vllm.keys import prompt_keys
    from kvfabric_vllm.layout import part_group

    from kvfabric.route.pool import EngineShape, PoolEventsView

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 128}))
    view = PoolEventsView({"servers": ["127.0.0.1:1"]}, EngineShape(str(tmp_path)), [], tp_sizes=[1])  # asks no server
    try:
        tokens = list(range(5 * view.chunk_tokens))
        chunks = prompt_keys(view.engine, tokens).chunk_keys
        sp = view.splits[0]
        groups = [[part_group(view.hasher, ck, sp, r) for r in range(sp.tp_size)] for ck in chunks]
        src = view.index.source("s")
        src.apply([block_stored(groups[0] + groups[2], MEDIUM_DRAM),
                   block_stored(groups[1] + groups[2] + groups[4], MEDIUM_SSD)])
        c = view.chunk_tokens
        assert view.leading_run(tokens) == (3 * c, 1 * c)
        assert view.counts["ssd_chunks"] == 1 and view.counts["hit_chunks"] == 3, view.counts
        assert view.leading_tokens(tokens) == 3 * c
    finally:
        view.close()
