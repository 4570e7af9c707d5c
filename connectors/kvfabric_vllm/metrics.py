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
it; the same numbers are logged at shutdown). ``take_interval()`` hands what
changed since its previous call to vLLM's KV-connector stats
(``kvfabric_vllm.stats``), so vLLM's own ``/metrics`` shows them. Names,
types and meanings are declared in ``kvfabric/metrics.py`` (``VLLM``).
"""

from __future__ import annotations

import logging
import threading
import weakref

from kvfabric.metrics import COUNTER, HISTOGRAM, VLLM, names

LOGGER_NAME = "vllm.kvfabric_vllm"
log = logging.getLogger(LOGGER_NAME)

#: Names and meanings are declared once, in kvfabric/metrics.py (VLLM); these are the counters.
COUNTER_NAMES: tuple[str, ...] = names(VLLM, COUNTER)
#: Timings observed per load / save job (seconds), reported through vLLM's KV-connector stats.
TIMING_NAMES: tuple[str, ...] = names(VLLM, HISTOGRAM)
#: Observations kept per timing between two reports (vLLM takes them every step); more are dropped.
MAX_OBSERVATIONS = 4096

_live: "weakref.WeakSet[Counters]" = weakref.WeakSet()
_lock = threading.Lock()


class Counters:
    """Thread-safe named counters with warn-once failure logging."""

    def __init__(self) -> None:
        self._values = dict.fromkeys(COUNTER_NAMES, 0)
        self._reported = dict.fromkeys(COUNTER_NAMES, 0)  # values at the last take_interval()
        self._timings: dict[str, list[float]] = {n: [] for n in TIMING_NAMES}
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

    def observe(self, name: str, seconds: float) -> None:
        """Record one timing (``TIMING_NAMES``); at most ``MAX_OBSERVATIONS`` are kept per interval."""
        with self._lock:
            obs = self._timings[name]
            if len(obs) < MAX_OBSERVATIONS:
                obs.append(float(seconds))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def take_interval(self) -> dict[str, int | list[float]]:
        """What changed since the previous call: counter increments (only those > 0) and the timings
        observed, which are handed over (the next call starts empty). Feeds vLLM's KV-connector stats."""
        with self._lock:
            out: dict[str, int | list[float]] = {
                k: v - self._reported[k] for k, v in self._values.items() if v != self._reported[k]}
            self._reported = dict(self._values)
            for k, obs in self._timings.items():
                if obs:
                    out[k] = obs
                    self._timings[k] = []
        return out


def all_counters() -> dict[str, int]:
    """Sum of the counters of every live connector instance in this process."""
    total = dict.fromkeys(COUNTER_NAMES, 0)
    with _lock:
        live = list(_live)
    for c in live:
        for k, v in c.snapshot().items():
            total[k] += v
    return total
