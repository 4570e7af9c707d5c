"""Trace loading and validation, writing, bundled Mooncake traces, key derivation and conversion."""

from __future__ import annotations

import json

import pytest

from kvfabric.bench.convert import convert_records, main as convert_main
from kvfabric.bench.traces import (
    Request,
    TraceError,
    block_keys,
    load_trace,
    write_trace,
)
from kvfabric.keys import KeyHasher, Namespace


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def rec(ts=0, n=1024, ids=(0, 1), **kw):
    return {"timestamp": ts, "input_length": n, "output_length": 5, "hash_ids": list(ids), **kw}


def test_bundled_mooncake_traces():
    conv = load_trace("mooncake-conversation")
    assert (len(conv), conv.total_blocks, conv.unique_blocks, conv.block_tokens) == (12031, 288500, 182790, 512)
    syn = load_trace("mooncake-synthetic")
    assert (len(syn), syn.total_blocks, syn.unique_blocks) == (3993, 121877, 43924)
    ts = [r.timestamp for r in syn]
    assert ts == sorted(ts)


def test_load_sorts_by_timestamp_stably_and_limits(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [rec(5, ids=[0, 1]), rec(1, ids=[2, 3]), "", rec(5, ids=[4, 5])])
    t = load_trace(p)
    assert [r.hash_ids for r in t] == [[2, 3], [0, 1], [4, 5]]
    assert len(load_trace(p, limit=1)) == 1


def test_partial_last_block_tokens():
    r = Request(0, 1100, 1, [0, 1, 2])
    assert [r.block_tokens(i, 512) for i in range(3)] == [512, 512, 76]


