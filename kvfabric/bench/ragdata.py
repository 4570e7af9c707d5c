"""A real multi-document RAG workload: MuSiQue questions with their retrieved passages, as a trace.

``kvfabric bench ragdata --input musique_s.json --out-dir data/rag/musique``
turns a multi-document QA file into replayable traces, the way a RAG engine
builds its prompts:

    system template + passage_1 + ... + passage_k + question

(k = every passage the file retrieved for the question, 10 for MuSiQue, in
retrieval order; each passage as ``title\\n\\ntext\\n\\n``). The input is the
JSON list used by CacheBlend's evaluation (``[{"question": str, "ctxs":
[{"title": str, "text": str}, ...], "answers": [...]}, ...]``); where it comes
from and its license are in ``data/rag/musique/README.md``.

Tokenizer: :func:`words_tokenizer`, a deterministic, dependency-free
stand-in for a BPE tokenizer (no tokenizer file can be downloaded here): text
is split into words with their leading space, digit groups and punctuation
runs, as GPT-style pre-tokenizers do, words longer than
``WORD_PIECE_CHARS`` characters are cut into pieces of that many characters
(BPE splits rare words into sub-words), and each piece's id is a 31-bit
xxh3 of its text. Equal text gives equal tokens, which is all prefix and
chunk reuse depend on; the token *counts* (3.8 characters per token on
MuSiQue) approximate a Llama-style tokenizer's and set where block boundaries
fall. Every segment is tokenized on its own, as CacheBlend does (a chunk's
KV is computed for the chunk alone).

Keys are the real kvfabric keys: prefix keys from
:meth:`KeyHasher.prefix_keys` over the whole prompt (whole blocks only), and
for every passage its chunk keys from :meth:`KeyHasher.chunk_keys` (blocks cut
from the passage's start, the tail block included). Each distinct key becomes
a dense id in order of first appearance (prefix and chunk ids counted
separately), written as ``hash_ids`` and ``chunks`` (see
:mod:`kvfabric.bench.traces`). Requests arrive every ``--interval-ms`` (250
ms, the generator's default rate of 4/s) in file order; ``output_length`` is
32 (CacheBlend's answer budget).

The converted traces are bundled (``musique-b16``, ``musique-b256``: 16-token
blocks as vLLM pages them, 256 as LMCache chunks them), so benchmarks never
need the input or the tokenizer at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import xxhash

from ..keys import KeyHasher, Namespace
from .traces import Request, Trace, TraceError, check_chained, write_trace

SYSTEM_TEMPLATE = ("You are a question answering assistant. Read the passages below, then answer the question using "
                   "only what they say. Keep the answer short: a few words, no explanation.\nPassages:\n")
QUESTION_TEMPLATE = "\nUsing only the passages above, answer the question in a few words.\nQuestion: {q}\nAnswer:"
WORD_PIECE_CHARS = 6
OUTPUT_TOKENS = 32
DEFAULT_MODEL = "kvfabric/ragdata-words"

_PRETOKENIZE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+|_+")


def words_tokenizer(text: str) -> list[int]:
    """Deterministic word-piece tokens: pre-tokenize, cut long words, hash each piece to a 31-bit id."""
    h = xxhash.xxh3_64_intdigest
    out: list[int] = []
    for m in _PRETOKENIZE.finditer(text):
        piece = m.group()
        for i in range(0, len(piece), WORD_PIECE_CHARS):
            out.append(h(piece[i : i + WORD_PIECE_CHARS].encode("utf-8")) & 0x7FFFFFFF)
    return out


def build_segments(example: dict[str, Any], top_k: int | None = None) -> tuple[str, list[str], str]:
    """(system template, passages in retrieval order, question part) of one QA record."""
    q = example["question"].strip()
    passages = [f"{c.get('title', '')}\n\n{c['text']}\n\n" if c.get("title") else f"{c['text']}\n\n"
                for c in example["ctxs"][:top_k]]
    return SYSTEM_TEMPLATE, passages, QUESTION_TEMPLATE.format(q=q)


def _validate(data: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(data, list) or not data:
        raise TraceError(f"{where}: expected a non-empty JSON list of QA records")
    for i, ex in enumerate(data):
        ok = (isinstance(ex, dict) and isinstance(ex.get("question"), str) and isinstance(ex.get("ctxs"), list)
              and ex["ctxs"] and all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in ex["ctxs"]))
        if not ok:
            raise TraceError(f"{where}: record {i} needs a 'question' string and a non-empty 'ctxs' list of "
                             f"{{'title', 'text'}} objects")
    return data


def convert(data: list[dict[str, Any]], *, block_tokens: int, model: str = DEFAULT_MODEL, top_k: int | None = None,
            interval_ms: float = 250.0, name: str = "musique") -> Trace:
    """QA records -> a trace with prefix ids and per-passage chunk ids (real kvfabric keys, densely renumbered)."""
    ns = Namespace(model=model, block_tokens=block_tokens)
    hasher = KeyHasher()
    prefix_ids: dict[bytes, int] = {}
    chunk_ids: dict[bytes, int] = {}
    reqs: list[Request] = []
    for i, ex in enumerate(_validate(data, name)):
        system, passages, question = build_segments(ex, top_k)
        tokens = words_tokenizer(system)
        chunks: list[tuple[int, int, list[int]]] = []
        for p in passages:
            pt = words_tokenizer(p)
            ids = [chunk_ids.setdefault(k, len(chunk_ids)) for k in hasher.chunk_keys(ns, pt)]
            chunks.append((len(tokens), len(pt), ids))
            tokens += pt
        tokens += words_tokenizer(question)
        ids = [prefix_ids.setdefault(k, len(prefix_ids)) for k in hasher.prefix_keys(ns, tokens)]
        reqs.append(Request(round(i * interval_ms, 3), len(tokens), OUTPUT_TOKENS, ids, "", f"q{i}", chunks))
    trace = Trace(reqs, block_tokens, f"{name}-b{block_tokens}")
    check_chained(trace)
    return trace


def passage_stats(data: list[dict[str, Any]], top_k: int | None = None) -> dict[str, float]:
    """Reuse in the raw data, independent of tokenizer and blocks: how many passages were retrieved before."""
    seen: set[str] = set()
    total = repeated = 0
    for ex in data:
        for p in build_segments(ex, top_k)[1]:
            total += 1
            repeated += p in seen
            seen.add(p)
    return {"passages": total, "unique_passages": len(seen), "repeated_passages": repeated,
            "repeated_fraction": repeated / total if total else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench ragdata",
                                description="Convert a multi-document QA file (CacheBlend's MuSiQue JSON) to traces.")
    p.add_argument("--input", required=True, help="the QA JSON file (e.g. CacheBlend's inputs/musique_s.json)")
    p.add_argument("--out-dir", default="data/rag/musique", help="where the traces go (default data/rag/musique)")
    p.add_argument("--name", default="musique", help="trace name prefix (default musique)")
    p.add_argument("--block-tokens", default="16,256", help="comma-separated block sizes, one trace each (default 16,256)")
    p.add_argument("--top-k", type=int, default=None, help="passages per prompt (default: all the file retrieved)")
    p.add_argument("--interval-ms", type=float, default=250.0, help="arrival spacing (default 250)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="namespace model id for the keys")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.block_tokens.split(",") if x.strip()]
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"--block-tokens must list positive ints, got {args.block_tokens!r}")
        if args.top_k is not None and args.top_k < 1:
            raise ValueError("--top-k must be >= 1")
        if not args.interval_ms >= 0:
            raise ValueError("--interval-ms must be >= 0")
        raw = Path(args.input).read_bytes()
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise TraceError(f"{args.input}: not JSON: {e}") from None
        traces = [convert(data, block_tokens=b, model=args.model, top_k=args.top_k, interval_ms=args.interval_ms,
                          name=args.name) for b in sizes]
    except (OSError, TraceError, ValueError) as e:
        print(f"kvfabric bench ragdata: {e}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st = passage_stats(data, args.top_k)
    chars = sum(len(s) for ex in data for s in [build_segments(ex, args.top_k)[0], *build_segments(ex, args.top_k)[1]])
    toks = sum(len(words_tokenizer(s)) for ex in data
               for s in [build_segments(ex, args.top_k)[0], *build_segments(ex, args.top_k)[1]])
    meta = {"input_sha256": hashlib.sha256(raw).hexdigest(), "records": len(data), "model": args.model,
            "top_k": args.top_k, "interval_ms": args.interval_ms, "chars_per_token": chars / toks, **st, "traces": {}}
    for t in traces:
        path = out / f"{t.name}.jsonl"
        write_trace(path, t.requests, t.block_tokens)
        meta["traces"][path.name] = {"requests": len(t), "block_tokens": t.block_tokens, "total_blocks": t.total_blocks,
                                     "unique_blocks": t.unique_blocks, "unique_chunk_blocks": t.unique_chunk_blocks,
                                     "prompt_tokens": sum(r.input_length for r in t.requests)}
        print(f"wrote {path}: {len(t)} requests, {t.total_blocks} blocks ({t.unique_blocks} unique) and "
              f"{t.unique_chunk_blocks} unique chunk blocks of {t.block_tokens} tokens")
    (out / "convert.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{st['passages']} passages, {st['unique_passages']} unique, {st['repeated_fraction']:.1%} retrieved before; "
          f"{meta['chars_per_token']:.2f} characters per token -> {out / 'convert.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
