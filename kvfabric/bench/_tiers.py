"""The two-level pool shard of the offline simulator: a DRAM arena under an eviction policy, an SSD log below.

This models the SSD tier of ``kvfabric serve --ssd-path DIR --ssd-capacity
SIZE [--ssd-admit all|hit]`` (issue 11; csrc/kvf_tier*.c) operation for
operation, so that :func:`kvfabric.bench.simulate.simulate` can report hit
rates per tier and a replay against real tiered servers can be checked
against it. The model:

* **DRAM** holds at most ``dram_capacity`` blocks under the server's own
  eviction policy class (the same one the one-level simulator uses).
* **SSD** is a circular log of ``ssd_capacity`` records. A block evicted
  from DRAM is written behind to the log if admitted; a block whose record is
  still on the log is not written again (the server counts that as an admit
  skip too). With ``segment_blocks`` > 0 the log is made of segments of that
  many records and the head entering a segment drops every record in it (the
  server's layout: about 16 segments per file); with 0 it drops one record
  at a time. Either way a log forgets in write order, whatever the
  popularity.
* **Admission** (``--ssd-admit``): ``all`` writes every evicted block;
  ``hit`` only blocks read by a GET since they last entered DRAM.
* **LOOKUP** (the server's ``kvf_tier_park``): the leading run of keys held
  in DRAM or on SSD is found first; its SSD keys are **promoted** (a DRAM
  slot reserved for each, evicting as a PUT does, the victims going to the
  log in turn; then each inserted into the policy without a parent); then
  the LOOKUP runs again on DRAM alone, touching the policy for each key of
  its leading run, which is the answer. A victim of the promotions that was
  part of the run ends the run there, as on the server. One request promotes
  at most ``promote_max`` blocks (the server's default: a quarter of the
  arena); the run ends at the first SSD key beyond that.
* **GET** of a DRAM block touches the policy (and counts a hit for
  admission); of a block only on SSD promotes it first, then the same.
* **PUT** is the DRAM's alone: a block in DRAM is a no-op; a block only on
  SSD is stored into DRAM again (the server's PUT does not consult the tier;
  the log keeps its record).
* **EXISTS** (``in``) counts both tiers.

What the model leaves out, on purpose: time. On the server the write-behind
is asynchronous (a block is on the log only once its write finished, and a
full write queue drops it: ``ssd_write_drops``), so a block evicted and asked
for again at once can miss there and hit here. A replay through real servers
reports its own ``ssd_*`` counters beside the model's, so a difference shows.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..server.eviction import make_policy
from .belady import HitCount
from .traces import Trace

ADMIT_RULES = ("all", "hit")


def _never_pinned(key: bytes) -> bool:
    return False


class TieredShard:
    """One pool server with a DRAM arena of ``dram_capacity`` blocks and an SSD log of ``ssd_capacity`` blocks."""

    __slots__ = ("policy", "dram", "ssd", "hit", "capacity", "ssd_capacity", "segment", "wpos", "admit",
                 "evictions", "ssd_writes", "ssd_overwrites", "ssd_admit_skips", "ssd_hits", "ssd_misses",
                 "promotions", "last_promoted", "promote_max", "self_evictions")

    def __init__(self, policy: str, dram_capacity: int, ssd_capacity: int, admit: str = "all",
                 kwargs: dict | None = None, segment_blocks: int = 0, promote_max: int | None = None) -> None:
        if dram_capacity < 1:
            raise ValueError(f"dram capacity must be >= 1 block, got {dram_capacity}")
        if ssd_capacity < 0 or segment_blocks < 0 or (segment_blocks and ssd_capacity % segment_blocks):
            raise ValueError(f"ssd capacity ({ssd_capacity}) must be >= 0 and a multiple of segment_blocks "
                             f"({segment_blocks})")
        if admit not in ADMIT_RULES:
            raise ValueError(f"admission rule must be one of {ADMIT_RULES}, got {admit!r}")
        self.policy = make_policy(policy, **(kwargs or {}))
        self.dram: set[bytes] = set()
        self.ssd: OrderedDict[bytes, int] = OrderedDict()  # key -> write position, oldest first
        self.hit: set[bytes] = set()  # DRAM blocks read by a GET since they entered DRAM (admission "hit")
        self.capacity, self.ssd_capacity, self.admit = dram_capacity, ssd_capacity, admit
        self.segment = segment_blocks or 1
        self.wpos = 0
        self.evictions = self.ssd_writes = self.ssd_overwrites = self.ssd_admit_skips = 0
        self.ssd_hits = self.ssd_misses = self.promotions = 0
        self.self_evictions = 0  # DRAM blocks of a LOOKUP's own run evicted by that LOOKUP's promotions
        self.last_promoted: set[bytes] = set()  # keys the last lookup() promoted from SSD
        self.promote_max = max(1, dram_capacity // 4) if promote_max is None else promote_max

    def __contains__(self, key: bytes) -> bool:
        return key in self.dram or key in self.ssd

    def lookup(self, keys: list[bytes]) -> int:
        """LOOKUP: promote the SSD keys of the leading run held anywhere, then the leading run in DRAM (touched)."""
        todo, mine = [], []
        for k in keys:
            if k in self.dram:
                mine.append(k)
                continue
            if k not in self.ssd or len(todo) >= self.promote_max:
                break
            todo.append(k)
        self.last_promoted = self._promote(todo)
        if todo:
            self.self_evictions += sum(1 for k in mine if k not in self.dram)
        n = 0
        for k in keys:
            if k not in self.dram:
                break
            self.policy.on_access(k)
            n += 1
        return n

    def get(self, key: bytes, parent: bytes | None) -> str:
        """GET: ``"dram"`` (touch), ``"ssd"`` (read from the log, promote, touch) or ``"miss"``."""
        where = "dram"
        if key not in self.dram:
            if key not in self.ssd or not self._promote([key]):
                return "miss"
            where = "ssd"
        self.policy.on_access(key)
        self.hit.add(key)
        return where

    def put(self, key: bytes, parent: bytes | None) -> None:
        """PUT: a no-op for a block in DRAM, else stored into DRAM (spilling victims to the log)."""
        if key in self.dram:
            return
        self._make_room(1)
        self.dram.add(key)
        self.policy.on_insert(key, 1, parent)

    def _promote(self, keys: list[bytes]) -> set[bytes]:
        """Reserve a DRAM slot per key (evicting; none left: the rest miss), then commit those still on the log."""
        reserved: list[bytes] = []
        for k in keys:
            self._make_room(len(reserved) + 1)
            if len(self.dram) + len(reserved) + 1 > self.capacity:
                break  # every slot is reserved by this request: the server answers the rest as misses
            reserved.append(k)
        self.ssd_misses += len(keys) - len(reserved)
        done = set()
        for k in reserved:
            if k in self.ssd and k not in self.dram:  # its record may have been overwritten meanwhile
                self.dram.add(k)
                self.policy.on_insert(k, 1, None)
                self.hit.discard(k)
                done.add(k)
                self.ssd_hits += 1
                self.promotions += 1
            else:
                self.ssd_misses += 1
        return done

    def _make_room(self, n: int) -> None:
        while len(self.dram) + n > self.capacity and self.dram:
            victim = self.policy.evict(_never_pinned)
            if victim is None or victim not in self.dram:
                raise RuntimeError(f"policy {self.policy.name!r} returned {victim!r} from evict")
            self.dram.discard(victim)
            self.evictions += 1
            self._spill(victim)

    def _spill(self, key: bytes) -> None:
        was_hit = key in self.hit
        self.hit.discard(key)
        if self.ssd_capacity == 0:
            return
        if key in self.ssd or (self.admit == "hit" and not was_hit):
            self.ssd_admit_skips += 1
            return
        if self.wpos >= self.ssd_capacity and self.wpos % self.segment == 0:
            # the head enters a segment written one lap ago: every record in it goes
            oldest = self.wpos - self.ssd_capacity + self.segment
            while self.ssd and next(iter(self.ssd.values())) < oldest:
                self.ssd.popitem(last=False)
                self.ssd_overwrites += 1
        self.ssd[key] = self.wpos
        self.wpos += 1
        self.ssd_writes += 1

    def counters(self) -> dict[str, int]:
        return {"dram_objects": len(self.dram), "ssd_objects": len(self.ssd), "evictions": self.evictions,
                "ssd_writes": self.ssd_writes, "ssd_overwrites": self.ssd_overwrites,
                "ssd_admit_skips": self.ssd_admit_skips, "ssd_hits": self.ssd_hits, "ssd_misses": self.ssd_misses,
                "promotions": self.promotions, "lookup_self_evictions": self.self_evictions}


@dataclass
class TierCount:
    """Per-tier block hits over a run, and the *useful* level given each tier's read time per block.

    ``dram``/``ssd`` count the hit blocks served from each tier (rates over
    all prompt blocks, so ``dram + ssd`` = the exists level). ``useful``
    counts a request's hit blocks when reading them (``dram_us`` per DRAM
    block + ``ssd_us`` per SSD block, one after another) takes no longer than
    recomputing their tokens at ``prefill_tokens_per_s``, the rule of the
    replay's useful level; None when no SSD read time is known.
    """

    ssd_us: float | None = None
    dram_us: float = 0.0
    prefill_tokens_per_s: float = 8000.0
    dram_blocks: int = 0
    ssd_blocks: int = 0
    total_blocks: int = 0
    useful: HitCount = field(default_factory=HitCount)

    def add(self, trace: Trace, req_index: int, run: int, n_ssd: int) -> None:
        r = trace.requests[req_index]
        self.dram_blocks += run - n_ssd
        self.ssd_blocks += n_ssd
        self.total_blocks += len(r.hash_ids)
        if self.ssd_us is None:
            return
        tokens = sum(r.block_tokens(j, trace.block_tokens) for j in range(run))
        read_us = (run - n_ssd) * self.dram_us + n_ssd * self.ssd_us
        self.useful.add(trace, req_index, run if read_us <= tokens / self.prefill_tokens_per_s * 1e6 else 0)

    def as_dict(self) -> dict:
        tb = self.total_blocks or 1
        out = {"dram_hit_blocks": self.dram_blocks, "ssd_hit_blocks": self.ssd_blocks,
               "dram_block_hit_rate": self.dram_blocks / tb, "ssd_block_hit_rate": self.ssd_blocks / tb,
               "ssd_read_us": self.ssd_us, "dram_read_us": self.dram_us,
               "prefill_tokens_per_s": self.prefill_tokens_per_s}
        if self.ssd_us is not None:
            out["useful"] = self.useful.as_dict()
        return out


# ------------------------------------------------------------------ real tiered servers

# STATS keys of the SSD tier (issue 11), summed over servers by :func:`tier_stats`.
SSD_STATS = ("ssd_capacity", "ssd_objects", "ssd_bytes", "ssd_hits", "ssd_misses", "ssd_reads", "ssd_read_bytes",
             "ssd_writes", "ssd_write_bytes", "ssd_write_drops", "ssd_admit_skips", "ssd_errors", "ssd_corrupt",
             "ssd_read_us_total", "ssd_write_us_total", "ssd_promotions", "ssd_queue_bytes")
# The server's log layout (csrc/kvf_tier.c), for ssd_geometry: 4 KiB alignment, segment size bounds.
SSD_ALIGN = 4096
SSD_SEG_MIN, SSD_SEG_MAX = 1 << 20, 64 << 20

_support: dict[str, str | None] = {}


def tier_unsupported(module: str = "kvfabric") -> str | None:
    """Why ``python -m <module> serve`` cannot run an SSD tier, or None when its --help lists ``--ssd-path``.

    A benchmark asked for a tier checks this first and stops with the reason
    instead of measuring a server without one.
    """
    import subprocess
    import sys

    if module not in _support:
        try:
            out = subprocess.run([sys.executable, "-m", module, "serve", "--help"], capture_output=True, text=True,
                                 timeout=120)
            text = out.stdout + out.stderr
            missing = [f for f in ("--ssd-path", "--ssd-capacity", "--ssd-admit") if f not in text]
            _support[module] = (None if not missing else
                                f"`{module} serve` has no {', '.join(missing)} yet (the SSD tier of issue 11 is not "
                                f"in this build); no server figure was measured")
        except (OSError, subprocess.SubprocessError) as e:
            _support[module] = f"could not run `{module} serve --help`: {e}"
    return _support[module]


def tier_args(ssd_dir: str, ssd_bytes: int, admit: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The `kvfabric serve` flags of one server's SSD tier."""
    return ["--ssd-path", ssd_dir, "--ssd-capacity", str(ssd_bytes), "--ssd-admit", admit, *extra]


