"""The load guard (issue 26 part 3, connectors/kvfabric_vllm/guard.py) on real vLLM and a real pool server.

One engine runs one prompt three times, vLLM's own prefix cache off: run 0 computes it (the
prefill rate gets its window) and saves it; run 1 finds it in the pool and loads it as before
(no load rate measured yet), which gives the load rate its window; run 2 is the guard's
decision. A slow pool is made by a real mechanism: the engine reaches the server through
:class:`kvfabric.testing.proxy.SlowReplyProxy`, which holds every GET reply ``DELAY_S``
(lookups answer at once), so the 300-token prompt's 256-token load takes seconds where the
tiny Llama computes the prompt in tens of milliseconds here. With the fast pool (the server
itself, a 1500-token prompt) the guard weighs the hit and loads it. A real SSD tier whose disk
reads are throttled (a block-I/O cgroup) makes the third case: the hit is on SSD, priced at the
SSD loads' own rate, and the lookup reads nothing from the disk.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from kvfabric import Client
from kvfabric.testing.poll import wait_for
from kvfabric.testing.proxy import SlowReplyProxy
from kvfabric.testing.servers import start_pool
from kvfabric.testing.throttle import ReadThrottle, unavailable

from conftest import CHUNK, GUARD_SLOW_TOKENS, LOADABLE, PARTS, PROMPT_TOKENS

SAVED = PROMPT_TOKENS // CHUNK
SLOW_SAVED = GUARD_SLOW_TOKENS // CHUNK
SLOW_LOADABLE = (GUARD_SLOW_TOKENS - 1) // CHUNK * CHUNK
#: each GET reply held this long: the slow prompt's 256-token load costs >= 11 ms per token, the
#: tiny Llama's prefill of a 300-token step ~0.1-0.3 ms per token measured at load 2 here, so
#: skipping holds with ~40x more CPU contention than that
DELAY_S = 3.0
#: one window of each rate is one prompt's worth (a prefill step of the 300-token prompt, its
#: 256-token load); no probe during the test
GUARD = {"load_guard_min_tokens": 256, "load_guard_probe_s": 3600}


def _delta(after: dict, before: dict, name: str) -> int:
    return after[name] - before[name]


def _wait_saved(address: str, chunks: int):
    """``between`` for run_engine: before the next run, the pool holds every object run 0 saved."""
    def between(_i: int) -> None:
        with Client([address]) as c:
            wait_for(lambda: sum(s["objects"] for s in c.stats()["servers"].values()) >= chunks * PARTS,
                     timeout_s=120)
    return between


def _guard_line(r: dict) -> str:
    out = r["stdout"] + r["log"]
    lines = [ln for ln in out.splitlines()
             if "kvfabric load guard" in ln or "scheduler counters" in ln or "predicted slower" in ln]
    return "\n".join(lines) or out[-3000:]


def test_guard_recomputes_when_the_pool_is_slower_than_prefill(run_engine, cold):
    with start_pool(1, capacity="64MiB") as pool:
        proxy = SlowReplyProxy(pool.addresses[0], delay_s=DELAY_S)
        try:
            r = run_engine(["guard_slow"] * 3, [proxy.address], between=_wait_saved(pool.addresses[0], SLOW_SAVED),
                           args=["--extra", json.dumps({**GUARD, "transport": "native"})])
        finally:
            proxy.close()
    c0, c1, c2 = r["counters_after"]
    why = _guard_line(r)
    assert r["outputs"] == [cold["guard_slow"]] * 3, why
    # run 0: computed and saved; run 1: loaded through the slow proxy, as before (no load rate yet)
    assert r["cached"][:2] == [0, SLOW_LOADABLE], (r["cached"], why)
    assert c0["save_chunks"] == SLOW_SAVED and proxy.delayed >= 1, (c0, proxy.delayed)
    assert _delta(c1, c0, "scheduled_load_tokens") == SLOW_LOADABLE and c1["loads_guarded"] == 0, (c1, why)
    # run 2: both rates measured, loading predicted slower: skipped, every token recomputed
    assert _delta(c2, c1, "lookup_hit_tokens") == SLOW_LOADABLE, (c1, c2)
    assert _delta(c2, c1, "loads_guarded") == 1 and _delta(c2, c1, "loads_skipped_slower") == 1, (c2, why)
    assert _delta(c2, c1, "skipped_load_tokens") == SLOW_LOADABLE, (c2, why)
    assert _delta(c2, c1, "scheduled_load_tokens") == 0 and r["cached"][2] == 0, (r["cached"], c2, why)
    assert "predicted slower than recomputing" in why, why     # said once, in vLLM's log
    print(why)     # the measured rates, for the record (pytest -s)


def test_guard_loads_when_the_pool_is_fast(run_engine, cold):
    with start_pool(1, capacity="64MiB") as pool:
        r = run_engine(["guard_fast"] * 3, pool.addresses, between=_wait_saved(pool.addresses[0], SAVED),
                       args=["--extra", json.dumps(GUARD)])
    c0, c1, c2 = r["counters_after"]
    why = _guard_line(r)
    assert r["outputs"] == [cold["guard_fast"]] * 3, why
    assert r["cached"] == [0, LOADABLE, LOADABLE], (r["cached"], why)
    assert c1["loads_guarded"] == 0, (c1, why)                 # run 1: no load rate yet
    assert _delta(c2, c1, "loads_guarded") == 1, (c2, why)     # run 2 weighed ...
    assert c2["loads_skipped_slower"] == 0 and c2["skipped_load_tokens"] == 0, (c2, why)   # ... and loaded
    assert _delta(c2, c1, "scheduled_load_tokens") == LOADABLE, (c2, why)
    print(why)


#: the throttled disk: the slow prompt's 256-token load (1 MiB of KV) reads for ~2 s where its
#: prefill takes tens of ms here (~60x; skipping holds under far more CPU contention than that)
SSD_READ_BPS = 512 * 1024
#: a lookup's lease, waited out before the filler so the prompt can leave DRAM between runs
SSD_LEASE_MS = 500


def test_guard_recomputes_ssd_hits_from_a_throttled_disk_and_reads_nothing_for_the_lookup(
        run_engine, cold, tmp_path_factory):
    """A real SSD tier whose disk reads are throttled (a block-I/O cgroup on the server process,
    kvfabric.testing.throttle): between runs the prompt is pushed out of DRAM (the server's DRAM is
    small; 40 MiB of other objects, the write-behind drained), so run 1's hit is on the SSD tier
    only: the lookup says so without reading the disk (LOOKUP media), the load streams it through
    the throttle (the SSD rate's first window). Run 2's SSD hit is predicted slower than prefill:
    recomputed, and the disk is not read at all."""
    ssd_dir = str(tmp_path_factory.mktemp("guard-ssd", numbered=True))
    why_not = unavailable(ssd_dir)
    if why_not is not None:
        pytest.skip(f"cannot throttle the SSD tier's disk here: {why_not}")
    with start_pool(1, capacity="16MiB", extra_args=["--ssd-path", ssd_dir, "--ssd-capacity", "1GiB"]) as pool, \
            ReadThrottle(ssd_dir, SSD_READ_BPS) as throttle, Client(pool.addresses) as c:
        throttle.add(pool[0].pid)
        stats = lambda: next(iter(c.stats()["servers"].values()))  # noqa: E731
        reads: list[int] = []
        filler = os.urandom(1 << 20)

        def between(i: int) -> None:
            _wait_saved(pool.addresses[0], SLOW_SAVED)(i)
            time.sleep(SSD_LEASE_MS / 1000 + 0.2)
            assert c.put([os.urandom(16) for _ in range(40)], [filler] * 40).dropped == 0
            assert wait_for(lambda: stats()["ssd_queue_bytes"] == 0, timeout_s=120), stats()
            reads.append(stats()["ssd_reads"])

        r = run_engine(["guard_slow"] * 3, pool.addresses, between=between,
                       args=["--extra", json.dumps({**GUARD, "transport": "native", "lease_ms": SSD_LEASE_MS})])
        reads.append(stats()["ssd_reads"])
    c0, c1, c2 = r["counters_after"]
    why = _guard_line(r) + f"\nserver ssd_reads before run 1, run 2, after: {reads}"
    assert r["outputs"] == [cold["guard_slow"]] * 3, why
    assert r["cached"] == [0, SLOW_LOADABLE, 0], (r["cached"], why)
    # run 1: loaded from the disk, as before (no SSD load rate yet): its objects were read
    assert _delta(c1, c0, "scheduled_load_tokens") == SLOW_LOADABLE and c1["loads_guarded"] == 0, (c1, why)
    assert reads[1] - reads[0] >= SLOW_SAVED * PARTS - PARTS, why
    # ... and counted as an SSD load (what kvfabric route prices SSD tokens with)
    assert c1["ssd_load_tokens"] == SLOW_LOADABLE and c1["ssd_load_us"] > 0, (c1, why)
    # run 2: the SSD hit weighed on the SSD loads' rate, skipped; the lookup read nothing
    assert _delta(c2, c1, "loads_skipped_slower") == 1 and _delta(c2, c1, "scheduled_load_tokens") == 0, (c2, why)
    assert reads[2] == reads[1], why
    assert "load_ssd_s_per_token" in why, why
    print(why)
