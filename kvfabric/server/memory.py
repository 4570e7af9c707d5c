"""Does a server of this ``--capacity`` fit in this host's memory? Checked once, at start-up.

What the server takes in DRAM (docs/notes/server.md has the measured bound):

* the arena, ``--capacity`` bytes: a memfd sized with ``ftruncate`` and mapped shared
  (csrc/kvf_store.c ``kvf_store_new``). That reserves nothing: pages are taken as they are first
  written, so an arena larger than the free memory is created without an error. Once the server
  answers, :class:`~kvfabric.server.native.NativeServer` faults the whole arena in, in the
  background (``MADV_POPULATE_WRITE``), so that PUTs do not pay page faults;
* the page allocator's map, 16 bytes per 4 KiB arena page (1/256 of the capacity; a quarter of it
  written at start-up, csrc/kvf_pages.c);
* a fixed part (interpreter, rings, event ring), ~48 MiB;
* the buffers bounded by ``--reply-budget`` and ``--request-budget``, and with a tier the staging
  queue bounded by ``--ssd-write-queue``; per stored object ~1 KiB and per open connection ~32 KiB
  come on top and are not known at start-up.
* with ``--kv-events``, the KV events publisher's rings, queue and replay buffer
  (:func:`kvfabric.server.kv_events.kv_events_bytes`, ~124 MiB at the defaults);
* with ``--metrics-port``, the metrics endpoint (:func:`metrics_bytes`): prometheus_client and the
  endpoint's serving thread, and per connection it serves at once (``--metrics-max-connections``;
  later ones are refused, kvfabric/server/httpd.py) a thread's touched stack, a request head of at
  most 16 KiB and one exposition being built (~15 KiB of text from the STATS map).

So there is nothing that fails for certain at start-up (the page map would need a 4 TiB host's
worth of capacity per GiB free), and the server is never refused: when the total is more than
:func:`available_memory` the server warns, starts, and does not fault the arena in ahead of use
(which would push the host into swap or the OOM killer at once rather than when the arena fills).
"""

from __future__ import annotations

from ..sizes import approx_size, format_size

#: Interpreter, io_uring rings, the event ring and the index's first buckets (docs/notes/server.md).
FIXED_BYTES = 48 << 20
#: A cgroup v1 "no limit" is a huge number rounded to the page size; anything above this is no limit.
_NO_LIMIT = 1 << 60


#: The metrics endpoint's fixed part: prometheus_client imported and its serving thread (measured
#: +1.5 MiB; docs/operations.md) ...
METRICS_FIXED_BYTES = 4 << 20
#: ... and per connection it serves at once (measured ~40 KiB with a 15 KiB half-sent head; a
#: scrape's STATS map, metric families and text are a few hundred KiB at most while it is built).
METRICS_CONN_BYTES = 256 << 10


def metrics_bytes(max_connections: int) -> int:
    """Bytes of DRAM the metrics endpoint holds at most with ``--metrics-max-connections``."""
    return METRICS_FIXED_BYTES + max_connections * METRICS_CONN_BYTES


def dram_needs(capacity: int, *, reply_budget: int, request_budget: int, tier_write_queue: int = 0,
               metrics_connections: int | None = None, kv_events: int = 0) -> int:
    """Bytes of DRAM a server holds at the configured bounds once its arena is full (objects and
    connections aside): arena + page map + fixed part + budgets + tier staging queue + the metrics
    endpoint's share (``metrics_connections``: its ``--metrics-max-connections``; None: no endpoint)
    + the KV events publisher's (``kv_events``: :func:`kvfabric.server.kv_events.kv_events_bytes`, 0 off)."""
    metrics = 0 if metrics_connections is None else metrics_bytes(metrics_connections)
    return (capacity + capacity // 256 + FIXED_BYTES + reply_budget + request_budget + tier_write_queue + metrics
            + kv_events)


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``),
    or None without one. A container sees its own limit at the root of its cgroup mount when the
    path in /proc/self/cgroup is the host's, so the root is tried after the path."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":
            candidates += [f"{root}{path.rstrip('/')}/memory.max", f"{root}/memory.max"]
        elif "memory" in controllers.split(","):
            candidates += [f"{root}/memory{path.rstrip('/')}/memory.limit_in_bytes",
                           f"{root}/memory/memory.limit_in_bytes"]
    for path in candidates:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        return None if limit >= _NO_LIMIT else limit
    return None


def available_memory() -> tuple[int, str] | None:
    """(bytes, where the figure is from): the smaller of MemAvailable and this process's cgroup
    memory limit; None when neither can be read (not Linux, no /proc)."""
    avail = _meminfo_available()
    limit = _cgroup_limit()
    if limit is not None and (avail is None or limit < avail):
        return limit, "the memory limit of this cgroup"
    if avail is not None:
        return avail, "MemAvailable in /proc/meminfo"
    return None


def over_memory_warning(capacity: int, needs: int, available: tuple[int, str] | None) -> str | None:
    """The start-up warning when ``needs`` (:func:`dram_needs`) is more than ``available``, else None."""
    if available is None or needs <= available[0]:
        return None
    avail, source = available
    return (f"--capacity {format_size(capacity)} plus {approx_size(needs - capacity)} of buffers needs "
            f"{approx_size(needs)} of memory, more than the {approx_size(avail)} available here ({source}). "
            f"The arena is reserved lazily, so the server starts, but once it holds about {approx_size(avail)} "
            "the host swaps or the OOM killer stops it; the arena is not faulted in ahead of use. "
            "Lower --capacity (or the budgets) to fit.")


__all__ = ["FIXED_BYTES", "METRICS_CONN_BYTES", "METRICS_FIXED_BYTES", "available_memory", "dram_needs",
           "metrics_bytes", "over_memory_warning"]
