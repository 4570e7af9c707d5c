"""``kvfabric bench placement``: hit rate with one server SIGKILLed, per placement of a chunk's layer objects.

Issue 23. A real trace is replayed through the vLLM connector's object layout
(``kvfabric_vllm.layout``: one pool object per (chunk, layer), ``--layers``
16 by default, keys chunk-major) against ``N`` real ``kvfabric serve``
processes (``--sizes`` 4 and 8), each in its own network namespace on a
private bridge (:mod:`kvfabric.testing.netns`; root and ``ip`` needed, else
on loopback, said in the report), once per placement:

* ``object``: every layer object routed by its own key (the layout before
  issue 23, ``segment_chunks: 0``);
* ``chunk``: a chunk's objects placed by the chunk key (``segment_chunks: 1``);
* ``segM``: runs of M consecutive chunks placed by their first chunk's key
  (``segment_chunks: M``; ``--segments``, default 4, 16, 64);

and per ``--replicas`` (1, 2). One trace block (512 tokens in the Mooncake
traces) is one chunk. Each request: LOOKUP its objects (with their placement
and groups, as the connector's scheduler does), count the leading whole
chunks found, PUT the rest (as the connector's workers do; values of
``--value-bytes``). The first ``--warm`` fraction of the requests fills the
pool; the rest is measured: once on healthy servers and, on fresh servers
replaying the same warm-up, once per victim with that server SIGKILLed when
the measured part starts (``--victims``: how many of the N servers are each
killed in turn, default all N, for replicas 1 and chunk or segment placement;
``--few-victims``, default 1, for replicas 2, where one dead server costs
about nothing, and for object placement, where it costs about everything;
reported: the mean over victims, and the worst). Server capacity holds everything the replay stores (the hit rate
measures placement, not eviction).

Also per placement, on the healthy servers: bytes per server (STATS
``bytes_used``, max / mean over the servers), LOOKUP requests per prompt, and
the GET of one long prompt (``--long-tokens``, default 120,000 tokens, its
objects ``--long-object-bytes`` each, scaled down from a real model's; the
connector's one ``get_into`` per load, median of ``--reps``); in the killed
runs, the fraction of that long prompt still loadable (its leading run).

Before each case the memory its servers will use (~3 pages per stored
small object) is checked against MemAvailable: a case over ``--max-memory``
of it is skipped and listed with the reason. Prints a table; writes JSON
(``--out``, default bench-results/placement.json). Exit status 2 on bad
arguments or an unreadable trace.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import write_json
from .traces import TraceError, block_keys, load_trace

PAGE = 4096  # the server's allocation unit: what a small object costs it at least
#: Memory a server uses per stored small object, in pages: measured ~11 KB of RSS per 64-byte object
#: (its arena page, index and bookkeeping), so the check before a case counts 3 pages each.
RSS_PAGES_PER_OBJECT = 3
LONG_SALT = 0x10C6


@dataclass
class _Prompt:
    """One request as the connector stores it: object keys chunk-major, per-object placement and group."""

    chunks: int
    objects: list[bytes]
    placement: list[bytes] | None
    groups: list[bytes] | None


def _layout(segment: int) -> str:
    return {0: "object", 1: "chunk"}.get(segment, f"seg{segment}")


def parse_layouts(text: str) -> list[int]:
    """``object,chunk,seg16`` -> segment sizes ``[0, 1, 16]`` (``segment_chunks`` values)."""
    out = []
    for name in text.split(","):
        name = name.strip()
        if name == "object":
            out.append(0)
        elif name == "chunk":
            out.append(1)
        elif name.startswith("seg") and name[3:].isdigit() and int(name[3:]) >= 1:
            out.append(int(name[3:]))
        else:
            raise ValueError(f"unknown placement {name!r} (object, chunk or segM)")
    return out


class _Keys:
    """Object keys of chunk keys, computed once per chunk (the connector's ``layer_keys``)."""

    def __init__(self, layers: int) -> None:
        from kvfabric import KeyHasher
        from kvfabric_vllm.layout import layer_keys

        self.layers = layers
        self._hasher = KeyHasher()
        self._layer_keys = layer_keys
        self._cache: dict[bytes, list[bytes]] = {}

    def prompt(self, chunk_keys: Sequence[bytes], segment: int) -> _Prompt:
        from kvfabric_vllm.layout import chunk_placement, object_placement

        objs: list[bytes] = []
        for k in chunk_keys:
            got = self._cache.get(k)
            if got is None:
                got = self._cache[k] = self._layer_keys(self._hasher, k, self.layers)
            objs.extend(got)
        place, groups = object_placement(chunk_keys, chunk_placement(chunk_keys, segment), self.layers)
        return _Prompt(len(chunk_keys), objs, place, groups)


class _Lab:
    """N servers, fresh ones per run: in network namespaces when possible, else on loopback."""

    def __init__(self, n: int, capacity: int, netns: bool) -> None:
        self.n = n
        self.capacity = capacity
        self.lab = None
        if netns:
            from ..testing.netns import NetLab

            self.lab = NetLab(n)
        self.servers: list[Any] = []

    @property
    def where(self) -> str:
        return "netns" if self.lab is not None else "loopback"

    def start(self) -> list[str]:
        self.stop()
        cap = str(self.capacity)
        if self.lab is not None:
            from ..testing.netns import start_server_in

            # the same port every run: the same server ids, so the same owners in every run
            self.servers = [start_server_in(self.lab, i, capacity=cap, port=7070) for i in range(self.n)]
        else:
            from ..testing.servers import start_pool

            self.servers = list(start_pool(self.n, capacity=cap))
        return [f"{s.host}:{s.port}" for s in self.servers]

    def stop(self) -> None:
        for s in self.servers:
            s.kill()
        self.servers = []

    def close(self) -> None:
        self.stop()
        if self.lab is not None:
            self.lab.close()


def _client(addresses: list[str], replicas: int, timeout_s: float):
    from .. import Client, ClientConfig

    return Client(addresses, config=ClientConfig(replicas=replicas, timeout_s=timeout_s, connect_timeout_s=2.0))


def _replay(client, prompts: Sequence[_Prompt], value: bytes, layers: int, timeout_s: float) -> tuple[int, int]:
    """Lookup, then put what was not found, per prompt (the connector's scheduler and workers);
    returns (chunks hit, chunks asked)."""
    hit = total = 0
    for p in prompts:
        run = client.lookup(p.objects, placement=p.placement, groups=p.groups, timeout_s=timeout_s) // layers
        hit += run
        total += p.chunks
        if run < p.chunks:
            rest = slice(run * layers, None)
            client.put(p.objects[rest], [value] * (len(p.objects) - run * layers), timeout_s=timeout_s,
                       placement=None if p.placement is None else p.placement[rest],
                       groups=None if p.groups is None else p.groups[rest])
    return hit, total


def _lookup_requests(client, prompts: Sequence[_Prompt], timeout_s: float) -> float:
    """Mean LOOKUP requests a prompt's lookup sends (client counter), over ``prompts``."""
    before = client.stats()["client"]["requests"]
    for p in prompts:
        client.lookup(p.objects, placement=p.placement, groups=p.groups, timeout_s=timeout_s)
    return (client.stats()["client"]["requests"] - before) / max(1, len(prompts))


def _long_get(client, p: _Prompt, object_bytes: int, reps: int, timeout_s: float) -> tuple[float, int]:
    """Median seconds of one ``get_into`` of the whole long prompt, and the objects found."""
    bufs = [bytearray(object_bytes) for _ in p.objects]
    times, found = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        sizes = client.get_into(p.objects, bufs, placement=p.placement, timeout_s=timeout_s)
        times.append(time.perf_counter() - t0)
        found = sum(s is not None for s in sizes)
    return statistics.median(times), found


def _bytes_used(client) -> list[int]:
    return [s.get("bytes_used", 0) for s in client.stats()["servers"].values() if "error" not in s]


def run_case(lab: _Lab, prompts: list[_Prompt], long_prompt: _Prompt, args, replicas: int, victim: int | None,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """One fresh replay: warm-up, then (victim SIGKILLed, or healthy) the measured part."""
    addrs = lab.start()
    warm = int(len(prompts) * args.warm)
    value = bytes(args.value_bytes)
    long_value = bytes(args.long_object_bytes)
    out: dict[str, Any] = {}
    with _client(addrs, replicas, args.timeout_s) as c:
        _replay(c, prompts[:warm], value, args.layers, args.timeout_s)
        lp = long_prompt
        res = c.put(lp.objects, [long_value] * len(lp.objects), placement=lp.placement, groups=lp.groups,
                    timeout_s=args.timeout_s)
        out["long_put_dropped"] = res.dropped
        if victim is not None:
            lab.servers[victim].kill()  # SIGKILL, reaped
        t0 = time.perf_counter()
        hit, total = _replay(c, prompts[warm:], value, args.layers, args.timeout_s)
        out["replay_s"] = round(time.perf_counter() - t0, 2)
        out.update(hit_chunks=hit, chunks=total, hit_rate=hit / max(1, total))
        out["long_run"] = c.lookup(lp.objects, placement=lp.placement, groups=lp.groups,
                                   timeout_s=args.timeout_s) / len(lp.objects)
        if victim is None:
            used = _bytes_used(c)
            out["bytes_max"], out["bytes_mean"] = max(used), statistics.mean(used)
            out["lookup_requests"] = _lookup_requests(c, prompts[warm: warm + 50], args.timeout_s)
            out["long_get_s"], found = _long_get(c, lp, args.long_object_bytes, args.reps, args.timeout_s)
            out["long_get_found"] = found / len(lp.objects)
    lab.stop()
    progress(f"  {'healthy' if victim is None else f'victim {victim}'}: hit {out['hit_rate']:.3f} "
             f"({out['replay_s']} s)")
    return out


def _stored_bytes(prompts: list[_Prompt], long_prompt: _Prompt, args, replicas: int) -> tuple[int, int]:
    """(arena bytes the replay stores over all servers, every replica: a small object takes a page;
    the memory the servers then use, ``RSS_PAGES_PER_OBJECT`` pages per object at least)."""
    unique = len({k for p in prompts for k in p.objects})
    per = max(PAGE, -(-args.value_bytes // PAGE) * PAGE)
    long_per = -(-args.long_object_bytes // PAGE) * PAGE
    n_long = len(long_prompt.objects)
    stored = (unique * per + n_long * long_per) * replicas
    rss = (unique * max(per, RSS_PAGES_PER_OBJECT * PAGE) + n_long * (long_per + 2 * PAGE)) * replicas
    return stored, rss


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _capacity(need: int) -> int:
    """Per server: room for everything the replay stores, so nothing is evicted (arenas fill lazily:
    the servers together use about ``need``, however it is spread)."""
    return int(need * 1.25) + (64 << 20)


def run(args) -> dict[str, Any]:
    from ..testing.netns import missing_reason

    why = missing_reason() if args.lab != "loopback" else "--lab loopback"
    if args.lab == "netns" and why:
        raise SystemExit(f"kvfabric bench placement: --lab netns unavailable: {why}")
    netns = why is None
    keys = _Keys(args.layers)
    report: dict[str, Any] = {
        "lab": "netns" if netns else f"loopback ({why})", "layers": args.layers, "warm": args.warm,
        "value_bytes": args.value_bytes, "long_tokens": args.long_tokens, "long_object_bytes": args.long_object_bytes,
        "chunk_tokens": None, "results": [], "skipped": [],
    }
    for trace_name in args.traces:
        trace = load_trace(trace_name, limit=args.limit)
        block_tokens = trace.block_tokens
        report["chunk_tokens"] = block_tokens
        n_long = -(-args.long_tokens // block_tokens)
        long_chunks = block_keys(range(n_long), salt=LONG_SALT)
        chunk_lists = [block_keys(r.hash_ids, salt=args.salt) for r in trace]
        for n in args.sizes:
            for segment in args.layouts:
                prompts = [keys.prompt(cl, segment) for cl in chunk_lists]
                long_prompt = keys.prompt(long_chunks, segment)
                for replicas in args.replicas:
                    if replicas > n:
                        continue
                    need, rss = _stored_bytes(prompts, long_prompt, args, replicas)
                    avail = _mem_available()
                    name = f"{trace_name} N={n} {_layout(segment)} replicas={replicas}"
                    if avail is not None and rss > avail * args.max_memory:
                        why = (f"the servers would use about {rss >> 20} MiB for what the replay stores, over "
                               f"{args.max_memory:.0%} of the {avail >> 20} MiB available now; lower --limit")
                        print(f"{name}: skipped: {why}", file=sys.stderr, flush=True)
                        report["skipped"].append({"trace": trace_name, "servers": n, "placement": _layout(segment),
                                                  "replicas": replicas, "why": why})
                        continue
                    lab = _Lab(n, _capacity(need), netns)
                    print(f"{name} ({lab.where})", file=sys.stderr, flush=True)
                    try:
                        healthy = run_case(lab, prompts, long_prompt, args, replicas, None, _progress)
                        few = replicas > 1 or segment == 0  # a dead server costs ~nothing, or ~everything
                        killed = [run_case(lab, prompts, long_prompt, args, replicas, v, _progress)
                                  for v in range(min(args.few_victims if few else args.victims, n))]
                    finally:
                        lab.close()
                    rates = [k["hit_rate"] for k in killed]
                    report["results"].append({
                        "trace": trace_name, "servers": n, "placement": _layout(segment), "segment_chunks": segment,
                        "replicas": replicas, "healthy": healthy, "killed": killed,
                        "hit_healthy": healthy["hit_rate"],
                        "hit_killed_mean": statistics.mean(rates) if rates else None,
                        "hit_killed_worst": min(rates) if rates else None,
                        "target_killed": (healthy["hit_rate"] * (n - 1) / n - 0.05) if replicas == 1
                        else healthy["hit_rate"] - 0.02,
                        "long_run_killed_mean": statistics.mean(k["long_run"] for k in killed) if killed else None,
                    })
    return report


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def print_table(report: dict[str, Any]) -> None:
    print(f"lab: {report['lab']}; {report['layers']} layer objects per chunk of {report['chunk_tokens']} tokens; "
          f"long prompt {report['long_tokens']} tokens, {report['long_object_bytes']} B objects")
    head = (f"{'trace':<22} {'N':>2} {'placement':<9} {'rep':>3} {'hit healthy':>11} {'killed mean':>11} "
            f"{'worst':>6} {'target':>6} {'long run':>8} {'bytes max/mean':>14} {'lookup req':>10} {'long GET ms':>11}")
    print(head)
    for r in report["results"]:
        h = r["healthy"]
        print(f"{r['trace']:<22} {r['servers']:>2} {r['placement']:<9} {r['replicas']:>3} {r['hit_healthy']:>11.3f} "
              f"{_f(r['hit_killed_mean']):>11} {_f(r['hit_killed_worst']):>6} {_f(r['target_killed']):>6} "
              f"{_f(r['long_run_killed_mean']):>8} {h['bytes_max'] / max(1, h['bytes_mean']):>14.2f} "
              f"{h['lookup_requests']:>10.1f} {h['long_get_s'] * 1000:>11.1f}")
    for r in report["skipped"]:
        print(f"{r['trace']:<22} {r['servers']:>2} {r['placement']:<9} {r['replicas']:>3} skipped: {r['why']}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench placement", description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=lambda s: s.split(","), default=["mooncake-conversation", "mooncake-synthetic"])
    ap.add_argument("--limit", type=int, default=400,
                    help="requests of each trace replayed (default 400: ~150k objects, ~1.7 GiB of server memory "
                         "per replica)")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    ap.add_argument("--layouts", type=parse_layouts, default=[0, 1, 4, 16, 64],
                    help="comma list of object, chunk, segM (default object,chunk,seg4,seg16,seg64)")
    ap.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--layers", type=int, default=16, help="layer objects per chunk (default 16)")
    ap.add_argument("--victims", type=int, default=99,
                    help="servers killed in turn, one per run, for replicas=1 and chunk or segment placement "
                         "(default all)")
    ap.add_argument("--few-victims", type=int, default=1,
                    help="the same for replicas > 1 and for object placement (default 1)")
    ap.add_argument("--warm", type=float, default=0.5, help="fraction of the requests replayed before the kill")
    ap.add_argument("--value-bytes", type=int, default=64, help="bytes per replayed object (default 64)")
    ap.add_argument("--long-tokens", type=int, default=120_000)
    ap.add_argument("--long-object-bytes", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3, help="GETs of the long prompt, median (default 3)")
    ap.add_argument("--max-memory", type=float, default=0.3,
                    help="refuse a case whose servers would use more than this fraction of MemAvailable "
                         "(default 0.3)")
    ap.add_argument("--lab", choices=["auto", "netns", "loopback"], default="auto")
    ap.add_argument("--salt", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--out", default="bench-results/placement.json")
    args = ap.parse_args(argv)
    if (args.limit < 2 or args.layers < 1 or not 0 < args.warm < 1 or args.value_bytes < 1 or args.victims < 0
            or args.few_victims < 0 or not 0 < args.max_memory <= 1
            or args.long_tokens < 1 or args.long_object_bytes < 1 or args.reps < 1
            or any(n < 1 for n in args.sizes) or any(r < 1 for r in args.replicas)):
        ap.error("bad arguments")
    try:
        report = run(args)
    except TraceError as e:
        print(f"kvfabric bench placement: {e}", file=sys.stderr)
        return 2
    print_table(report)
    write_json(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
