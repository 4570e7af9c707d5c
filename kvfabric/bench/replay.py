"""``kvfabric bench replay TRACE``: replay a trace against real pool servers, three hit-rate levels.

By default it starts ``--shards`` local ``kvfabric serve`` processes per
policy (``kvfabric.testing.servers``), each with an arena sized to hold its
share of ``--capacity`` x the trace's unique blocks; ``--servers a:p,b:q``
replays against running servers instead (their policy and capacity are what
they are, read from STATS). For every request, in timestamp order (as fast as
possible, or ``--timed`` with ``--speedup``):

1. LOOKUP the prompt's block keys: the leading run the pool holds is the
   *exists* level;
2. GET those blocks, through one reused window of ``--window-mib`` (64 MiB)
   of buffers so long prompts at real KV sizes stream, with a deadline of
   ``--deadline-ms`` (LOOKUP and PUT get ``--timeout-s``): a block counts as *loaded* only if it arrived, whole,
   with the bytes that were PUT for its key, and every earlier block did too;
3. *useful*: the loaded blocks count only if the GET finished faster than
   recomputing their tokens at ``--prefill-tokens-per-s`` would have;
4. PUT the blocks from the run on, each with its parent (previous block's
   key) so prefix-aware policies see the chain; payloads are
   ``block_tokens x --bytes-per-token`` bytes derived from the key.

Payload size: the default 16 bytes/token is Llama-3.1-8B's KV (32 layers x 8
KV heads x 128 dims x K+V x 2 bytes = 131072 B/token) scaled down 8192x so a
full Mooncake trace (~1.5 GB of PUTs at that size) replays in about a minute
on two shared cores. Hit rates do not depend on the size (every block has
the same size, capacity is set in blocks); latencies and the *useful* level
do, and are optimistic at scaled sizes: pass ``--bytes-per-token 131072`` with
``--limit`` for real-size transfers.

The run also computes, from the trace alone, Belady's bound and the
infinite-capacity hit rate at the same total capacity, the gap each policy
closes between LRU and Belady, and (unless ``--no-check-sim``) replays the
trace through :mod:`kvfabric.bench.simulate` with the same servers and key
salt and reports whether the exists level matched request for request.
With ``--ssd-capacity F`` the local servers get an SSD tier of F x the
unique blocks (split over the shards) below their DRAM arena of
``--dram-capacity`` (= ``--capacity``), in directories under ``--ssd-dir``
(:mod:`kvfabric.bench._tiers`), once per ``--ssd-admit`` rule (``off`` = the
same DRAM without a tier); each run reports the servers' ``ssd_*`` STATS,
hits per tier and the useful level from the two-level simulator with the
servers' measured SSD read time per block, and the cross-check is against
that simulator. A server without the tier stops the run with the reason.
Prints a table, writes JSON (``--json``). Exit status 2 on bad arguments or
an unreadable trace, 1 when a server could not start.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ClientConfig
from ..testing.reference.arena import PAGE_SIZE, pages_for
from ..server.eviction import POLICIES
from .belady import ChunkCount, HitCount, belady, belady_chunks, chunk_hit_blocks, infinite, infinite_chunks
from .simulate import gap_closed, shard_capacity, simulate
from ._tiers import ADMIT_RULES, ssd_geometry, start_tiered_pool, tier_stats
from .replay_report import print_report
from .traces import Trace, TraceError, block_keys, chunk_block_keys, load_trace

LLAMA31_8B_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
DEFAULT_BYTES_PER_TOKEN = 16
DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
#: Link of the modelled transfer (--kv-bytes-per-token): 25 Gb/s, a common NIC of a TCP pool.
DEFAULT_LINK_GBPS = 25.0
DEFAULT_GET_WINDOW_BYTES = 64 << 20
KEY_MODES = ("prefix", "chunk")
# Client counters that mean transport trouble (a shard timed out, failed, or was skipped while down).
TRANSPORT_COUNTERS = ("timeouts", "shard_errors", "skipped_down", "dropped_puts", "reconnects")


@dataclass
class ReplayOptions:
    shards: int = 2
    capacity: float = 0.1
    policies: list[str] = field(default_factory=lambda: ["lru", "prefix-lfu"])
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    deadline_ms: float = 2000.0
    timeout_s: float = 30.0
    timed: bool = False
    speedup: float = 1.0
    salt: int = 0
    servers: list[str] | None = None
    check_sim: bool = True
    progress: bool = True
    key_mode: str = "prefix"
    get_window_bytes: int = DEFAULT_GET_WINDOW_BYTES
    spread: int = 0
    ssd_capacity: float = 0.0
    ssd_admit: list[str] = field(default_factory=lambda: ["all"])
    ssd_dir: str | None = None
    # useful level at a real KV size while moving scaled payloads (None: nothing modelled; see load_seconds)
    kv_bytes_per_token: int | None = None
    link_gbps: float = DEFAULT_LINK_GBPS

    def load_seconds(self, get_s: float, tokens: int) -> float:
        """A load of ``tokens`` tokens whose GET (at ``bytes_per_token``) took ``get_s``, plus the modelled
        (not measured) transfer of the bytes ``kv_bytes_per_token`` adds at ``link_gbps``, when set."""
        if self.kv_bytes_per_token is None or self.kv_bytes_per_token <= self.bytes_per_token:
            return get_s
        return get_s + tokens * (self.kv_bytes_per_token - self.bytes_per_token) * 8 / (self.link_gbps * 1e9)

    def validate(self) -> None:
        if self.shards < 1 or self.shards > 64:
            raise ValueError(f"--shards must be in 1..64, got {self.shards}")
        if not 0 < self.capacity <= 10:
            raise ValueError(f"--capacity is a fraction of unique blocks in (0, 10], got {self.capacity}")
        for p in self.policies:
            if p not in POLICIES:
                raise ValueError(f"unknown policy {p!r}; known: {sorted(POLICIES)}")
        if not 1 <= self.bytes_per_token <= LLAMA31_8B_BYTES_PER_TOKEN * 8:
            raise ValueError(f"--bytes-per-token must be in 1..{LLAMA31_8B_BYTES_PER_TOKEN * 8}")
        if not self.prefill_tokens_per_s > 0 or not self.deadline_ms > 0 or not self.speedup > 0:
            raise ValueError("--prefill-tokens-per-s, --deadline-ms and --speedup must be > 0")
        if not 0 < self.timeout_s <= 3600:
            raise ValueError("--timeout-s must be in (0, 3600]")
        for a in self.servers or []:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--servers takes host:port,... ; {a!r} is not host:port")
        if self.kv_bytes_per_token is not None and not 1 <= self.kv_bytes_per_token <= LLAMA31_8B_BYTES_PER_TOKEN * 8:
            raise ValueError(f"--kv-bytes-per-token must be in 1..{LLAMA31_8B_BYTES_PER_TOKEN * 8}")
        if not self.link_gbps > 0:
            raise ValueError("--link-gbps must be > 0")
        if not 0 <= self.spread <= 64:
            raise ValueError(f"--spread must be in 0..64, got {self.spread}")
        if not 0 <= self.ssd_capacity <= 100:
            raise ValueError(f"--ssd-capacity is a fraction of unique blocks in [0, 100], got {self.ssd_capacity}")
        for a in self.ssd_admit:
            if a not in ("off", *ADMIT_RULES):
                raise ValueError(f"--ssd-admit must be off, all or hit, got {a!r}")
        if self.ssd_capacity and self.servers:
            raise ValueError("--ssd-capacity sizes the local servers' tier; running --servers have theirs already")
        if self.key_mode not in KEY_MODES:
            raise ValueError(f"--key-mode must be one of {KEY_MODES}, got {self.key_mode!r}")
        if not 1 <= self.get_window_bytes <= 1 << 34:
            raise ValueError("--window-mib must be > 0 and at most 16 GiB")


def payload_for(key: bytes, nbytes: int) -> bytes:
    """The bytes PUT under ``key``: the key repeated (so a GET can check it got this key's bytes)."""
    reps = -(-nbytes // len(key))
    return (key * reps)[:nbytes]


def _pct(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    a = np.asarray(xs) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


def _get_flags(client: Any, keys: list[bytes], views: list[memoryview], block_bytes: int, deadline_s: float,
               moved: dict[str, int]) -> tuple[list[bool], float]:
    """GET ``keys`` in windows of ``len(views)`` blocks within one deadline; per key: arrived whole and correct."""
    flags: list[bool] = []
    spent = 0.0
    w = len(views)
    for off in range(0, len(keys), w):
        part = keys[off:off + w]
        left = deadline_s - spent
        if left <= 0:
            moved["late_or_missing_blocks"] += len(keys) - off
            flags += [False] * (len(keys) - off)
            break
        t0 = time.perf_counter()
        sizes = client.get_into(part, views[:len(part)], timeout_s=left)
        spent += time.perf_counter() - t0
        for j, n in enumerate(sizes):
            if n is None:
                moved["late_or_missing_blocks"] += 1
                flags.append(False)
                continue
            moved["get_bytes"] += n
            ok = n == block_bytes and views[j] == payload_for(part[j], block_bytes)
            moved["corrupt_blocks"] += not ok
            flags.append(ok)
    return flags, spent


def _leading(flags: list[bool]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))


#: How long a tiered replay waits, after one request, for the servers' write-behind to reach SSD.
SETTLE_TIMEOUT_S = 120.0


def _settle_write_behind(client: Any, deadline_s: float = SETTLE_TIMEOUT_S) -> int:
    """Poll the servers' STATS until none has SSD write-behind queued (``ssd_queue_bytes`` 0); the polls.

    The simulator puts a block evicted from DRAM on SSD at once; a server indexes it there only when
    its write has completed (until then a LOOKUP does not see it: docs/notes/tier.md). A replay that
    ran on regardless would count that window, which widens with machine load, as the policy's
    misses. Raises RuntimeError naming the servers still queued after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    polls, pause = 0, 0.0005
    while True:
        servers = client.stats().get("servers", {})
        polls += 1
        queued = {a: s.get("ssd_queue_bytes") for a, s in servers.items()
                  if not isinstance(s, dict) or s.get("ssd_queue_bytes", 0) != 0}
        if not queued:
            return polls
        if time.monotonic() > end:
            raise RuntimeError(f"the servers' SSD write-behind did not drain within {deadline_s:.0f} s "
                               f"(ssd_queue_bytes, or the STATS error, by server: {queued})")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def replay_against(trace: Trace, addresses: Sequence[str], block_bytes: int, opt: ReplayOptions,
                   desc: str = "replay", settle: bool = False) -> dict[str, Any]:
    """Replay ``trace`` against running servers; returns the three levels, bytes, latencies, throughput.

    Two clients: LOOKUP and PUT (what decides the exists level and what the
    pool holds) go through a *control* client with the generous
    ``--timeout-s``; GETs go through a *data* client with the request's
    deadline. A GET that misses its deadline marks the shard down in the data
    client only, so transport trouble lowers the loaded/useful levels but never
    drops puts or hides keys from the policy's exists figure; the control
    client's failure counters are reported under ``transport``.
    Server failures never raise (the clients degrade them to misses); a
    programming error in the client does. With ``opt.key_mode == "chunk"``
    the pool also gets every passage's chunk keys and the chunk level
    ("reusable with blending") is counted apart (:class:`ChunkCount`). With ``settle`` (servers with
    an SSD tier), each request's PUTs are followed by a wait until the servers' write-behind has
    reached SSD (:func:`_settle_write_behind`), so the replay sees what the simulator models; the
    waits are reported (``settle``) and left out of ``wall_s`` (they fall between requests, outside
    every latency).
    """
    from ..client import Client  # imported here: the offline commands need no sockets

    chunks = opt.key_mode == "chunk"
    levels = {"exists": HitCount(), "loaded": HitCount(), "useful": HitCount()}
    clevels = {"exists": ChunkCount(), "loaded": ChunkCount(), "useful": ChunkCount()}
    lat: dict[str, list[float]] = {"lookup": [], "get": [], "put": []}
    moved = {"get_bytes": 0, "put_bytes": 0, "puts_stored": 0, "puts_existed": 0, "puts_dropped": 0,
             "corrupt_blocks": 0, "late_or_missing_blocks": 0}
    # One window of GET buffers, reused: a long prompt is fetched (and PUT) window by window.
    window = max(1, min(max(len(r.hash_ids) for r in trace.requests) or 1, opt.get_window_bytes // block_bytes))
    buf = bytearray(window * block_bytes)
    views = [memoryview(buf)[i * block_bytes:(i + 1) * block_bytes] for i in range(window)]
    bt = trace.block_tokens
    deadline_s = opt.deadline_ms / 1000.0
    bar = _progress(len(trace), desc, opt.progress)
    settled = {"polls": 0, "seconds": 0.0}
    ctl_cfg = ClientConfig(timeout_s=opt.timeout_s, transport="auto")
    data_cfg = ClientConfig(timeout_s=max(opt.timeout_s, deadline_s), transport="auto")
    with Client(list(addresses), config=ctl_cfg) as client, Client(list(addresses), config=data_cfg) as data:
        t_start = time.perf_counter()
        ts0 = trace.requests[0].timestamp
        for i, r in enumerate(trace.requests):
            if opt.timed:
                wait = (r.timestamp - ts0) / 1000.0 / opt.speedup - (time.perf_counter() - t_start)
                if wait > 0:
                    time.sleep(wait)
            keys = block_keys(r.hash_ids, opt.salt)
            t0 = time.perf_counter()
            run = client.lookup(keys)
            ckeys = [chunk_block_keys(ids, opt.salt) for _, _, ids in r.chunks] if chunks else []
            cruns = []
            if ckeys:
                # One EXISTS for every passage's chunk keys (it does not touch the policy); per passage the
                # leading run of keys that exist is its chunk hit.
                present = iter(client.exists([k for ck in ckeys for k in ck]))
                for ck in ckeys:
                    flags = [next(present) for _ in ck]
                    cruns.append(_leading(flags))
            t1 = time.perf_counter()
            lat["lookup"].append(t1 - t0)
            flags, get_s = _get_flags(data, keys[:run], views, block_bytes, deadline_s, moved) if run else ([], 0.0)
            loaded = _leading(flags)
            tokens = sum(r.block_tokens(j, bt) for j in range(loaded))
            useful = loaded if opt.load_seconds(get_s, tokens) <= tokens / opt.prefill_tokens_per_s else 0
            chits = chunk_hit_blocks(r, bt, run, cruns) if chunks else []
            if chits:
                cflags, cget_s = _get_flags(data, [ckeys[c][j] for c, j, _ in chits], views, block_bytes,
                                            deadline_s, moved)
                broken: set[int] = set()
                cloaded = []
                for (c, j, beyond), ok in zip(chits, cflags):
                    if ok and c not in broken:
                        cloaded.append((c, j, beyond))
                    else:
                        broken.add(c)
                get_s += cget_s
                ctok = sum(b for _, _, b in cloaded)
                cuseful = cloaded if opt.load_seconds(cget_s, ctok) <= ctok / opt.prefill_tokens_per_s else []
            else:
                cloaded = cuseful = []
            t2 = time.perf_counter()
            if run or chits:
                lat["get"].append(get_s)
            todo = keys[run:]
            parents: list[bytes | None] = [keys[j - 1] if j else None for j in range(run, len(keys))]
            for ck, cr in zip(ckeys, cruns):
                todo += ck[cr:]
                parents += [ck[j - 1] if j else None for j in range(cr, len(ck))]
            if todo:
                # Window by window too: a long prompt's payloads never sit in memory all at once.
                for off in range(0, len(todo), window):
                    part = todo[off:off + window]
                    res = client.put(part, [payload_for(k, block_bytes) for k in part],
                                     parents=parents[off:off + window])
                    moved["puts_stored"] += res.stored
                    moved["puts_existed"] += res.existed
                    moved["puts_dropped"] += res.dropped
                lat["put"].append(time.perf_counter() - t2)
                moved["put_bytes"] += len(todo) * block_bytes
                if settle:
                    t3 = time.perf_counter()
                    settled["polls"] += _settle_write_behind(client)
                    settled["seconds"] += time.perf_counter() - t3
            levels["exists"].add(trace, i, run)
            levels["loaded"].add(trace, i, loaded)
            levels["useful"].add(trace, i, useful)
            if chunks:
                clevels["exists"].add_blocks(trace, i, chits)
                clevels["loaded"].add_blocks(trace, i, cloaded)
                clevels["useful"].add_blocks(trace, i, cuseful)
            bar.update(1)
        wall = time.perf_counter() - t_start - settled["seconds"]
        all_stats = client.stats()
        server_stats = all_stats.get("servers", {})
        data_stats = data.stats().get("client", {})
    bar.close()
    ctl = all_stats.get("client", {})
    out = {
        "key_mode": opt.key_mode,
        "levels": {k: v.as_dict() for k, v in levels.items()},
        "exists_runs": levels["exists"].runs,
        "latency": {k: _pct(v) for k, v in lat.items()},
        "bytes": moved,
        "wall_s": wall,
        "requests_per_s": len(trace) / wall if wall > 0 else None,
        "get_mb_per_s": moved["get_bytes"] / sum(lat["get"]) / 1e6 if sum(lat["get"]) > 0 else None,
        "client": {k: v for k, v in ctl.items() if isinstance(v, (int, float))},
        "transport": {"control": {k: ctl.get(k, 0) for k in TRANSPORT_COUNTERS},
                      "data": {k: data_stats.get(k, 0) for k in TRANSPORT_COUNTERS}},
        "servers": {a: {k: s.get(k) for k in ("policy", "capacity", "objects", "evictions", "hits", "misses")}
                    for a, s in server_stats.items() if isinstance(s, dict)},
    }
    if any(isinstance(s, dict) and "ssd_capacity" in s for s in server_stats.values()):
        out["ssd"] = tier_stats(server_stats)
    if settle:
        out["settle"] = {"stats_polls": settled["polls"], "seconds": settled["seconds"]}
    if chunks:
        out["chunk_levels"] = {k: v.as_dict() for k, v in clevels.items()}
    return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, on: bool):
    if not on:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5, file=sys.stderr)


def sharding_spread(trace: Trace, policy: str, per_shard: int, opt: ReplayOptions) -> dict[str, Any]:
    """Exists level (block and token rates) over ``opt.spread`` other server-id sets, offline.

    Local servers listen on random ports and the client shards by address,
    so which shard owns a key, and with it a multi-shard result, changes from
    run to run; this says by how much, next to the measured figure.
    """
    rates, toks, chunk = [], [], []
    for k in range(opt.spread):
        servers = [f"spread-{k}-{i}:0" for i in range(opt.shards)]
        r = simulate(trace, policy, per_shard, servers, salt=opt.salt, chunks=opt.key_mode == "chunk")
        rates.append(r.hits.block_hit_rate)
        toks.append(r.hits.token_hit_rate)
        if r.chunk_hits is not None:
            chunk.append(r.chunk_hits.token_hit_rate)
    out: dict[str, Any] = {"server_id_sets": opt.spread, "block_hit_rate": [min(rates), max(rates)],
                           "token_hit_rate": [min(toks), max(toks)]}
    if chunk:
        out["chunk_token_hit_rate"] = [min(chunk), max(chunk)]
    return out


#: A replay whose servers and simulator disagree (leading run of blocks, request by request) on more than
#: this fraction of requests fails (`kvfabric bench replay` exits 1, printing the first SIM_SHOWN of them):
#: the simulator models the servers' capacity, policy, tiers and promotion cap, so more than noise means one
#: of them is wrong, and the figures with it.
SIM_TOLERANCE = 0.01
SIM_SHOWN = 5


def sim_disagreements(report: dict[str, Any]) -> list[str]:
    """One line per run of report whose simulator cross-check is over SIM_TOLERANCE, with its first requests."""
    lines = []
    for run in report["runs"]:
        sim = run.get("sim")
        if not sim or not sim.get("requests"):
            continue
        if sim["requests_differing"] > SIM_TOLERANCE * sim["requests"]:
            first = ", ".join(f"#{d['request']} sim {d['sim_run']} servers {d['servers_run']}"
                              for d in sim["first_differing"])
            lines.append(f"{run.get('label', run['policy'])}: the servers and the simulator disagree on "
                         f"{sim['requests_differing']} of {sim['requests']} requests (over {SIM_TOLERANCE:.0%}; "
                         f"leading blocks hit, first: {first})")
    return lines


def run_replay(trace: Trace, opt: ReplayOptions) -> dict[str, Any]:
    """Replay ``trace`` once per policy (own servers) or once against ``opt.servers``; adds bound and gap.

    Raises ``ValueError`` for bad options and ``RuntimeError`` when a local
    server does not start or one of ``opt.servers`` does not answer STATS.
    """
    opt.validate()
    if opt.key_mode == "chunk" and not trace.has_chunks:
        raise ValueError(f"--key-mode chunk needs a trace with chunks (passage boundaries); {trace.name} has none")
    block_bytes = trace.block_tokens * opt.bytes_per_token
    slot = pages_for(block_bytes) * PAGE_SIZE
    per_shard = shard_capacity(trace, opt.capacity, opt.shards)
    report: dict[str, Any] = {
        "trace": trace.name, "requests": len(trace), "total_blocks": trace.total_blocks,
        "unique_blocks": trace.unique_blocks, "block_tokens": trace.block_tokens,
        "bytes_per_token": opt.bytes_per_token, "block_bytes": block_bytes,
        "kv_bytes_per_token": opt.kv_bytes_per_token, "link_gbps": opt.link_gbps,
        "prefill_tokens_per_s": opt.prefill_tokens_per_s, "deadline_ms": opt.deadline_ms,
        "timed": opt.timed, "speedup": opt.speedup, "salt": opt.salt, "timeout_s": opt.timeout_s,
        "key_mode": opt.key_mode, "runs": [],
    }
    if opt.servers:
        from ..client import Client

        with Client(opt.servers) as c:
            stats = c.stats().get("servers", {})
        bad = {a: (s.get("error") if isinstance(s, dict) else s) or "no policy/capacity in STATS"
               for a, s in stats.items()
               if not isinstance(s, dict) or "error" in s or not s.get("policy") or not s.get("capacity")}
        if not stats:
            raise RuntimeError(f"no STATS from {opt.servers}")
        if bad:
            why = "; ".join(f"{a}: {e}" for a, e in bad.items())
            raise RuntimeError(f"cannot replay against servers that do not answer STATS: {why}")
        policies = sorted({s["policy"] for s in stats.values()})
        policy = policies[0] if len(policies) == 1 else "/".join(policies)
        per_shard = min(s["capacity"] // slot for s in stats.values())
        if per_shard < 1:
            raise RuntimeError(f"a server's capacity holds no block of {block_bytes} B: {stats}")
        out = replay_against(trace, opt.servers, block_bytes, opt, f"replay {policy}")
        out.update(policy=policy, shards=len(opt.servers), blocks_per_shard=per_shard)
        report["runs"].append(out)
    else:
        import tempfile

        from ..testing.servers import start_pool

        ssd_per = ssd_seg = ssd_bytes = 0
        if opt.ssd_capacity:
            # the log the server lays out for that many blocks (whole segments): the simulator gets the same
            ssd_bytes, ssd_per, ssd_seg = ssd_geometry(shard_capacity(trace, opt.ssd_capacity, opt.shards),
                                                       block_bytes)
            report.update(ssd_blocks_per_shard=ssd_per, ssd_capacity_blocks=ssd_per * opt.shards,
                          ssd_capacity_fraction=ssd_per * opt.shards / trace.unique_blocks,
                          ssd_bytes_per_shard=ssd_bytes, ssd_segment_blocks=ssd_seg)
        for pol, admit in [(p, a) for p in opt.policies for a in (opt.ssd_admit if ssd_per else ["off"])]:
            tier = ssd_per if admit != "off" else 0
            label = pol if not ssd_per else f"{pol}/{'dram-only' if admit == 'off' else 'ssd-' + admit}"
            # evict only when a PUT finds no room, so the servers hold exactly per_shard blocks
            # (the simulator's model); `kvfabric serve` otherwise evicts ahead of demand
            args = ("--evict-watermarks", "0,0")
            with tempfile.TemporaryDirectory(prefix="kvfabric-replay-ssd-", dir=opt.ssd_dir) as ssd_dir:
                pool = (start_tiered_pool(opt.shards, per_shard * slot, pol, ssd_dir, ssd_bytes, admit, args) if tier else
                        start_pool(opt.shards, capacity=per_shard * slot, policy=pol, extra_args=list(args)))
                with pool:
                    out = replay_against(trace, pool.addresses, block_bytes, opt, f"replay {label}", settle=bool(tier))
                    addresses = pool.addresses
                    dead = pool.deaths()
                    if dead:  # the figures would be a dead server's misses, not the policy's
                        raise RuntimeError(f"a pool server died during the {label} replay: " + "\n".join(dead))
            out.update(policy=pol, label=label, admit=admit if ssd_per else None, shards=opt.shards,
                       blocks_per_shard=per_shard)
            if opt.check_sim:
                ssd_us = (out.get("ssd") or {}).get("ssd_read_us")
                sim = simulate(trace, pol, per_shard, addresses, salt=opt.salt, chunks=opt.key_mode == "chunk",
                               ssd_blocks_per_shard=tier, admit=admit if tier else "all", ssd_segment_blocks=ssd_seg,
                               ssd_read_us=ssd_us,
                               prefill_tokens_per_s=opt.prefill_tokens_per_s)
                differing = [(i, a, b) for i, (a, b) in enumerate(zip(sim.hits.runs, out["exists_runs"])) if a != b]
                out["sim"] = {"block_hit_rate": sim.hits.block_hit_rate, "requests_differing": len(differing),
                              "requests": len(out["exists_runs"]),
                              "first_differing": [{"request": i, "sim_run": a, "servers_run": b}
                                                  for i, a, b in differing[:SIM_SHOWN]]}
                if sim.tiers is not None:
                    out["sim"].update(tiers=sim.tiers.as_dict(), tier_counters=sim.tier_counters)
                if sim.chunk_hits is not None:
                    out["sim"]["chunk_hit_blocks"] = sim.chunk_hits.hit_blocks
                    real_chunk = out["chunk_levels"]["exists"]["hit_blocks"]
                    out["sim"]["chunk_agrees"] = sim.chunk_hits.hit_blocks == real_chunk
            if opt.spread and opt.shards > 1:
                out["sharding_spread"] = sharding_spread(trace, pol, per_shard, opt)
            report["runs"].append(out)
    total = per_shard * (len(opt.servers) if opt.servers else opt.shards)
    report["capacity_blocks"] = total
    report["capacity_fraction"] = total / trace.unique_blocks
    bound, inf = belady(trace, total), infinite(trace)
    report["belady"] = bound.as_dict()
    report["infinite"] = inf.as_dict()
    if opt.key_mode == "chunk":
        (bp, bc), (ip, ic) = belady_chunks(trace, total), infinite_chunks(trace)
        report["chunk_reference"] = {"belady": {"prefix": bp.as_dict(), "chunk": bc.as_dict()},
                                     "infinite": {"prefix": ip.as_dict(), "chunk": ic.as_dict()}}
    lru = next((r for r in report["runs"] if r["policy"] == "lru" and r.get("admit") in (None, "off")),
               next((r for r in report["runs"] if r["policy"] == "lru"), None))
    for r in report["runs"]:
        tiered = r.get("admit") not in (None, "off")  # more capacity than Belady's: no gap to speak of
        r["gap_closed"] = None if lru is None or tiered else gap_closed(
            r["levels"]["exists"]["block_hit_rate"], lru["levels"]["exists"]["block_hit_rate"], bound.block_hit_rate)
        del r["exists_runs"]
    return report


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``with start_pool(...)`` stops the local servers on the way out."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def add_common_arguments(p: argparse.ArgumentParser, block_tokens: bool = True) -> None:
    """Replay flags shared by replay, sweep and rag (rag's generator owns ``--block-tokens``)."""
    p.add_argument("--shards", type=int, default=2, help="local servers to start per policy (default 2)")
    p.add_argument("--bytes-per-token", type=int, default=DEFAULT_BYTES_PER_TOKEN,
                   help="payload bytes per token (default 16 = Llama-3.1-8B's 131072 scaled 1/8192)")
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="the engine's real KV bytes per token for the useful level: a load takes its measured GET "
                        "time plus the extra bytes at --link-gbps (modelled; default: none, the moved size is real)")
    p.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help=f"link of that modelled transfer, Gb/s (default {DEFAULT_LINK_GBPS:g})")
    p.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_PREFILL_TOKENS_PER_S,
                   help="recompute rate for the useful level (default 8000)")
    p.add_argument("--deadline-ms", type=float, default=2000.0, help="GET deadline per request (default 2000)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="LOOKUP/PUT timeout (default 30)")
    p.add_argument("--timed", action="store_true", help="follow the trace's timestamps (default: as fast as possible)")
    p.add_argument("--speedup", type=float, default=1.0, help="with --timed, replay this many times faster")
    p.add_argument("--salt", type=int, default=None, help="key salt (default 0)")
    p.add_argument("--no-check-sim", action="store_true", help="skip the offline simulator cross-check")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--key-mode", choices=(*KEY_MODES, "both"), default=None,
                   help="prefix: the pool holds prefix keys (default); chunk: also every passage's chunk keys, and "
                        "the chunk level is reported beside the prefix one (needs a trace with chunks); "
                        "both (bench rag only): one run of each")
    p.add_argument("--window-mib", type=float, default=DEFAULT_GET_WINDOW_BYTES / (1 << 20),
                   help="GET/PUT a long prompt's blocks in windows of this many MiB (default 64)")
    p.add_argument("--spread", type=int, default=None,
                   help="with 2+ shards, also simulate N other server-id sets and report the exists level's range "
                        "(sharding follows the servers' random ports; default 0)")
    p.add_argument("--ssd-capacity", type=float, default=0.0,
                   help="SSD tier below each local server's DRAM, a fraction of unique blocks (default 0: none)")
    p.add_argument("--ssd-admit", action="append", choices=("off", *ADMIT_RULES), default=None,
                   help="SSD admission rule, repeatable, one run each: all, hit, or off (DRAM only; default all)")
    p.add_argument("--ssd-dir", default=None, help="where the local servers' SSD directories go (default the temp dir)")
    if block_tokens:
        p.add_argument("--block-tokens", type=int, default=None,
                       help="tokens per trace block (default: the trace's, else 512)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")