def start_tiered_pool(n: int, capacity: int, policy: str, base_dir: str, ssd_bytes: int, admit: str,
                      extra_args: tuple[str, ...] = ()):
    """Start ``n`` local servers, each with its own SSD directory under ``base_dir``; all or none.

    Returns a :class:`kvfabric.testing.servers.ServerPool`. Raises
    ``RuntimeError`` (with the reason) when the server has no SSD tier or a
    server does not start.
    """
    import os

    from ..testing.servers import ServerPool, start_server

    reason = tier_unsupported()
    if reason:
        raise RuntimeError(reason)
    pool = ServerPool()
    try:
        for i in range(n):
            d = os.path.join(base_dir, f"shard{i}")
            os.makedirs(d, exist_ok=True)
            pool.append(start_server(capacity=capacity, policy=policy, timeout_s=60.0,
                                     extra_args=[*extra_args, *tier_args(d, ssd_bytes, admit)]))
    except BaseException:
        for s in pool:
            s.kill()
        raise
    return pool


def tier_stats(servers: dict) -> dict[str, float]:
    """The ``ssd_*`` STATS summed over servers (a ``Client.stats()["servers"]`` dict), with ``ssd_read_us``.

    ``ssd_read_us`` is the mean read time of one record (``ssd_read_us_total
    / ssd_reads``), None before any read. Servers without the keys add 0.
    """
    out: dict[str, float] = {k: 0 for k in SSD_STATS}
    for s in servers.values():
        if isinstance(s, dict):
            for k in SSD_STATS:
                v = s.get(k)
                if isinstance(v, (int, float)):
                    out[k] += v
    out["ssd_read_us"] = out["ssd_read_us_total"] / out["ssd_reads"] if out["ssd_reads"] else None
    return out


