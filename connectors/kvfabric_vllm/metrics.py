"""Counters of the vLLM connector and the warn-once logger.

Every failure the connector absorbs (it never lets one reach vLLM's step)
goes through :func:`Counters.fail`: the counter goes up every time, the
warning is logged only the first time for that counter in this process, so a
dead pool does not flood the log.

The logger is ``vllm.kvfabric_vllm``: under vLLM's ``vllm`` logger, so
vLLM's logging setup (handler, format, ``VLLM_LOGGING_LEVEL``) prints the
connector's INFO lines with its own (vLLM's ``init_logger`` convention,
without importing vLLM here).

Counters are per connector instance; ``all_counters()`` sums the live
instances of this process (tests with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` read
it; the same numbers are logged at shutdown).
"""

from __future__ import annotations

import logging
import threading
import weakref

LOGGER_NAME = "vllm.kvfabric_vllm"
log = logging.getLogger(LOGGER_NAME)

COUNTER_NAMES = (
    # scheduler side
    "lookups",            # pool lookups started (one per request, again after each preemption)
    "relookups",          # of which after a preemption
    "lookup_timeouts",    # lookups that missed their deadline (answered "no hit")
    "lookup_errors",      # lookups that raised (answered "no hit")
    "lookup_hit_tokens",  # loadable tokens the pool held beyond vLLM's local hit, once per lookup
    "scheduled_load_tokens",  # tokens vLLM accepted to load from the pool
    "save_known_chunks",  # prompt chunks not saved because the lookup found them in the pool
    "save_unchecked_jobs",  # saves sent before their lookup answered (may re-send held chunks)
    "pd_waits",           # PD consumer: requests that found fewer chunks than the producer reported, and waited
    "pd_relookups",       # PD consumer: lookups repeated while waiting for the producer's chunks
    "pd_wait_timeouts",   # PD consumer: waits that ran out (pd_wait_ms); the missing chunks are recomputed
    "held_requests",      # finished requests whose blocks are kept until their saves are acknowledged
    # worker side
    "load_chunks",        # chunks copied into paged KV blocks
    "load_tokens",        # tokens copied into paged KV blocks
    "load_failed_chunks",  # chunks that missed / were malformed -> recomputed
    "load_errors",        # whole load steps that raised -> recomputed
    "async_loads",        # loads run between steps (load_kv_async)
    "save_jobs",          # put jobs queued (one per request per step that completed chunks)
    "save_jobs_done",     # put jobs finished, whatever their outcome (== save_jobs: nothing in flight)
    "save_chunks",        # chunks handed to the pool (stored or already there)
    "save_dropped_chunks",  # chunks the pool did not take (down, full, slow)
    "save_skipped_chunks",  # chunks not even sent (pending-save bound reached)
    "save_errors",        # save jobs that raised
    "held_released",      # of held_requests: reported in get_finished's finished_sending (blocks freed)
    "save_abandoned_jobs",  # save jobs still queued or running when the shutdown drain bound ran out
    "client_errors",      # the kvfabric client could not be built (pool off)
)

_live: "weakref.WeakSet[Counters]" = weakref.WeakSet()
_lock = threading.Lock()


class Counters:
    """Thread-safe named counters with warn-once failure logging."""

    def __init__(self) -> None:
        self._values = dict.fromkeys(COUNTER_NAMES, 0)
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        with _lock:
            _live.add(self)

    def add(self, name: str, n: int = 1) -> None:
        if name not in self._values:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self._values[name] += n

    def fail(self, name: str, message: str, *args: object, n: int = 1, exc: BaseException | None = None) -> None:
        """Count a failure; log ``message`` as a warning the first time ``name`` fails."""
        self.add(name, n)
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        if first:
            log.warning("kvfabric: " + message + " (recomputing; further %s are counted, not logged)",
                        *args, name, exc_info=exc)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def all_counters() -> dict[str, int]:
    """Sum of the counters of every live connector instance in this process."""
    total = dict.fromkeys(COUNTER_NAMES, 0)
    with _lock:
        live = list(_live)
    for c in live:
        for k, v in c.snapshot().items():
            total[k] += v
    return total
