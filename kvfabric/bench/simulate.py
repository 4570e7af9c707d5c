"""Offline replay of a trace through the pool server's own eviction policies.

This models, operation for operation, what ``kvfabric bench replay`` makes
real servers do, using the same policy classes
(:func:`kvfabric.server.eviction.make_policy`) and the same sharding
(:func:`kvfabric.sharding.owners`), so its hit counts equal the real replay's
exists-level counts for the same trace, capacity, servers and key salt (the
integration test checks that request by request). Per request:

1. LOOKUP: the client sends each shard its keys in prompt order; the shard
   counts how many of them it holds from the start and calls
   ``policy.on_access`` on each of those (``Store.lookup``). The prefix run
   ends at the earliest first-missing key over the shards.
2. GET of the ``run`` leading keys: ``on_access`` on each (``Store.acquire``).
3. PUT of the keys from ``run`` on, each with its ``parent`` (the previous
   block's key): a key the shard already holds is a no-op (status EXISTS, no
   policy call); otherwise the shard evicts (``policy.evict``) until one more
   block fits, then ``on_insert(key, size, parent)`` (``Store.begin_put`` /
   ``commit_put``).

With ``chunks=True`` (the *prefix+chunk* key mode, a trace with ``chunks``)
the request also does what a blending engine's client does, in this order:
after the prefix LOOKUP, one EXISTS of every passage's chunk keys
(:func:`kvfabric.bench.traces.chunk_block_keys`; EXISTS does not touch the
policy, and a passage's hit is the leading run of its keys that exist);
after the prefix GET, one
GET of the chunk hits beyond the prefix hit
(:func:`kvfabric.bench.belady.chunk_hit_blocks`); after the prefix PUT, a PUT
of every passage's missing chunk blocks, each with its parent (the previous
block of the same passage). The chunk level is counted with
:class:`kvfabric.bench.belady.ChunkCount`.

With ``ssd_blocks_per_shard > 0`` each shard has a second level, an SSD
log below the DRAM arena (:class:`kvfabric.bench._tiers.TieredShard`: write
behind on eviction, admission ``all`` or ``hit``, promotion on GET), and the
result carries hits per tier and the useful level for given read times per
block (:class:`kvfabric.bench._tiers.TierCount`).

Capacity is counted in blocks per shard. Every block has the same byte size
(partial last blocks are stored at full size, as a paged engine allocates
them), so ``blocks_per_shard`` blocks of ``block_bytes`` fill an arena of
``blocks_per_shard * pages_for(block_bytes) * 4096`` bytes exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..server.eviction import POLICIES, make_policy
from ..sharding import owners
from .belady import CHUNK_ID_BASE, ChunkCount, HitCount, belady, chunk_hit_blocks, infinite
from ._tiers import ADMIT_RULES, TierCount, TieredShard
from .traces import Trace, TraceError, block_keys, chunk_block_keys, load_trace


def shard_capacity(trace: Trace, fraction: float, shards: int) -> int:
    """Blocks per shard for a total of ``fraction`` x the trace's unique blocks (at least 1)."""
    if not 0 < fraction <= 10:  # also refuses inf and nan
        raise ValueError(f"capacity is a fraction of unique blocks in (0, 10], got {fraction!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards!r}")
    return max(1, int(fraction * trace.unique_blocks) // shards)


def default_servers(n: int) -> list[str]:
    """Stand-in server ids for a simulation that is not compared with specific real servers."""
    return [f"sim-{i}:0" for i in range(n)]


@dataclass
class SimResult:
    policy: str
    blocks_per_shard: int
    shards: int
    hits: HitCount
    evictions: int
    chunk_hits: ChunkCount | None = None
    ssd_blocks_per_shard: int = 0
    admit: str | None = None
    tiers: TierCount | None = None
    tier_counters: dict[str, int] | None = None

    def as_dict(self) -> dict:
        out = {"policy": self.policy, "blocks_per_shard": self.blocks_per_shard, "shards": self.shards,
               "capacity_blocks": self.blocks_per_shard * self.shards, "evictions": self.evictions}
        out.update(self.hits.as_dict())
        if self.chunk_hits is not None:
            out["chunk"] = self.chunk_hits.as_dict()
        if self.tiers is not None:
            out.update(ssd_blocks_per_shard=self.ssd_blocks_per_shard, ssd_capacity_blocks=self.ssd_blocks_per_shard
                       * self.shards, admit=self.admit, tiers=self.tiers.as_dict(), tier_counters=self.tier_counters)
        return out


class _Shard:
    __slots__ = ("policy", "held", "capacity", "evictions")
    last_promoted: frozenset = frozenset()  # one level: a LOOKUP never promotes

    def __init__(self, policy: str, capacity: int, kwargs: dict) -> None:
        self.policy = make_policy(policy, **kwargs)
        self.held: set[bytes] = set()
        self.capacity = capacity
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.held

    def get(self, key: bytes, parent: bytes | None) -> str:
        """GET of a held block touches the policy; ``"dram"`` (the one level there is), ``"miss"`` if not held."""
        if key not in self.held:
            return "miss"
        self.policy.on_access(key)
        return "dram"

    def lookup(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
            self.policy.on_access(k)
        return n

    def put(self, key: bytes, parent: bytes | None) -> None:
        if key in self.held:
            return
        while len(self.held) >= self.capacity:
            victim = self.policy.evict(_never_pinned)
            if victim is None or victim not in self.held:
                raise RuntimeError(f"policy {self.policy.name!r} returned {victim!r} from evict")
            self.held.discard(victim)
            self.evictions += 1
        self.held.add(key)
        self.policy.on_insert(key, 1, parent)


def _never_pinned(key: bytes) -> bool:
    return False


def simulate(
    trace: Trace,
    policy: str,
    blocks_per_shard: int,
    servers: Sequence[str] | None = None,
    *,
    salt: int = 0,
    policy_kwargs: dict | None = None,
    progress: Callable[[int], None] | None = None,
    chunks: bool = False,
    ssd_blocks_per_shard: int = 0,
    admit: str = "all",
    ssd_segment_blocks: int = 0,
    ssd_read_us: float | None = None,
    dram_read_us: float = 0.0,
    prefill_tokens_per_s: float = 8000.0,
) -> SimResult:
    """Replay ``trace`` offline through ``policy`` on ``len(servers)`` shards of ``blocks_per_shard`` blocks.

    ``servers`` are the ``host:port`` ids used for sharding (one stand-in
    shard when None); ``salt`` is the key salt of :func:`block_keys`;
    ``chunks`` selects the prefix+chunk key mode. ``ssd_blocks_per_shard``
    > 0 adds the SSD log below each shard's DRAM (admission ``admit``,
    segments of ``ssd_segment_blocks`` records, 0: one record at a time); the
    result's ``tiers`` then splits the hits per tier and, when
    ``ssd_read_us`` (read time of one block from SSD, microseconds) is given,
    counts the useful level against ``prefill_tokens_per_s``. Raises
    ``ValueError`` for an unknown policy or admission rule or a capacity
    below one block.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; known: {sorted(POLICIES)}")
    if blocks_per_shard < 1:
        raise ValueError(f"blocks_per_shard must be >= 1, got {blocks_per_shard}")
    if ssd_blocks_per_shard < 0 or admit not in ADMIT_RULES:
        raise ValueError(f"ssd_blocks_per_shard must be >= 0 and admit one of {ADMIT_RULES}")
    servers = list(servers) if servers else default_servers(1)
    tiered = ssd_blocks_per_shard > 0
    shards: list[_Shard] | list[TieredShard]
    if tiered:
        shards = [TieredShard(policy, blocks_per_shard, ssd_blocks_per_shard, admit, policy_kwargs, ssd_segment_blocks)
                  for _ in servers]
    else:
        shards = [_Shard(policy, blocks_per_shard, policy_kwargs or {}) for _ in servers]
    tiers = TierCount(ssd_read_us, dram_read_us, prefill_tokens_per_s) if tiered else None
    owner: dict[int, int] = {}

    def owned(ids: list[int], keys: list[bytes]) -> list[int]:
        own = []
        for h, k in zip(ids, keys):
            s = owner.get(h)
            if s is None:
                s = owner[h] = owners(k, servers)[0] if len(servers) > 1 else 0
            own.append(s)
        return own

    hits = HitCount()
    chunk_hits = ChunkCount() if chunks else None
    for i, r in enumerate(trace.requests):
        keys = block_keys(r.hash_ids, salt)
        own = owned(r.hash_ids, keys)
        run = _lookup(shards, keys, own)
        ckeys: list[list[bytes]] = []
        cown: list[list[int]] = []
        cruns: list[int] = []
        if chunks:
            for _, _, ids in r.chunks:
                ck = chunk_block_keys(ids, salt)
                ckeys.append(ck)
                cown.append(owned([CHUNK_ID_BASE + h for h in ids], ck))
                cruns.append(next((j for j, (k, s) in enumerate(zip(ck, cown[-1])) if k not in shards[s]),
                                  len(ck)))
        n_ssd = sum(1 for k, s in zip(keys[:run], own[:run]) if k in shards[s].last_promoted)  # read by LOOKUP
        for j in range(run):  # GET hits: touch in DRAM, or read from SSD and promote
            n_ssd += shards[own[j]].get(keys[j], keys[j - 1] if j else None) == "ssd"
        if chunks:
            for c, j, _ in chunk_hit_blocks(r, trace.block_tokens, run, cruns):  # GET of a chunk hit
                shards[cown[c][j]].get(ckeys[c][j], ckeys[c][j - 1] if j else None)
        for j in range(run, len(keys)):
            shards[own[j]].put(keys[j], keys[j - 1] if j else None)
        hits.add(trace, i, run)
        if tiers is not None:
            tiers.add(trace, i, run, n_ssd)
        if chunk_hits is not None:
            for c, ck in enumerate(ckeys):
                for j in range(cruns[c], len(ck)):
                    shards[cown[c][j]].put(ck[j], ck[j - 1] if j else None)
            chunk_hits.add(trace, i, run, cruns)
        if progress is not None:
            progress(1)
    counters = None
    if tiered:
        counters = {}
        for sh in shards:
            for k, v in sh.counters().items():  # type: ignore[union-attr]
                counters[k] = counters.get(k, 0) + v
    return SimResult(policy, blocks_per_shard, len(servers), hits, sum(s.evictions for s in shards), chunk_hits,
                     ssd_blocks_per_shard if tiered else 0, admit if tiered else None, tiers, counters)


def _lookup(shards: list[_Shard], keys: list[bytes], own: list[int]) -> int:
    groups: dict[int, list[int]] = {}
    for j, s in enumerate(own):
        groups.setdefault(s, []).append(j)
    run = len(keys)
    for s, idx in groups.items():
        n = shards[s].lookup([keys[j] for j in idx])
        if n < len(idx):
            run = min(run, idx[n])
    return run


def gap_closed(policy_rate: float, lru_rate: float, bound_rate: float) -> float | None:
    """Fraction of the LRU-to-bound gap a policy closes (None when there is no gap)."""
    gap = bound_rate - lru_rate
    if gap <= 1e-12:
        return None
    return (policy_rate - lru_rate) / gap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench simulate",
                                description="Offline hit rates of the server's eviction policies, Belady and infinite.")
    p.add_argument("trace", help="trace file or bundled name (mooncake-conversation, mooncake-synthetic)")
    p.add_argument("--capacity", "--dram-capacity", dest="capacity", type=float, action="append",
                   help="(DRAM) fraction of unique blocks (repeatable; default 0.05 and 0.1)")
    p.add_argument("--ssd-capacity", type=float, default=0.0,
                   help="also simulate an SSD log of this fraction of unique blocks below DRAM (default 0: none)")
    p.add_argument("--ssd-admit", action="append", choices=ADMIT_RULES, help="SSD admission, repeatable (default all)")
    p.add_argument("--ssd-read-us", type=float, default=None,
                   help="read time of one block from SSD in us, for the tiered useful level (e.g. the ssd_read_us "
                        "of a tiered replay); with --prefill-tokens-per-s (default 8000)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=8000.0)
    p.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable; default all")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--block-tokens", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    try:
        trace = load_trace(args.trace, args.block_tokens, args.limit)
        caps = args.capacity or [0.05, 0.1]
        pols = args.policy or list(POLICIES)
        servers = default_servers(args.shards)
        inf = infinite(trace)
        rows = []
        for frac in caps:
            per = shard_capacity(trace, frac, args.shards)
            bound = belady(trace, per * args.shards)
            res = {pol: simulate(trace, pol, per, servers) for pol in pols}
            lru = res["lru"].hits.block_hit_rate if "lru" in res else None
            if args.ssd_capacity:
                ssd = shard_capacity(trace, args.ssd_capacity, args.shards)
                for pol in pols:
                    for admit in args.ssd_admit or ["all"]:
                        res[f"{pol}/ssd-{admit}"] = simulate(
                            trace, pol, per, servers, ssd_blocks_per_shard=ssd, admit=admit,
                            ssd_read_us=args.ssd_read_us, prefill_tokens_per_s=args.prefill_tokens_per_s)
            for pol, r in res.items():
                row = r.as_dict() | {"capacity_fraction": frac, "belady": bound.block_hit_rate,
                                     "infinite": inf.block_hit_rate, "policy": pol}
                row["gap_closed"] = gap_closed(r.hits.block_hit_rate, lru, bound.block_hit_rate) if lru is not None else None
                rows.append(row)
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench simulate: {e}", file=sys.stderr)
        return 2
    print(f"{trace.name}: {len(trace)} requests, {trace.total_blocks} blocks, {trace.unique_blocks} unique, "
          f"{args.shards} shard(s)")
    tiered = any("tiers" in row for row in rows)
    extra = f" {'/inf':>6} {'dram':>6} {'ssd':>6} {'useful':>7}" if tiered else ""
    print(f"{'capacity':>9} {'policy':>15} {'hit':>7} {'belady':>7} {'infinite':>8} {'gap closed':>10}{extra}")
    for row in rows:
        g = row["gap_closed"]
        line = (f"{row['capacity_fraction']:>9.1%} {row['policy']:>15} {row['block_hit_rate']:>7.1%} "
                f"{row['belady']:>7.1%} {row['infinite']:>8.1%} {'-' if g is None else f'{g:.0%}':>10}")
        if tiered:
            t = row.get("tiers")
            rel = row["block_hit_rate"] / row["infinite"] if row["infinite"] else 0.0
            use = (t or {}).get("useful", {}).get("block_hit_rate")
            line += (f" {rel:>6.1%} {t['dram_block_hit_rate']:>6.1%} {t['ssd_block_hit_rate']:>6.1%} "
                     f"{'-' if use is None else f'{use:.1%}':>7}" if t else f" {rel:>6.1%}")
        print(line)
    if tiered:
        print(f"/ssd-RULE rows: DRAM at the capacity + an SSD log of {args.ssd_capacity:.0%} of unique blocks; "
              f"gap closed and belady are for DRAM alone; /inf = hit over infinite capacity")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": trace.name, "shards": args.shards, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
