"""``kvfabric bench convert``: turn a prompt log into a replayable trace with kvfabric keys.

Input: JSON lines, one request each, with the prompt as token ids
(``"token_ids"`` or ``"tokens"``: a list of ints) or as text (``"prompt"`` or
``"text"``), and optionally ``"timestamp"`` (ms; default: line number x
``--interval-ms``), ``"output_length"`` (default 0) and ``"tenant"``.

Text is tokenized with ``--tokenizer``: ``bytes`` (default, no dependency:
one token per UTF-8 byte, so prefixes that are equal as text are equal as
tokens, which is all prefix caching needs) or ``hf:NAME``, a Hugging Face
tokenizer loaded with ``transformers.AutoTokenizer`` (must be installed and
the tokenizer available locally).

Keys are computed exactly as a kvfabric client would compute them
(:meth:`kvfabric.keys.KeyHasher.prefix_keys` under
``Namespace(model=--model, block_tokens=--block-tokens, tenant=...)``,
whole blocks only), and each distinct key becomes a dense hash id in order of
first appearance, so equal ids mean equal kvfabric keys. ``--keys`` also
writes each block's key in hex (field ``"keys"``). Output lines carry
``block_tokens``. Bad input lines raise :class:`TraceError` with the line
number (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..keys import KeyHasher, Namespace
from .traces import MAX_LINE_BYTES, Request, TraceError

MAX_PROMPT_TOKENS = 1 << 22


def bytes_tokenizer(text: str) -> list[int]:
    """One token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def make_tokenizer(spec: str) -> Callable[[str], list[int]]:
    """``bytes`` or ``hf:NAME``; ``ValueError`` for anything else or when transformers is missing."""
    if spec == "bytes":
        return bytes_tokenizer
    if spec.startswith("hf:") and len(spec) > 3:
        try:
            from transformers import AutoTokenizer  # type: ignore[import-not-found]
        except ImportError:
            raise ValueError("--tokenizer hf:NAME needs the transformers package") from None
        tok = AutoTokenizer.from_pretrained(spec[3:], local_files_only=True)
        return lambda text: list(tok.encode(text, add_special_tokens=False))
    raise ValueError(f"--tokenizer must be 'bytes' or 'hf:NAME', got {spec!r}")


def _tokens_of(obj: dict, tokenize: Callable[[str], list[int]], where: str) -> list[int]:
    for name in ("token_ids", "tokens"):
        if name in obj:
            toks = obj[name]
            if not isinstance(toks, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in toks
            ):
                raise TraceError(f"{where}: {name} must be a list of ints in [0, 2**32)")
            return toks
    for name in ("prompt", "text"):
        if name in obj:
            if not isinstance(obj[name], str):
                raise TraceError(f"{where}: {name} must be a string")
            return tokenize(obj[name])
    raise TraceError(f"{where}: needs one of token_ids, tokens, prompt, text")


def convert_records(
    records: Iterator[tuple[str, Any]],
    *,
    model: str,
    block_tokens: int,
    tokenize: Callable[[str], list[int]] = bytes_tokenizer,
    interval_ms: float = 1000.0,
    algorithm: str = "xxh3_128",
    keys_out: bool = False,
) -> Iterator[tuple[Request, list[bytes]]]:
    """Yield ``(request, block keys)`` for each ``(where, decoded JSON object)``; raises TraceError on bad input."""
    hasher = KeyHasher(algorithm)
    ids: dict[bytes, int] = {}
    namespaces: dict[str, Namespace] = {}
    for n, (where, obj) in enumerate(records):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        toks = _tokens_of(obj, tokenize, where)
        if len(toks) > MAX_PROMPT_TOKENS:
            raise TraceError(f"{where}: {len(toks)} tokens exceeds the limit of {MAX_PROMPT_TOKENS}")
        tenant = obj.get("tenant", "")
        if not isinstance(tenant, str):
            raise TraceError(f"{where}: tenant must be a string")
        ts = obj.get("timestamp", n * interval_ms)
        out_len = obj.get("output_length", 0)
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise TraceError(f"{where}: timestamp must be a non-negative number")
        if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 0:
            raise TraceError(f"{where}: output_length must be a non-negative int")
        ns = namespaces.get(tenant)
        if ns is None:
            ns = namespaces[tenant] = Namespace(model=model, block_tokens=block_tokens, tenant=tenant)
        keys = hasher.prefix_keys(ns, toks)
        hids = [ids.setdefault(k, len(ids)) for k in keys]
        yield Request(ts, len(toks), out_len, hids, tenant), (keys if keys_out else [])


def _read(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(line) > MAX_LINE_BYTES:
                raise TraceError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except ValueError as e:
                raise TraceError(f"{where}: not JSON: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench convert", description="Prompt log (text or token ids) -> trace.")
    p.add_argument("input", help="JSON lines with token_ids/tokens or prompt/text per request")
    p.add_argument("--out", required=True, help="trace file to write")
    p.add_argument("--model", default="unknown-model", help="model id for the key namespace")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--tokenizer", default="bytes", help="bytes (default) or hf:NAME")
    p.add_argument("--interval-ms", type=float, default=1000.0, help="spacing of lines without a timestamp")
    p.add_argument("--keys", action="store_true", help="also write each block's kvfabric key (hex)")
    args = p.parse_args(argv)
    try:
        if not 1 <= args.block_tokens <= 1 << 20:
            raise ValueError(f"--block-tokens must be in 1..{1 << 20}")
        tokenize = make_tokenizer(args.tokenizer)
        out = Path(args.out)
        tmp = Path(str(out) + ".tmp")
        n = 0
        with open(tmp, "w", encoding="utf-8") as f:
            for req, keys in convert_records(_read(Path(args.input)), model=args.model, block_tokens=args.block_tokens,
                                             tokenize=tokenize, interval_ms=args.interval_ms, keys_out=args.keys):
                obj = req.to_json(args.block_tokens)
                if args.keys:
                    obj["keys"] = [k.hex() for k in keys]
                f.write(json.dumps(obj, separators=(",", ":")) + "\n")
                n += 1
        tmp.replace(out)
    except (TraceError, ValueError, OSError) as e:
        print(f"kvfabric bench convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} requests to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