def options_from_args(args: argparse.Namespace, **over: Any) -> ReplayOptions:
    servers = [s for s in (getattr(args, "servers", None) or "").split(",") if s] or None
    salt = args.salt if args.salt is not None else (random.getrandbits(63) if servers else 0)
    kw = dict(shards=args.shards, bytes_per_token=args.bytes_per_token, prefill_tokens_per_s=args.prefill_tokens_per_s,
              deadline_ms=args.deadline_ms, timeout_s=args.timeout_s, timed=args.timed, speedup=args.speedup,
              salt=salt, servers=servers,
              check_sim=not args.no_check_sim, progress=not args.no_progress, key_mode=args.key_mode or "prefix",
              spread=args.spread or 0, get_window_bytes=int(args.window_mib * (1 << 20)),
              ssd_capacity=args.ssd_capacity, ssd_admit=args.ssd_admit or ["all"], ssd_dir=args.ssd_dir,
              kv_bytes_per_token=args.kv_bytes_per_token, link_gbps=args.link_gbps)
    kw.update(over)
    return ReplayOptions(**kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfabric bench replay",
                                description="Replay a trace against real pool servers; three-level hit rates.")
    p.add_argument("trace", help="trace file, or mooncake-conversation / mooncake-synthetic")
    p.add_argument("--policy", action="append", choices=sorted(POLICIES),
                   help="policy of the local servers (repeatable; default lru and prefix-lfu)")
    p.add_argument("--capacity", "--dram-capacity", dest="capacity", type=float, default=0.1,
                   help="pool (DRAM) capacity as a fraction of unique blocks (default 0.1)")
    p.add_argument("--servers", default=None,
                   help="replay against these running servers (host:port,...), with a random key salt unless --salt")
    p.add_argument("--json", default=None, help="write the report here (default bench-results/replay-<trace>.json)")
    add_common_arguments(p)
    args = p.parse_args(argv)
    exit_on_sigterm()
    try:
        trace = load_trace(args.trace, args.block_tokens, args.limit)
        opt = options_from_args(args, capacity=args.capacity, policies=args.policy or ["lru", "prefix-lfu"])
        opt.validate()
    except (TraceError, ValueError) as e:
        print(f"kvfabric bench replay: {e}", file=sys.stderr)
        return 2
    try:
        report = run_replay(trace, opt)
    except ValueError as e:
        print(f"kvfabric bench replay: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"kvfabric bench replay: {e}", file=sys.stderr)
        return 1
    print_report(report)
    path = Path(args.json or f"bench-results/replay-{trace.name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    bad = sim_disagreements(report)
    for line in bad:
        print(f"kvfabric bench replay: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
