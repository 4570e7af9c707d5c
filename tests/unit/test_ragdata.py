"""The real-workload converter (kvfabric bench ragdata) on a small made-up input, and the bundled MuSiQue traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfabric.bench.belady import infinite, infinite_chunks
from kvfabric.bench.ragdata import convert, main, passage_stats, words_tokenizer
from kvfabric.bench.traces import TraceError, load_trace
from kvfabric.keys import KeyHasher, Namespace

PASSAGES = {
    "a": "the river thames flows through london and oxford, past 1,234 bridges.",
    "b": "oxford is a university city; its colleges include exeter college and balliol.",
    "c": "exeter college was founded in 1314 by walter de stapledon, bishop of exeter.",
    "d": "hannibal barca crossed the alps with elephants in 218 bc.",
}


def qa(question, keys):
    return {"question": question, "ctxs": [{"title": "", "text": PASSAGES[k]} for k in keys], "answers": ["x"]}


DATA = [qa("where is exeter college?", "abc"), qa("who founded exeter college?", "cda"), qa("what did hannibal cross?", "d")]


def test_tokenizer_is_deterministic_and_splits_words_like_a_pretokenizer():
    t = words_tokenizer("Hello, world  2024 extraordinarily")
    assert t == words_tokenizer("Hello, world  2024 extraordinarily")
    # "Hello" "," " world" " " " 202" "4" " extra" "ordina" "rily"
    assert len(t) == 9
    assert all(0 <= x < 2**31 for x in t)
    assert words_tokenizer(" world") == [t[2]]  # a piece's id does not depend on its neighbours


def test_convert_keys_passages_by_content_not_position():
    t = convert(DATA, block_tokens=4, name="toy")
    assert t.name == "toy-b4" and len(t) == 3 and t.has_chunks
    r0, r1, r2 = t.requests
    # Passage c is the third passage of question 0 and the first of question 1: same chunk ids ...
    assert r0.chunks[2][2] == r1.chunks[0][2]
    assert r0.chunks[2][1] == r1.chunks[0][1]
    assert r0.chunks[2][0] != r1.chunks[0][0]
    # ... and they are exactly the dense ids of KeyHasher.chunk_keys over the passage's tokens.
    ns = Namespace(model="kvfabric/ragdata-words", block_tokens=4)
    keys = KeyHasher().chunk_keys(ns, words_tokenizer(PASSAGES["c"] + "\n\n"))
    assert len(keys) == len(r1.chunks[0][2])
    # The prompts share only the system template as a prefix.
    shared = 0
    while r0.hash_ids[shared] == r1.hash_ids[shared]:
        shared += 1
    assert 0 < shared <= r0.chunks[0][0] // 4 + 1
    # Chunk reuse is visible, prefix reuse stops at the template.
    pre, ch = infinite_chunks(t)
    assert ch.hit_tokens >= r1.chunks[0][1] + r1.chunks[2][1] + r2.chunks[0][1]
    assert infinite(t).hit_blocks == pre.hit_blocks
    assert passage_stats(DATA) == {"passages": 7, "unique_passages": 4, "repeated_passages": 3,
                                   "repeated_fraction": 3 / 7}
    assert [r.timestamp for r in t.requests] == [0.0, 250.0, 500.0]


def test_cli_writes_loadable_traces_byte_for_byte_again(tmp_path, capsys):
    src = tmp_path / "qa.json"
    src.write_text(json.dumps(DATA))
    for out in ("one", "two"):
        assert main(["--input", str(src), "--out-dir", str(tmp_path / out), "--block-tokens", "4,8"]) == 0
    a = (tmp_path / "one" / "musique-b4.jsonl").read_bytes()
    assert a == (tmp_path / "two" / "musique-b4.jsonl").read_bytes()
    assert load_trace(tmp_path / "one" / "musique-b8.jsonl").block_tokens == 8
    meta = json.loads((tmp_path / "one" / "convert.json").read_text())
    assert meta["records"] == 3 and meta["repeated_passages"] == 3
    assert "7 passages, 4 unique, 42.9% retrieved before" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [[], [{"question": "q"}], [{"question": "q", "ctxs": [{"title": "t"}]}], {"a": 1}])
def test_bad_input_is_a_usage_error(tmp_path, bad, capsys):
    src = tmp_path / "qa.json"
    src.write_text(json.dumps(bad))
    assert main(["--input", str(src), "--out-dir", str(tmp_path)]) == 2
    with pytest.raises(TraceError):
        convert(bad, block_tokens=4)
    assert main(["--input", str(tmp_path / "missing.json")]) == 2
    assert "kvfabric bench ragdata" in capsys.readouterr().err


def test_bundled_musique_traces_match_their_conversion_record():
    root = Path(__file__).resolve().parents[2] / "data" / "rag" / "musique"
    meta = json.loads((root / "convert.json").read_text())
    assert meta["records"] == 150 and meta["repeated_passages"] == 245
    for file, m in meta["traces"].items():
        t = load_trace(root / file)
        assert (len(t), t.total_blocks, t.unique_blocks, t.unique_chunk_blocks) == (
            m["requests"], m["total_blocks"], m["unique_blocks"], m["unique_chunk_blocks"])
        pre, ch = infinite_chunks(t)
        # The measurement: prefix reuse is ~1% while ~16% of prompt tokens are passages seen before.
        assert pre.token_hit_rate < 0.02
        assert 0.12 < ch.token_hit_rate < 0.2
