"""The two-level pool shard of the offline simulator: a DRAM arena under an eviction policy, an SSD log below.

This models the SSD tier of ``kvfabric serve --ssd-path DIR --ssd-capacity
SIZE [--ssd-admit all|hit]`` (issue 11) block for block, so that
:func:`kvfabric.bench.simulate.simulate` can report hit rates per tier and a
replay against real tiered servers can be checked against it. The model:

* **DRAM** holds at most ``dram_capacity`` blocks under the server's own
  eviction policy class (the same one the one-level simulator uses).
* **SSD** is a FIFO log of at most ``ssd_capacity`` blocks. A block evicted
  from DRAM is written behind to the log (if admitted, and only if the log
  does not hold it already); when the log is full its oldest record is
  overwritten (dropped), whatever its popularity: a log has no access order.
* **Admission** (``--ssd-admit``): ``all`` writes every evicted block;
  ``hit`` writes only blocks that were hit (LOOKUP or GET) at least once
  since they entered DRAM, the others are dropped and counted as admit skips.
* **LOOKUP** counts a block held in DRAM or on SSD as held. A DRAM hit
  touches the policy (``on_access``) as in the one-level model; an SSD hit
  touches nothing (reading the bytes is GET's business).
* **GET** of a DRAM block touches the policy; GET of a block only on SSD
  reads it and **promotes** it into DRAM (evicting as a PUT does, the
  victims going to the log in turn) and counts it as hit. The log keeps its
  copy, so a promoted block evicted again is not rewritten while its record
  survives.
* **PUT** of a block held in either tier is a no-op (the server answers
  EXISTS), else it enters DRAM as in the one-level model.

What the model leaves out, on purpose: the write queue (a real server drops
a write-behind when its queue is full: ``ssd_write_drops``), read or write
errors, and the order in which the server frees log space (it may reclaim
in segments rather than block by block). A replay through real servers
reports its own ``ssd_*`` counters beside the model's, so a difference shows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..server.eviction import make_policy
from .belady import HitCount
from .traces import Trace

ADMIT_RULES = ("all", "hit")


def _never_pinned(key: bytes) -> bool:
    return False


class TieredShard:
    """One pool server with a DRAM arena of ``dram_capacity`` blocks and an SSD log of ``ssd_capacity`` blocks."""

    __slots__ = ("policy", "dram", "ssd", "hit", "capacity", "ssd_capacity", "admit", "evictions", "ssd_writes",
                 "ssd_overwrites", "ssd_admit_skips", "ssd_hits", "promotions")

    def __init__(self, policy: str, dram_capacity: int, ssd_capacity: int, admit: str = "all",
                 kwargs: dict | None = None) -> None:
        if dram_capacity < 1:
            raise ValueError(f"dram capacity must be >= 1 block, got {dram_capacity}")
        if ssd_capacity < 0:
            raise ValueError(f"ssd capacity must be >= 0 blocks, got {ssd_capacity}")
        if admit not in ADMIT_RULES:
            raise ValueError(f"admission rule must be one of {ADMIT_RULES}, got {admit!r}")
        self.policy = make_policy(policy, **(kwargs or {}))
        self.dram: set[bytes] = set()
        self.ssd: OrderedDict[bytes, None] = OrderedDict()  # oldest record first
        self.hit: set[bytes] = set()  # DRAM blocks hit since they entered DRAM (admission "hit")
        self.capacity, self.ssd_capacity, self.admit = dram_capacity, ssd_capacity, admit
        self.evictions = self.ssd_writes = self.ssd_overwrites = self.ssd_admit_skips = 0
        self.ssd_hits = self.promotions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.dram or key in self.ssd

    def lookup(self, keys: list[bytes]) -> int:
        """The leading run of ``keys`` held in either tier; DRAM hits touch the policy."""
        n = 0
        for k in keys:
            if k in self.dram:
                self.policy.on_access(k)
                self.hit.add(k)
            elif k not in self.ssd:
                break
            n += 1
        return n

    def get(self, key: bytes, parent: bytes | None) -> str:
        """GET: ``"dram"`` (touch the policy), ``"ssd"`` (read, promote into DRAM) or ``"miss"`` (not held)."""
        if key in self.dram:
            self.policy.on_access(key)
            self.hit.add(key)
            return "dram"
        if key not in self.ssd:
            return "miss"
        self.ssd_hits += 1
        self.promotions += 1
        self._insert(key, parent)
        self.hit.add(key)
        return "ssd"

    def put(self, key: bytes, parent: bytes | None) -> None:
        """PUT: a no-op for a block held in either tier, else insert into DRAM (spilling victims to the log)."""
        if key in self:
            return
        self._insert(key, parent)

    def _insert(self, key: bytes, parent: bytes | None) -> None:
        while len(self.dram) >= self.capacity:
            victim = self.policy.evict(_never_pinned)
            if victim is None or victim not in self.dram:
                raise RuntimeError(f"policy {self.policy.name!r} returned {victim!r} from evict")
            self.dram.discard(victim)
            self.evictions += 1
            self._spill(victim)
        self.dram.add(key)
        self.policy.on_insert(key, 1, parent)

    def _spill(self, key: bytes) -> None:
        was_hit = key in self.hit
        self.hit.discard(key)
        if key in self.ssd or self.ssd_capacity == 0:
            return
        if self.admit == "hit" and not was_hit:
            self.ssd_admit_skips += 1
            return
        self.ssd[key] = None
        self.ssd_writes += 1
        while len(self.ssd) > self.ssd_capacity:
            self.ssd.popitem(last=False)
            self.ssd_overwrites += 1

    def counters(self) -> dict[str, int]:
        return {"dram_objects": len(self.dram), "ssd_objects": len(self.ssd), "evictions": self.evictions,
                "ssd_writes": self.ssd_writes, "ssd_overwrites": self.ssd_overwrites,
                "ssd_admit_skips": self.ssd_admit_skips, "ssd_hits": self.ssd_hits, "promotions": self.promotions}


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
# Bytes a block takes on the SSD log beyond its payload, rounded up to the O_DIRECT alignment: the record
# header (key, size, checksum) is assumed to fit in one 4096-byte page. Used only to turn a capacity in
# blocks into the byte size `--ssd-capacity` takes; a record format with a larger header holds fewer blocks.
SSD_ALIGN = 4096
SSD_RECORD_OVERHEAD = 4096

_support: dict[str, str | None] = {}


def ssd_bytes_for(blocks: int, block_bytes: int) -> int:
    """The ``--ssd-capacity`` in bytes that holds ``blocks`` records of ``block_bytes`` (see SSD_RECORD_OVERHEAD)."""
    rec = -(-(block_bytes + SSD_RECORD_OVERHEAD) // SSD_ALIGN) * SSD_ALIGN
    return blocks * rec


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
