"""Time the vLLM connector's lookup of one long prompt (layout 3), with and without the probe.

Runs the scheduler's own function (``SchedulerSide._lookup_all_parts``, which derives the keys
with ``keys.prompt_keys`` + ``PromptKeys.objects``) against real ``kvfabric serve`` processes
(``--servers`` of them, native, on loopback), for a model shape (``--layers``, ``--kv-heads``)
and a prompt of ``--tokens`` tokens in chunks of ``--chunk-tokens``: ``lookup_probe`` false
(every object of every chunk looked up, the behaviour before) and true (an EXISTS probe of the
first layer's objects, then a LOOKUP of every object of the chunks below the first one missing),
interleaved round by round, for three states of the pool: nothing of the prompt held (``miss``),
its first half held (``half``), all of it held (``full``). Every chunk is stored as a TP=1 rank
saves it (one group, 64-byte objects: the index is measured, not the bytes).

Needs vLLM's interpreter (the scheduler imports vLLM's metadata class)::

    PYTHONPATH=$PWD:$PWD/connectors /work/main/.venvs/vllm/bin/python scripts/bench-vllm-lookup.py \\
        --layers 32 --kv-heads 8 --tokens 128000

Prints one line per (state, mode): median and min of the wall time in ms, the answer (chunks),
and the machine's load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvfabric import Client
from kvfabric.testing.servers import start_server
from kvfabric_vllm.config import parse_extra_config
from kvfabric_vllm.keys import EngineKeys, prompt_keys
from kvfabric_vllm.layout import chunk_object_keys, object_placement, part_group
from kvfabric_vllm.metrics import Counters
from kvfabric_vllm.scheduler import SchedulerSide


def _store(c: Client, e: EngineKeys, pk, upto: int, batch: int = 16) -> None:
    for lo in range(0, upto, batch):
        ck = pk.chunk_keys[lo:min(upto, lo + batch)]
        keys = chunk_object_keys(e.hasher, ck, e.parts())
        place, groups = object_placement(ck, pk.placement[lo:lo + len(ck)], len(e.parts()),
                                         groups=[part_group(e.hasher, k, e.heads, 0) for k in ck])
        res = c.put(keys, [b"v" * 64] * len(keys), placement=place, groups=groups)
        assert res.stored + res.existed == len(keys), res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128_000)
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n_chunks = args.tokens // args.chunk_tokens
    objects = n_chunks * args.layers * args.kv_heads
    capacity = f"{max(64, objects * 4096 * 2 // args.servers // (1 << 20) + 64)}MiB"   # a 64 B object: one page
    servers = [start_server(capacity=capacity) for _ in range(args.servers)]
    try:
        addrs = [s.address for s in servers]
        extra = {"servers": addrs, "chunk_tokens": args.chunk_tokens, "lookup_timeout_ms": 60_000}
        e = EngineKeys.for_model(extra, model="bench/llama-shape", dtype="torch.bfloat16", num_layers=args.layers,
                                 total_num_kv_heads=args.kv_heads, head_size=128, block_size=args.chunk_tokens,
                                 kv_cache_layout="LBHNC")
        scheds = {probe: SchedulerSide(parse_extra_config({**extra, "lookup_probe": probe}, "kv_both",
                                                          args.chunk_tokens),
                                       Client(addrs), e, args.chunk_tokens, Counters(), lambda: None)
                  for probe in (False, True)}
        tokens = list(range(n_chunks * args.chunk_tokens))
        print(f"shape: {args.layers} layers x {args.kv_heads} KV heads = {len(e.parts())} objects a chunk "
              f"(probe {len(e.probe_parts())}); prompt {len(tokens)} tokens = {n_chunks} chunks = {objects} objects; "
              f"{args.servers} native servers; {args.rounds} rounds")
        with Client(addrs) as c:
            held = 0
            for state, upto in (("miss", 0), ("half", n_chunks // 2), ("full", n_chunks)):
                if upto > held:
                    _store(c, e, prompt_keys(e, tokens), upto)
                    held = upto
                times: dict[bool, list[float]] = {False: [], True: []}
                answers: dict[bool, set[int]] = {False: set(), True: set()}
                for _ in range(args.rounds):
                    for probe, s in scheds.items():
                        t0 = time.perf_counter()
                        pk = prompt_keys(e, tokens)            # what the scheduler derives per request
                        answers[probe].add(s._lookup_all_parts(pk.chunk_keys, 30_000, pk.placement))
                        times[probe].append(time.perf_counter() - t0)
                load = open("/proc/loadavg").read().split()[:3]
                for probe in (False, True):
                    xs = times[probe]
                    print(f"{state:<5} held {upto:>5} chunks  lookup_probe={str(probe).lower():<5} "
                          f"median {statistics.median(xs) * 1e3:8.1f} ms  min {min(xs) * 1e3:8.1f} ms  "
                          f"answer {sorted(answers[probe])}  load {' '.join(load)}")
                med = {p: statistics.median(times[p]) for p in (False, True)}
                print(f"{state:<5} before/after {med[False] / med[True]:.1f}x")
                assert answers[False] == answers[True] == {upto}, answers
        for s in scheds.values():
            s.shutdown()
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
