"""A RAG workload generator that writes the Mooncake trace format.

Model
-----
A corpus of ``docs`` documents whose lengths (tokens) are log-normal
(``doc_tokens_mean``, ``doc_tokens_sigma``), clipped to
``[doc_tokens_min, doc_tokens_max]``. Each tenant ranks the corpus by its own
random permutation and retrieves with Zipf(``zipf``) popularity over that
ranking: a query draws ``top_k`` distinct documents, and they appear in the
prompt in the order drawn (retrieval order, most relevant first).

A new conversation's prompt is::

    system prompt template (one of ``templates`` per tenant)
    + doc_1 + ... + doc_k + question

With probability ``followup_prob`` a conversation gets a follow-up turn
``followup_delay_s`` (exponential mean) later, up to ``max_turns`` turns; a
follow-up's prompt is the previous prompt + the previous answer + a new
question, so it shares the whole previous prompt as a prefix. New
conversations arrive as a Poisson process at ``rate`` per second.

Block ids follow the trace format's rule, equal id = equal content including
the whole prefix: the prompt is a list of segments (template, document,
question, answer), block ``i`` is the tuple of segment pieces covering tokens
``[iB, (i+1)B)``, and its id is interned from ``(id of block i-1, pieces)``;
the first block's parent is the tenant, so tenants never share blocks (the
tenant is part of the key namespace). The last block may be partial, as in
Mooncake's traces. Each document in a prompt is also written as a chunk
(the trace's ``chunks`` field: start token, length, position-independent
chunk ids cut from the document's start, per tenant), so the chunk level of
``kvfabric bench replay --key-mode chunk`` works on generated traces too.
Everything is drawn from one ``random.Random(seed)`` and
one numpy generator seeded from it: the same flags give the same file.

Run ``kvfabric bench ragtrace --out rag.jsonl [flags]``; ``--help`` lists
every parameter. ``--preset musique`` sets the parameters measured on the
bundled real workload (``data/rag/musique``, :mod:`kvfabric.bench.ragdata`):
one tenant and template of 47 tokens, top-10 passages of ~624 tokens
(sigma 0.056), 43-token questions, 32-token answers, no follow-ups, and a
uniform pick over 4000 documents, which repeats 16.3% of the retrieved
passages over 150 questions as MuSiQue does (explicit flags override it).
Bad parameters raise ``ValueError`` (exit status 2 from the command line).

:func:`workload_shares` measures a trace (generated or not) for what its
prefix hit rate is made of: the share of requests that are follow-up turns
and how many points of the infinite-capacity prefix reuse they carry;
:func:`describe` names the generator's parameters in one line.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from .traces import Request, Trace, write_trace


@dataclass(frozen=True)
class RagConfig:
    requests: int = 3000
    seed: int = 0
    block_tokens: int = 256
    docs: int = 3000
    doc_tokens_mean: float = 700.0
    doc_tokens_sigma: float = 0.6
    doc_tokens_min: int = 64
    doc_tokens_max: int = 8192
    zipf: float = 1.0
    top_k: int = 4
    tenants: int = 2
    templates: int = 3
    template_tokens: int = 600
    question_tokens: float = 60.0
    output_tokens: float = 200.0
    followup_prob: float = 0.35
    max_turns: int = 4
    followup_delay_s: float = 60.0
    rate: float = 4.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first parameter out of range."""
        positive_ints = ("requests", "block_tokens", "docs", "doc_tokens_min", "doc_tokens_max", "top_k",
                         "tenants", "templates", "max_turns")
        for name in positive_ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("doc_tokens_mean", "question_tokens", "output_tokens", "followup_delay_s", "rate"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not (0 <= self.doc_tokens_sigma < 5):
            raise ValueError(f"doc_tokens_sigma must be in [0, 5), got {self.doc_tokens_sigma!r}")
        if not (0 <= self.zipf <= 5):
            raise ValueError(f"zipf must be in [0, 5], got {self.zipf!r}")
        if not (0 <= self.followup_prob <= 1):
            raise ValueError(f"followup_prob must be in [0, 1], got {self.followup_prob!r}")
        if self.top_k > self.docs:
            raise ValueError(f"top_k ({self.top_k}) exceeds the corpus size ({self.docs})")
        if self.doc_tokens_min > self.doc_tokens_max:
            raise ValueError("doc_tokens_min exceeds doc_tokens_max")
        if self.template_tokens < 0:
            raise ValueError(f"template_tokens must be >= 0, got {self.template_tokens!r}")
        if self.requests > 10_000_000:
            raise ValueError("requests is limited to 10 million")


class _Interner:
    """Maps (parent id, block content) to dense ids in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def __call__(self, parent: object, content: tuple) -> int:
        k = (parent, content)
        i = self._ids.get(k)
        if i is None:
            i = self._ids[k] = len(self._ids)
        return i

    def __len__(self) -> int:
        return len(self._ids)


# Parameters measured on the bundled MuSiQue traces (see the module doc).
PRESETS: dict[str, dict[str, object]] = {
    "musique": dict(requests=150, docs=4000, zipf=0.0, top_k=10, tenants=1, templates=1, template_tokens=47,
                    doc_tokens_mean=624.0, doc_tokens_sigma=0.056, doc_tokens_min=64, question_tokens=43.0,
                    output_tokens=32.0, followup_prob=0.0, block_tokens=16),
}


def doc_chunks(segments: list[tuple[object, int]], block_tokens: int, root: object,
               intern: _Interner) -> list[tuple[int, int, list[int]]]:
    """The ``chunks`` of a prompt: every ``("doc", d)`` segment with its position-independent block ids."""
    out = []
    off = 0
    for seg, n in segments:
        if isinstance(seg, tuple) and seg[0] == "doc":
            ids: list[int] = []
            parent: object = (root, seg)
            for j in range(-(-n // block_tokens)):
                parent = intern(parent, (j, min(block_tokens, n - j * block_tokens)))
                ids.append(parent)  # type: ignore[arg-type]
            out.append((off, n, ids))
        off += n
    return out


def block_ids(segments: list[tuple[object, int]], block_tokens: int, root: object, intern: _Interner) -> tuple[list[int], int]:
    """Ids of the (possibly partial) blocks of a prompt made of ``(segment id, tokens)`` pieces.

    Returns ``(ids, input_length)``. Block ``i``'s content is the tuple of
    ``(segment id, start, end)`` pieces it covers; its id is interned with
    the previous block's id (``root`` for the first) as parent.
    """
    ids: list[int] = []
    parent: object = root
    pieces: list[tuple[object, int, int]] = []
    room = block_tokens
    total = 0
    for seg, n in segments:
        off = 0
        total += n
        while off < n:
            take = min(room, n - off)
            pieces.append((seg, off, off + take))
            off += take
            room -= take
            if room == 0:
                parent = intern(parent, tuple(pieces))
                ids.append(parent)  # type: ignore[arg-type]
                pieces, room = [], block_tokens
    if pieces:
        ids.append(intern(parent, tuple(pieces)))
    return ids, total


def generate(cfg: RagConfig) -> Trace:
    """Build the trace; deterministic for a given config. Raises ``ValueError`` for bad parameters."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    nrng = np.random.default_rng(rng.getrandbits(64))
    lengths = np.exp(nrng.normal(math.log(cfg.doc_tokens_mean) - cfg.doc_tokens_sigma**2 / 2, cfg.doc_tokens_sigma, cfg.docs))
    doc_len = np.clip(np.rint(lengths), cfg.doc_tokens_min, cfg.doc_tokens_max).astype(int).tolist()
    # Zipf weights over ranks, one random rank -> document map per tenant.
    weights = 1.0 / np.arange(1, cfg.docs + 1, dtype=float) ** cfg.zipf
    cdf = np.cumsum(weights / weights.sum())
    rank_to_doc = [nrng.permutation(cfg.docs).tolist() for _ in range(cfg.tenants)]
    tmpl_len = [[max(1, int(round(cfg.template_tokens * rng.uniform(0.5, 1.5)))) if cfg.template_tokens else 0
                 for _ in range(cfg.templates)] for _ in range(cfg.tenants)]

    def retrieve(tenant: int) -> list[int]:
        picked: list[int] = []
        seen: set[int] = set()
        while len(picked) < cfg.top_k:
            for r in np.searchsorted(cdf, nrng.random(cfg.top_k * 2), side="right").tolist():
                d = rank_to_doc[tenant][min(r, cfg.docs - 1)]
                if d not in seen:
                    seen.add(d)
                    picked.append(d)
                    if len(picked) == cfg.top_k:
                        break
        return picked

    def draw_len(mean: float) -> int:
        return max(1, int(round(rng.expovariate(1.0 / mean))))

    intern = _Interner()
    cintern = _Interner()
    out: list[Request] = []
    # Events: (time_s, seq, session, turn, segments, tenant); seq keeps ties deterministic.
    events: list[tuple[float, int, int, int, list, int]] = []
    seq = 0
    t_new = 0.0
    sessions = 0
    while len(out) < cfg.requests:
        if not events or events[0][0] > t_new:
            tenant = rng.randrange(cfg.tenants)
            tmpl = rng.randrange(cfg.templates)
            segs: list[tuple[object, int]] = []
            if tmpl_len[tenant][tmpl]:
                segs.append((("sys", tenant, tmpl), tmpl_len[tenant][tmpl]))
            segs += [(("doc", d), doc_len[d]) for d in retrieve(tenant)]
            heapq.heappush(events, (t_new, seq, sessions, 1, segs, tenant))
            sessions += 1
            seq += 1
            t_new += rng.expovariate(cfg.rate)
            continue
        t, _, sess, turn, segs, tenant = heapq.heappop(events)
        segs = segs + [(("q", sess, turn), draw_len(cfg.question_tokens))]
        ids, n = block_ids(segs, cfg.block_tokens, ("tenant", tenant), intern)
        out_len = draw_len(cfg.output_tokens)
        chunks = doc_chunks(segs, cfg.block_tokens, ("tenant", tenant), cintern)
        out.append(Request(round(t * 1000.0, 3), n, out_len, ids, f"t{tenant}", f"s{sess}", chunks))
        if turn < cfg.max_turns and rng.random() < cfg.followup_prob:
            nxt = segs + [(("a", sess, turn), out_len)]
            heapq.heappush(events, (t + rng.expovariate(1.0 / cfg.followup_delay_s), seq, sess, turn + 1, nxt, tenant))
            seq += 1
    return Trace(out, cfg.block_tokens, f"rag-seed{cfg.seed}")


@dataclass(frozen=True)
class WorkloadShares:
    """What a trace's prefix reuse is made of; rates are shares of all prompt tokens (or requests)."""

    requests: int
    conversations: int
    #: requests after the first of their conversation (a request without a session is its own conversation)
    followups: int
    tenants: int
    #: prefix token hit rate with unbounded capacity (every block seen before is held)
    reuse_tokens: float
    #: the part of ``reuse_tokens`` that falls in follow-up turns (points of all prompt tokens)
    followup_reuse_tokens: float

    @property
    def followup_share(self) -> float:
        return self.followups / self.requests if self.requests else 0.0

    def line(self) -> str:
        """One line: follow-up share and the points of reuse they carry."""
        first = self.reuse_tokens - self.followup_reuse_tokens
        return (f"{self.requests} requests in {self.conversations} conversations, {self.tenants} tenant(s): "
                f"{self.followup_share:.1%} are follow-up turns; of the {self.reuse_tokens:.1%} prefix reuse at "
                f"infinite capacity (token-weighted) {self.followup_reuse_tokens * 100:.1f} points are in follow-up "
                f"turns, {first * 100:.1f} in first turns (shared templates and documents)")


def workload_shares(trace: Trace) -> WorkloadShares:
    """Measure ``trace``: follow-up turns (by tenant and session) and their part of the infinite prefix reuse."""
    seen_blocks: set[int] = set()
    seen_sessions: set[tuple[str, str]] = set()
    followups = hit = hit_followup = total = 0
    tenants: set[str] = set()
    bt = trace.block_tokens
    for i, r in enumerate(trace.requests):
        tenants.add(r.tenant)
        conv = (r.tenant, r.session) if r.session else ("", f"#{i}")
        later = conv in seen_sessions
        seen_sessions.add(conv)
        followups += later
        run = 0
        for h in r.hash_ids:
            if h not in seen_blocks:
                break
            run += 1
        tokens = sum(r.block_tokens(j, bt) for j in range(run))
        hit += tokens
        hit_followup += tokens if later else 0
        total += sum(r.block_tokens(j, bt) for j in range(len(r.hash_ids)))
        seen_blocks.update(r.hash_ids)
    n = len(trace.requests)
    return WorkloadShares(requests=n, conversations=n - followups, followups=followups, tenants=len(tenants),
                          reuse_tokens=hit / total if total else 0.0,
                          followup_reuse_tokens=hit_followup / total if total else 0.0)


def describe(cfg: RagConfig) -> str:
    """The generator's parameters that set the reuse, in one line."""
    return (f"generator: {cfg.tenants} tenant(s) x {cfg.templates} system template(s) of ~{cfg.template_tokens} "
            f"tokens, {cfg.docs} documents (~{cfg.doc_tokens_mean:g} tokens), top-{cfg.top_k} retrieval with "
            f"Zipf({cfg.zipf:g}) popularity, follow-up probability {cfg.followup_prob:g} up to {cfg.max_turns} "
            f"turns, seed {cfg.seed}")


def add_arguments(p: argparse.ArgumentParser, block_tokens: bool = True) -> None:
    """One ``--flag`` per :class:`RagConfig` field (``--doc-tokens-mean`` etc.), defaults shown in --help, and ``--preset``."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="start from parameters measured on a real workload (musique); explicit flags override")
    for f in fields(RagConfig):
        if f.name == "block_tokens" and not block_tokens:
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                       help=f"(default {f.default})")


def config_from_args(args: argparse.Namespace) -> RagConfig:
    """Defaults, then ``--preset``, then explicit flags."""
    kw: dict[str, object] = {f.name: f.default for f in fields(RagConfig)}
    if getattr(args, "preset", None):
        kw.update(PRESETS[args.preset])
    for f in fields(RagConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            kw[f.name] = v
    return RagConfig(**kw)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench ragtrace", description="Write a synthetic RAG trace (JSON lines).")
    p.add_argument("--out", required=True, help="trace file to write")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
        trace = generate(cfg)
    except ValueError as e:
        print(f"kvfabric bench ragtrace: {e}", file=sys.stderr)
        return 2
    write_trace(Path(args.out), trace.requests, cfg.block_tokens)
    print(f"wrote {len(trace)} requests, {trace.total_blocks} block accesses, {trace.unique_blocks} unique blocks "
          f"(block_tokens={cfg.block_tokens}) to {args.out}; config {asdict(cfg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