def ssd_geometry(blocks: int, block_bytes: int) -> tuple[int, int, int]:
    """(``--ssd-capacity`` bytes, records it holds, records per segment) for a log of at least ``blocks`` blocks.

    Mirrors the server's layout (csrc/kvf_tier.c, one path): a record is one
    4 KiB header block + the value rounded up to 4 KiB; the file is a 4 KiB
    superblock + ``(capacity - 4 KiB) // seg`` segments of ``seg =
    clamp(capacity / 16, 1 MiB, 64 MiB)`` bytes (4 KiB aligned); a record
    that does not fit in what is left of a segment starts the next one. The
    capacity chosen makes ``seg`` come out as a whole number of records when
    it lies between the clamps (16 segments), else uses the clamped size.
    """
    if blocks < 1:
        raise ValueError(f"an SSD log needs at least one block, got {blocks}")
    rec = SSD_ALIGN + -(-block_bytes // SSD_ALIGN) * SSD_ALIGN
    if rec > SSD_SEG_MAX:
        raise ValueError(f"a {block_bytes}-byte block does not fit in one {SSD_SEG_MAX}-byte segment")
    per_a = -(-blocks // 16)
    if per_a * rec > SSD_SEG_MAX:
        seg = SSD_SEG_MAX
        per_seg = seg // rec
        nsegs = -(-blocks // per_seg)
    elif per_a * rec >= SSD_SEG_MIN:
        per_seg, nsegs = per_a, 16
        seg = per_seg * rec
    else:
        seg = SSD_SEG_MIN
        per_seg = seg // rec
        nsegs = max(2, -(-blocks // per_seg))
    return SSD_ALIGN + nsegs * seg, nsegs * per_seg, per_seg


def print_tiers(report: dict[str, Any], out=None) -> None:
    """Per run: the exists level against infinite capacity, hits per tier (simulated), the servers' SSD counters."""
    out = out or sys.stdout
    inf = report["infinite"]["block_hit_rate"]
    print(f"tiers: DRAM {report['capacity_fraction']:.1%} + SSD {report.get('ssd_capacity_fraction', 0):.1%} of "
          f"unique blocks; infinite {inf:.1%}", file=out)
    print(f"{'run':>16} {'exists':>7} {'/inf':>6} {'dram':>6} {'ssd':>6} {'useful':>7} {'ssd hits':>9} "
          f"{'ssd writes':>10} {'drops':>6} {'skips':>6} {'read us':>8} {'corrupt':>7}", file=out)
    for r in report["runs"]:
        ex = r["levels"]["exists"]["block_hit_rate"]
        t = (r.get("sim") or {}).get("tiers") or {}
        s = r.get("ssd") or {}
        use = t.get("useful", {}).get("block_hit_rate")

        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        print(f"{r.get('label', r['policy']):>16} {ex:>7.1%} {f(ex / inf if inf else None, '.1%'):>6} "
              f"{f(t.get('dram_block_hit_rate'), '.1%'):>6} {f(t.get('ssd_block_hit_rate'), '.1%'):>6} "
              f"{f(use, '.1%'):>7} {f(s.get('ssd_hits'), '.0f'):>9} {f(s.get('ssd_writes'), '.0f'):>10} "
              f"{f(s.get('ssd_write_drops'), '.0f'):>6} {f(s.get('ssd_admit_skips'), '.0f'):>6} "
              f"{f(s.get('ssd_read_us'), '.0f'):>8} {f(s.get('ssd_corrupt'), '.0f'):>7}", file=out)
    print("exists/inf = exists level over the infinite-capacity rate; dram/ssd/useful = the two-level simulator "
          "(useful with the servers' measured SSD read time per block); the rest = the servers' ssd_* STATS",
          file=out)
