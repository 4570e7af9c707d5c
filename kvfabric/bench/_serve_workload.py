"""The serving benchmark's workload: trace requests turned into token ids an engine can prefill.

A Mooncake-format trace (:mod:`kvfabric.bench.traces`) says, per request,
its arrival time, its prompt as a chain of block ids (512 tokens each) and
its output length. An engine needs token ids, so:

* **sessions**: the head of a Mooncake trace holds almost no reuse (its
  reuse spreads over hours), so the benchmark keeps whole *sessions*: the
  requests that share their first two block ids (a system prompt and the
  first turn of one conversation or agent run), drawn with a seed, every
  request of a drawn session in timestamp order. The trace's own reuse
  inside those sessions is kept exactly.
* **scale**: each trace block becomes ``block_tokens`` engine tokens
  (``scale = block_tokens / trace block``); a prompt is
  ``ceil(input_length * scale)`` tokens, an output ``max(1,
  round(output_length * output_scale))`` tokens (``output_scale`` defaults
  to ``scale``). A prompt that would not fit ``max_model_len`` with its
  output is cut to whole blocks that do (counted: ``truncated``).
* **tokens**: block id ``h`` always gives the same ``block_tokens`` token
  ids (drawn from a generator seeded by ``h`` and the ``epoch``), a partial
  last block their first tokens, so equal ids give equal token blocks and the
  reuse the engines see is the trace's. A different ``epoch`` gives
  different tokens for the same ids: every load level of a run starts with
  cold caches everywhere (vLLM's, the pool's, an offload tier's) without
  restarting anything.
* **arrivals**: ``arrival_s`` is the trace's timestamp (from the first kept
  request) over ``speedup``; a closed loop ignores it.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from .traces import Request, Trace

# Token ids drawn for synthetic prompts: the tiny Llama's regular vocabulary
# (ids below 8 are its special tokens).
VOCAB_LO = 8


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One request as the load generator sends it."""

    index: int
    session: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    prompt_len: int
    max_tokens: int

    def tokens(self, block_tokens: int, vocab: int, epoch: int) -> list[int]:
        """The prompt's token ids (see the module docstring); deterministic in (ids, epoch)."""
        out: list[int] = []
        for h in self.hash_ids:
            rng = random.Random((epoch << 64) ^ h)
            out.extend(rng.randrange(VOCAB_LO, vocab - VOCAB_LO) for _ in range(block_tokens))
        return out[:self.prompt_len]


@dataclass(frozen=True, slots=True)
class Workload:
    """What a run replays, and how it was cut from the trace (all of it goes in the report)."""

    trace: str
    requests: tuple[ServeRequest, ...]
    sessions: int
    trace_block_tokens: int
    block_tokens: int
    output_scale: float
    max_model_len: int
    truncated: int
    speedup: float

    @property
    def scale(self) -> float:
        return self.block_tokens / self.trace_block_tokens

    def reusable_tokens(self, chunk_tokens: int) -> int:
        """Prompt tokens a cache of infinite capacity could serve, the requests taken in this order: per request,
        the longest prefix of blocks an earlier request had, cut to whole chunks of ``chunk_tokens`` (what
        vLLM's prefix cache and the connector reuse) and short of the prompt's last token (vLLM computes it
        whatever it holds)."""
        seen: set[int] = set()
        out = 0
        for r in self.requests:
            lead = 0
            while lead < len(r.hash_ids) and r.hash_ids[lead] in seen:
                lead += 1
            tokens = min(lead * self.block_tokens, r.prompt_len - 1)
            out += max(0, tokens) // chunk_tokens * chunk_tokens
            seen.update(r.hash_ids)
        return out

    def describe(self) -> dict:
        """The figures the report prints beside the table: sizes, scale, reuse an infinite cache sees."""
        seen: set[int] = set()
        hit = total = 0
        for r in self.requests:
            for h in r.hash_ids:
                total += 1
                hit += h in seen
                seen.add(h)
        n = len(self.requests)
        return {"trace": self.trace, "requests": n, "sessions": self.sessions,
                "trace_block_tokens": self.trace_block_tokens, "block_tokens": self.block_tokens,
                "scale": self.scale, "output_scale": self.output_scale, "max_model_len": self.max_model_len,
                "truncated": self.truncated, "speedup": self.speedup,
                "prompt_tokens": sum(r.prompt_len for r in self.requests),
                "output_tokens": sum(r.max_tokens for r in self.requests),
                "mean_prompt_tokens": sum(r.prompt_len for r in self.requests) / max(1, n),
                "max_prompt_tokens": max((r.prompt_len for r in self.requests), default=0),
                "unique_blocks": len(seen), "infinite_block_hit_rate": hit / max(1, total),
                "span_s": self.requests[-1].arrival_s if self.requests else 0.0}


