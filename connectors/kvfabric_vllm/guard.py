"""Load only when it beats recompute (issue 26 part 3): the connector's running estimates and the decision.

A pool hit is worth loading only if loading its tokens is faster than computing them: a
throttled SSD tier, a far or congested server, or a pool shared by many engines can make a
hit slower than the engine's own prefill (users report disk-tier hits of 40 s against 0.9 s
of recompute). The scheduler side keeps two rates, both seconds per token, both
:class:`kvfabric.route.cost.Rate` (the router's estimator: an exponential moving average of
windows of at least ``min_tokens`` tokens):

* **load**: what an async load costs the request that waits for it, measured by the
  scheduler itself from the step that scheduled the load (``update_state_after_alloc``)
  to the step whose ``get_finished`` reported it (``update_connector_output``): the pool's
  reads, the copies, the loader thread's queue and the step granularity of the report, the
  time the request really waits in ``WAITING_FOR_REMOTE_KVS``. Loads in flight together
  share the clock (:class:`BusyClock`: seconds with at least one load in flight), so
  queued loads are not counted twice. Tokens are the ones scheduled to load, failed ones
  included (a load that times out counts its whole wait). **One estimate per medium**:
  the connector's lookup asks the pool where each object is (``Client.lookup_media``: the
  servers read nothing from their SSD tier for it, so a slow disk costs only the loads
  that read it), and a load that has any token on a server's SSD tier is an ``ssd`` load,
  the others ``dram`` loads; each kind has its own clock and rate (seconds per token over
  all its tokens: a load mixing both media is priced as an SSD one). Where the medium is
  unknown (a pool with ``replicas > 1``, whose presence comes from EXISTS) loads count as
  ``dram``. Sync loads (``load_async: false``) run inside the
  step and are not measured: the guard then never has a load rate and loads as before.
* **prefill**: seconds per locally computed prompt token, from the scheduler's own step
  clock: the time from one ``build_connector_meta`` (scheduling step N) to the next
  (scheduling step N+1), less the time the connector itself spent inside vLLM's scheduler
  meanwhile (``get_num_new_matched_tokens``' inline lookup waits, ``build_connector_meta``'s
  own work), charged to the prompt tokens step N computed. A step is counted only when it
  computed prompt tokens, planned no sync load and one of its requests was still
  unfinished at the next step (otherwise the engine may have idled between the two). The
  whole step is charged to its prompt tokens, decodes sharing it and vLLM's own scheduling
  and output processing included: recompute is overestimated, never underestimated, so the
  guard errs toward loading, today's behaviour. (vLLM schedules step N+1 after step N's
  sampled tokens reached the scheduler, so on a GPU the interval covers the kernels too;
  with async scheduling, which overlaps the two, it is not measured: not run here.)

Decision (:meth:`LoadGuard.plan`): once per lookup, for the tokens a hit would load beyond
vLLM's local hit, with the rate of the hit's kind (``ssd`` when any of them is on an SSD
tier). Until the prefill rate and that kind's load rate have a measured window it loads
everything, as before. Then it loads the leading tokens whose predicted load time is below
their predicted recompute time (:func:`leading_tokens_to_load`; with one rate for every
token that is all or nothing) and vLLM computes the rest; a cut load is counted
(``loads_skipped_slower``). A skipped load gives the load estimate no new sample, so a pool
that became fast again would never be seen: while loads of a kind are being skipped, one is
let through when that kind's last load sample is older than ``probe_s`` (and none of its
loads is in flight).

The rates compare what one request waits; they do not price what recompute costs the rest
of the batch (an async load leaves the engine free for other requests, a recompute
occupies it), so under a full batch the guard is conservative about skipping only through
the overestimated prefill rate above. Nothing here does I/O or reads a clock: callers pass
``now`` (``time.monotonic()``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvfabric.route.cost import Rate

__all__ = ["BusyClock", "LoadGuard", "MEDIA", "leading_tokens_to_load"]

#: the kinds of load the guard keeps a rate for: every token in DRAM, or some on an SSD tier
MEDIA = ("dram", "ssd")

#: a placeholder the Rates need; never used for a decision (``Rate.measured`` gates every use)
_UNUSED_PRIOR = 1.0


def leading_tokens_to_load(runs: Sequence[tuple[int, float]], prefill_s_per_token: float) -> int:
    """How many leading tokens to load: ``runs`` are the hit's tokens in prompt order as
    ``(tokens, load seconds per token)`` runs (one run per tier, where the pool says which
    tier holds them; one run today). Returns the length of the prefix that saves the most
    predicted time over recomputing it, ties going to the longer prefix (loading is the
    default); 0 when loading any prefix is predicted slower. Raises ValueError on negative
    token counts or non-finite / negative rates."""
    if not math.isfinite(prefill_s_per_token) or prefill_s_per_token < 0:
        raise ValueError(f"prefill_s_per_token must be finite and >= 0, got {prefill_s_per_token!r}")
    best_tokens, best_saving, tokens, saving = 0, 0.0, 0, 0.0
    for n, load_s in runs:
        if n < 0 or not math.isfinite(load_s) or load_s < 0:
            raise ValueError(f"a run needs tokens >= 0 and a finite rate >= 0, got ({n!r}, {load_s!r})")
        tokens += n
        saving += n * (prefill_s_per_token - load_s)
        if saving >= best_saving:
            best_tokens, best_saving = tokens, saving
    return best_tokens


class BusyClock:
    """Seconds during which at least one of possibly overlapping intervals was open."""

    def __init__(self) -> None:
        self.open = 0
        self.total = 0.0
        self._since = 0.0

    def _advance(self, now: float) -> None:
        if self.open:
            self.total += max(0.0, now - self._since)
        self._since = now

    def start(self, now: float) -> None:
        self._advance(now)
        self.open += 1

    def stop(self, now: float) -> None:
        if self.open <= 0:
            raise ValueError("BusyClock.stop without a matching start")
        self._advance(now)
        self.open -= 1


class _LoadKind:
    """One kind of load's (``dram`` or ``ssd``) clock, token count and rate."""

    def __init__(self, min_tokens: int) -> None:
        self.rate = Rate(_UNUSED_PRIOR, min_tokens=min_tokens)
        self.rate.observe(0.0, 0)        # the counters start at zero: the first window starts now
        self.clock = BusyClock()
        self.tokens = 0
        self.in_flight = 0
        self.last_at: float | None = None  # when a load of this kind last reported


