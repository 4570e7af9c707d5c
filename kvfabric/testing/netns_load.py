"""A load-generating client process for the network-namespace tests (``python -m kvfabric.testing.netns_load``).

Runs inside its own namespace (:meth:`kvfabric.testing.netns.NetLab.start_load`), follows a cluster in etcd
and runs a read-through workload until told to stop: rounds of GET ``--batch`` keys drawn from ``--keys``
keys (every value checked byte for byte against what this process put), PUT of the misses, and a LOOKUP.
Every ``--report-s`` it prints one JSON line: ``rounds``, ``errors`` (client calls that raised: must stay
0), ``first_error``, ``wrong`` (values with wrong bytes: must stay 0), ``members`` (the ids it routes over),
``hit_rate`` (of the GETs since the previous line). On ``stop`` on stdin (or EOF) it stops the load, then
checks recovery and prints a last line with ``"final": true``: ``recovered_hit_rate`` (GET of the whole key
set, before any re-put), then PUTs the misses and GETs everything again: ``after_put_hit_rate``, with
``wrong`` counted throughout. Exits 0 (the caller judges the numbers).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading

from ..client import Client
from ..config import ClientConfig


def _value(seed: int, key: bytes) -> bytes:
    return key * 4 + seed.to_bytes(4, "little") + key[::-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.testing.netns_load")
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--report-s", type=float, default=0.2)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    keys = [rng.randbytes(16) for _ in range(args.keys)]
    cfg = ClientConfig(transport="tcp", timeout_s=args.timeout_s, connect_timeout_s=min(0.5, args.timeout_s))
    client = Client(etcd=args.etcd, cluster=args.cluster, config=cfg)
    stop = threading.Event()
    lock = threading.Lock()
    state = {"rounds": 0, "errors": 0, "first_error": None, "wrong": 0, "hits": 0, "gets": 0}

    def check(batch: list[bytes], got: list[bytes | None]) -> list[bytes]:
        wrong = sum(1 for k, v in zip(batch, got) if v is not None and v != _value(args.seed, k))
        with lock:
            state["wrong"] += wrong
        return [k for k, v in zip(batch, got) if v is None]

    def load() -> None:
        while not stop.is_set():
            batch = rng.sample(keys, args.batch)
            try:
                miss = check(batch, client.get(batch))
                if miss:
                    client.put(miss, [_value(args.seed, k) for k in miss])
                client.lookup(batch)
            except Exception as e:  # any exception out of the client is what the tests look for
                with lock:
                    state["errors"] += 1
                    state["first_error"] = state["first_error"] or f"{type(e).__name__}: {e}"
                continue
            with lock:
                state["rounds"] += 1
                state["hits"] += len(batch) - len(miss)
                state["gets"] += len(batch)

    def emit(**extra) -> None:
        with lock:
            line = dict(state, members=sorted(client.members), **extra)
            line["hit_rate"] = state["hits"] / state["gets"] if state["gets"] else None
            state["hits"] = state["gets"] = 0
        print(json.dumps(line), flush=True)

    def reader() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    threading.Thread(target=reader, daemon=True).start()
    while not stop.wait(args.report_s):
        emit()
    t.join()
    emit()
    try:
        got = client.get(keys, timeout_s=10 * args.timeout_s)
        miss = check(keys, got)
        recovered = 1 - len(miss) / len(keys)
        client.put(miss, [_value(args.seed, k) for k in miss], timeout_s=10 * args.timeout_s)
        after = 1 - len(check(keys, client.get(keys, timeout_s=10 * args.timeout_s))) / len(keys)
    except Exception as e:
        with lock:
            state["errors"] += 1
            state["first_error"] = state["first_error"] or f"{type(e).__name__}: {e}"
        recovered = after = None
    emit(final=True, recovered_hit_rate=recovered, after_put_hit_rate=after,
         client_stats={k: v for k, v in client.stats()["client"].items() if isinstance(v, int)})
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