def sample_sessions(trace: Trace, sessions: int, seed: int) -> list[list[Request]]:
    """``sessions`` sessions of ``trace`` with more than one request (fewer if it has fewer), each in
    timestamp order; a session is the requests sharing their first two block ids. Raises ValueError
    when the trace has no session of two requests."""
    groups: dict[tuple[int, ...], list[Request]] = defaultdict(list)
    for r in trace.requests:
        if len(r.hash_ids) >= 2:
            groups[tuple(r.hash_ids[:2])].append(r)
    multi = sorted(k for k, v in groups.items() if len(v) > 1)
    if not multi:
        raise ValueError(f"{trace.name}: no two requests share their first two blocks; nothing to replay "
                         f"as sessions")
    keys = random.Random(seed).sample(multi, min(sessions, len(multi)))
    return [groups[k] for k in keys]


def build_workload(trace: Trace, *, sessions: int, seed: int, block_tokens: int, max_model_len: int,
                   output_scale: float | None = None, speedup: float = 1.0, max_requests: int | None = None,
                   no_reuse: bool = False) -> Workload:
    """Cut a :class:`Workload` out of ``trace`` (see the module docstring); ValueError on bad sizes.
    ``no_reuse``: the same requests (sizes, sessions, arrivals), every block of every prompt given an id of
    its own, so no two prompts share a token block (the control for routing: nothing to gain)."""
    if block_tokens < 1 or max_model_len <= block_tokens or sessions < 1 or speedup <= 0:
        raise ValueError(f"need block_tokens >= 1, max_model_len > block_tokens, sessions >= 1, speedup > 0 "
                         f"(got {block_tokens}, {max_model_len}, {sessions}, {speedup})")
    scale = block_tokens / trace.block_tokens
    oscale = scale if output_scale is None else output_scale
    if oscale <= 0:
        raise ValueError(f"output_scale must be > 0, got {oscale}")
    picked = sorted((r for s in sample_sessions(trace, sessions, seed) for r in s), key=lambda r: r.timestamp)
    # the session index is its first request's order, so session 0 arrives first
    first: dict[tuple[int, ...], int] = {}
    for r in picked:
        first.setdefault(tuple(r.hash_ids[:2]), len(first))
    if max_requests is not None:
        picked = picked[:max_requests]
    t0 = picked[0].timestamp
    out: list[ServeRequest] = []
    truncated = 0
    for r in picked:
        max_tokens = max(1, round(r.output_length * oscale))
        if max_tokens >= max_model_len - block_tokens:
            raise ValueError(f"an output of {max_tokens} tokens leaves no room for a prompt in max_model_len "
                             f"{max_model_len}; lower output_scale")
        prompt_len = max(1, -(-r.input_length * block_tokens // trace.block_tokens))
        ids = list(r.hash_ids)
        if prompt_len + max_tokens > max_model_len:
            blocks = (max_model_len - max_tokens) // block_tokens
            prompt_len, ids = blocks * block_tokens, ids[:blocks]
            truncated += 1
        prompt_len = min(prompt_len, len(ids) * block_tokens)
        if no_reuse:                   # ids above the trace's: unique per (request, block)
            ids = [(1 << 40) + (len(out) << 20) + b for b in range(len(ids))]
        out.append(ServeRequest(len(out), first[tuple(r.hash_ids[:2])], (r.timestamp - t0) / 1000.0 / speedup,
                                tuple(ids), prompt_len, max_tokens))
    return Workload(trace.name, tuple(out), len(first), trace.block_tokens, block_tokens, oscale, max_model_len,
                    truncated, speedup)


__all__ = ["ServeRequest", "Workload", "build_workload", "sample_sessions"]