class LoadGuard:
    """The scheduler side's rates (prefill; load per medium) and the per-lookup decision (module
    docstring).

    Not thread-safe: vLLM calls the scheduler side from its one scheduler thread."""

    def __init__(self, *, min_tokens: int, probe_s: float, enabled: bool = True) -> None:
        if type(min_tokens) is not int or min_tokens < 1:
            raise ValueError(f"min_tokens must be an int >= 1, got {min_tokens!r}")
        if not math.isfinite(probe_s) or probe_s <= 0:
            raise ValueError(f"probe_s must be finite and > 0, got {probe_s!r}")
        self.enabled = enabled
        self.probe_s = probe_s
        self.kinds = {m: _LoadKind(min_tokens) for m in MEDIA}
        self.prefill = Rate(_UNUSED_PRIOR, min_tokens=min_tokens)
        self.prefill.observe(0.0, 0)
        self._loading: dict[str, tuple[int, str]] = {}  # req_id -> (tokens, kind) of its load in flight
        self._prefill_s = 0.0
        self._prefill_tokens = 0
        # the last step: when its scheduling ended, its prompt tokens, whether it may be counted,
        # and its requests still unfinished
        self._step_at: float | None = None
        self._step_tokens = 0
        self._step_countable = False
        self._step_reqs: set[str] = set()
        self._inline_s = 0.0                    # connector time inside scheduling since the last step

    # ------------------------------------------------------------------ measurements

    @property
    def load(self) -> Rate:
        """The ``dram`` loads' rate (every token of the load in DRAM, or the medium unknown)."""
        return self.kinds["dram"].rate

    @property
    def load_ssd(self) -> Rate:
        """The ``ssd`` loads' rate (some token of the load on a server's SSD tier)."""
        return self.kinds["ssd"].rate

    def load_started(self, req_id: str, tokens: int, now: float, kind: str = "dram") -> None:
        """An async load of ``tokens`` was scheduled for ``req_id``; ``kind``: ``ssd`` when some of
        them are on an SSD tier (:data:`MEDIA`)."""
        if kind not in self.kinds:
            raise ValueError(f"kind must be one of {MEDIA}, got {kind!r}")
        if req_id in self._loading:            # vLLM never schedules two loads of one request at once
            self.load_finished(req_id, now)
        k = self.kinds[kind]
        k.clock.start(now)
        k.in_flight += 1
        self._loading[req_id] = (tokens, kind)

    def load_finished(self, req_id: str, now: float) -> None:
        """``req_id``'s load reported done (or failed); unknown ids are ignored."""
        entry = self._loading.pop(req_id, None)
        if entry is None:
            return
        tokens, kind = entry
        k = self.kinds[kind]
        k.clock.stop(now)
        k.in_flight -= 1
        k.tokens += tokens
        k.last_at = now
        k.rate.observe(k.clock.total, k.tokens)

    def inline(self, seconds: float) -> None:
        """The connector spent ``seconds`` inside vLLM's scheduling (not the engine's step time)."""
        self._inline_s += max(0.0, seconds)

    def step(self, now: float, prompt_tokens: int, req_ids: Iterable[str], countable: bool = True) -> None:
        """Step N+1 is being scheduled (``build_connector_meta`` at ``now``): step N's time, less the
        connector's inline time, is charged to its prompt tokens if it may be counted; then step N+1
        becomes the one timed. ``prompt_tokens``: the prompt tokens step N+1 computes;
        ``req_ids``: its requests; ``countable`` False: it loads synchronously (its time is not
        prefill)."""
        if (self._step_at is not None and self._step_countable and self._step_tokens > 0
                and self._step_reqs):
            dt = now - self._step_at - self._inline_s
            if dt > 0:
                self._prefill_s += dt
                self._prefill_tokens += self._step_tokens
                self.prefill.observe(self._prefill_s, self._prefill_tokens)
        self._step_at, self._step_tokens, self._step_countable = now, prompt_tokens, countable
        self._step_reqs = set(req_ids) if prompt_tokens > 0 else set()
        self._inline_s = 0.0

    def finished(self, req_id: str) -> None:
        """``req_id`` finished: if every request of the last step finished, the engine may idle
        before the next step, which is then not counted."""
        self._step_reqs.discard(req_id)

    # ------------------------------------------------------------------ decision

    @property
    def measured(self) -> bool:
        """The prefill rate and the ``dram`` load rate have a measured window."""
        return self.load.measured and self.prefill.measured

    def plan(self, tokens: int, now: float, ssd_tokens: int = 0) -> int | None:
        """Tokens of a ``tokens``-token hit to load, ``ssd_tokens`` of which are on an SSD tier;
        None when the guard did not weigh it (off, or the prefill rate or this kind's load rate
        without a measured window yet: load everything, as before)."""
        k = self.kinds["ssd" if ssd_tokens > 0 else "dram"]
        if not self.enabled or tokens <= 0 or not (k.rate.measured and self.prefill.measured):
            return None
        keep = leading_tokens_to_load([(tokens, k.rate.value)], self.prefill.value)
        if keep < tokens and not k.in_flight and (k.last_at is None or now - k.last_at >= self.probe_s):
            return tokens                      # a probe: this kind's rate is old, measure it again
        return keep

    def totals(self, kind: str) -> tuple[float, int]:
        """``kind``'s loads so far: (seconds with one in flight, tokens); both only grow."""
        k = self.kinds[kind]
        return k.clock.total, k.tokens

    @staticmethod
    def kind(ssd_tokens: int | None) -> str:
        """The kind of a load with ``ssd_tokens`` on an SSD tier (None: unknown, counted as ``dram``)."""
        return "ssd" if ssd_tokens else "dram"

    def to_json(self) -> dict:
        return {"load_s_per_token": self.load.value if self.load.measured else None,
                "load_ssd_s_per_token": self.load_ssd.value if self.load_ssd.measured else None,
                "prefill_s_per_token": self.prefill.value if self.prefill.measured else None}