@pytest.mark.parametrize(
    "bad, match",
    [
        ("{not json", "not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}), "missing field 'hash_ids'"),
        (json.dumps(rec(ts=-1)), "timestamp"),
        (json.dumps(rec(n=-3)), "input_length"),
        (json.dumps(rec(ids=["x"])), "hash_ids"),
        (json.dumps(rec(n=5000, ids=[0, 1])), "cannot be 5000 tokens"),
        (json.dumps(rec(block_tokens=256)), "block_tokens=256"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, bad, match):
    p = write_lines(tmp_path / "t.jsonl", [rec(), bad])
    with pytest.raises(TraceError, match=match) as ei:
        load_trace(p)
    assert "t.jsonl:2" in str(ei.value)


def test_missing_and_empty(tmp_path):
    with pytest.raises(TraceError, match="no trace file"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "e.jsonl")


def test_write_then_load_keeps_block_tokens_and_fields(tmp_path):
    reqs = [Request(0.5, 300, 2, [0, 1, 2], "t1", "s1"), Request(2.0, 200, 1, [0, 3], "t1", "s2")]
    path = tmp_path / "w.jsonl"
    assert write_trace(path, reqs, 128) == 2
    t = load_trace(path)  # block_tokens sniffed from the file
    assert t.block_tokens == 128
    assert [(r.hash_ids, r.tenant, r.session) for r in t] == [([0, 1, 2], "t1", "s1"), ([0, 3], "t1", "s2")]
    with pytest.raises(TraceError):
        load_trace(path, block_tokens=512)


def test_block_keys_deterministic_distinct_and_salted():
    a = block_keys([0, 1, 2, 1])
    assert len(a[0]) == 16 and a[1] == a[3] and len(set(a)) == 3
    assert block_keys([0, 1, 2, 1]) == a
    assert block_keys([0], salt=7) != a[:1]


def test_convert_text_and_tokens_share_prefix_ids_and_match_kvfabric_keys():
    records = [
        ("l1", {"prompt": "A" * 40 + "B" * 9}),
        ("l2", {"prompt": "A" * 40 + "C" * 30, "timestamp": 7}),
        ("l3", {"token_ids": [65] * 40, "tenant": "x"}),
        ("l4", {"tokens": [65] * 40}),
    ]
    out = list(convert_records(iter(records), model="m", block_tokens=16, keys_out=True))
    reqs = [r for r, _ in out]
    assert reqs[0].hash_ids == [0, 1, 2]            # 49 tokens -> 3 whole blocks
    assert reqs[1].hash_ids[:2] == [0, 1] and reqs[1].hash_ids[2:] == [3, 4]
    assert reqs[1].timestamp == 7 and reqs[0].timestamp == 0
    assert reqs[2].hash_ids == [5, 6]               # another tenant: other namespace, other keys
    assert reqs[3].hash_ids == [0, 1]               # same tokens as the text's prefix
    want = KeyHasher().prefix_keys(Namespace(model="m", block_tokens=16), [65] * 40)
    assert out[3][1] == want


def test_convert_cli_and_errors(tmp_path, capsys):
    src = write_lines(tmp_path / "p.jsonl", [{"prompt": "hello world " * 10}, {"prompt": "hello world " * 12}])
    dst = tmp_path / "o.jsonl"
    assert convert_main([str(src), "--out", str(dst), "--block-tokens", "32", "--keys"]) == 0
    t = load_trace(dst)
    assert t.block_tokens == 32 and t.requests[1].hash_ids[:3] == t.requests[0].hash_ids
    assert len(json.loads(dst.read_text().splitlines()[0])["keys"]) == 3
    bad = write_lines(tmp_path / "b.jsonl", [{"prompt": "x"}, {"neither": 1}])
    assert convert_main([str(bad), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "b.jsonl:2" in capsys.readouterr().err
    assert convert_main([str(src), "--out", str(tmp_path / "y.jsonl"), "--tokenizer", "wat"]) == 2


# --- chunks field, chain property, empty traces (issue 15) -----------------------------------------------------


def test_chunks_round_trip_and_bundled_musique(tmp_path):
    r = Request(0, 40, 1, [0, 1], chunks=[(3, 20, [7, 8]), (23, 17, [9, 10])])
    write_trace(tmp_path / "c.jsonl", [r], 16)
    (back,) = load_trace(tmp_path / "c.jsonl").requests
    assert back.chunks == [(3, 20, [7, 8]), (23, 17, [9, 10])]
    for name, bt in (("musique-b16", 16), ("musique-b256", 256)):
        t = load_trace(name)
        assert len(t) == 150 and t.block_tokens == bt and t.has_chunks
        assert all(len(r.chunks) == 10 for r in t.requests)


@pytest.mark.parametrize(
    "chunks,match",
    [
        ("x", "list"),
        ([[0, 20]], r"\[start_token"),
        ([[0, 0, []]], "empty"),
        ([[0, 20, [1]]], "expected 2"),
        ([[30, 20, [1, 2]]], "past"),
        ([[0, 20, [1, 2]], [10, 5, [3]]], "overlaps"),
        ([[0, 5, [-1]]], "chunk ids"),
        ([[True, 5, [1]]], "non-negative"),
    ],
)
def test_bad_chunks_are_refused(tmp_path, chunks, match):
    p = write_lines(tmp_path / "t.jsonl", [rec(n=40, ids=[0, 1], chunks=chunks)])
    with pytest.raises(TraceError, match=match):
        load_trace(p, 16)


def test_unchained_traces_are_refused(tmp_path):
    # Id 1 after 0 in one request and after 5 in another: ids do not name whole prefixes.
    p = write_lines(tmp_path / "t.jsonl", [rec(0, 32, [0, 1]), rec(1, 32, [5, 1])])
    with pytest.raises(TraceError, match="depth 1 after 5"):
        load_trace(p, 16)
    # The same id twice in one request.
    p = write_lines(tmp_path / "d.jsonl", [rec(0, 48, [0, 1, 0])])
    with pytest.raises(TraceError, match="whole prefixes"):
        load_trace(p, 16)
    # Chunk ids follow the same rule within their chunk (parent, depth, tail length).
    p = write_lines(tmp_path / "c.jsonl", [rec(0, 64, [0, 1, 2, 3], chunks=[[0, 20, [1, 2]]]),
                                           rec(1, 64, [0, 1, 2, 3], chunks=[[0, 30, [1, 2]]])])
    with pytest.raises(TraceError, match="chunk id 2"):
        load_trace(p, 16)


def test_a_trace_without_blocks_is_refused_everywhere(tmp_path, capsys):
    from kvfabric.bench.belady import main as belady_main
    from kvfabric.bench.simulate import main as simulate_main
    from kvfabric.bench.traces import main as traces_main

    p = write_lines(tmp_path / "t.jsonl", [rec(0, 10, []), rec(1, 3, [])])
    with pytest.raises(TraceError, match="hold no blocks"):
        load_trace(p, 16)
    for main in (traces_main, simulate_main, belady_main):
        assert main([str(p), "--block-tokens", "16"]) == 2
    assert "hold no blocks" in capsys.readouterr().err
