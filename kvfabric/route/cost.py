"""The router's cost model: the predicted time to first token of one prompt on one instance.

For a prompt of ``P`` tokens an instance holds ``L`` leading tokens in its own prefix cache (its KV
events) and the pool ``K`` leading tokens (a LOOKUP of the prompt's chunk keys), ``S`` of them in
chunks with an object only on a server's SSD tier::

    from_cache  = L                                   free: already in the engine's KV cache
    from_pool   = max(0, K - L)                       loaded by the connector
    from_ssd    = min(S, from_pool)                   of those, read from a disk
    recompute   = P - from_cache - from_pool          prefilled
    ttft        = (queued_tokens + recompute) * prefill_s_per_token
                  + (from_pool - from_ssd) * load_s_per_token + from_ssd * load_ssd_s_per_token
                  + running * decode_s_per_running

(Where in the run the SSD chunks are is not known: ``from_ssd`` assumes they are among the tokens
loaded, the dearer guess.)

``queued_tokens`` is the prefill work ahead of the prompt: the tokens the router sent to the
instance that have not produced their first token yet, plus, for requests of other clients (vLLM's
``num_requests_waiting`` beyond the router's own at the last poll), the instance's mean prompt each.
``running * decode_s_per_running`` charges the decode batch the prompt's prefill shares steps with
(the router's requests in flight plus other clients' running ones). The per-instance rates are measured
(:class:`Rate`: vLLM's ``/metrics``: prefill seconds per computed prompt token, the kvfabric
connector's load seconds per loaded token; its SSD loads' own, ``vllm:kvfabric_ssd_load_us_total``
over ``vllm:kvfabric_ssd_load_tokens_total``, where the connector's load guard measured some, else the
load rate), starting from configured priors until enough has been seen. Nothing here does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Prediction:
    """One instance's predicted TTFT for one prompt, and its parts (tokens and seconds)."""

    ttft_s: float
    from_cache: int
    from_pool: int
    recompute: int
    queue_s: float
    from_ssd: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


def predict(prompt_tokens: int, cached_tokens: int, pool_tokens: int, *, queued_tokens: float, running: float,
            prefill_s_per_token: float, load_s_per_token: float, decode_s_per_running: float,
            loads_from_pool: bool = True, pool_ssd_tokens: int = 0,
            load_ssd_s_per_token: float | None = None) -> Prediction:
    """The module docstring's formula; ``loads_from_pool`` False (a PD producer) counts the pool's tokens
    as recomputed; ``load_ssd_s_per_token`` None prices SSD tokens at ``load_s_per_token``. Token counts
    are clipped to the prompt; negative or non-finite inputs raise ValueError."""
    ssd_rate = load_s_per_token if load_ssd_s_per_token is None else load_ssd_s_per_token
    for name, v in (("queued_tokens", queued_tokens), ("running", running), ("prefill_s_per_token",
                    prefill_s_per_token), ("load_s_per_token", load_s_per_token),
                    ("load_ssd_s_per_token", ssd_rate), ("decode_s_per_running", decode_s_per_running)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    if prompt_tokens < 0 or cached_tokens < 0 or pool_tokens < 0 or pool_ssd_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prompt_tokens}, {cached_tokens}, {pool_tokens}, "
                         f"{pool_ssd_tokens}")
    from_cache = min(cached_tokens, prompt_tokens)
    from_pool = max(0, min(pool_tokens, prompt_tokens) - from_cache) if loads_from_pool else 0
    from_ssd = min(pool_ssd_tokens, from_pool)
    recompute = prompt_tokens - from_cache - from_pool
    queue_s = queued_tokens * prefill_s_per_token + running * decode_s_per_running
    ttft = (queue_s + recompute * prefill_s_per_token + (from_pool - from_ssd) * load_s_per_token
            + from_ssd * ssd_rate)
    return Prediction(ttft, from_cache, from_pool, recompute, queue_s, from_ssd)


class Rate:
    """A per-token rate measured from two monotonically growing counters (seconds, tokens).

    ``observe(seconds_total, tokens_total)`` takes the counters' current values; once at least
    ``min_tokens`` new tokens were counted since the last update, the rate is blended in with weight
    ``alpha`` (an exponential moving average of recent windows). Until the first window,
    :attr:`value` is the prior. A counter that goes down (the instance restarted) restarts the window.
    """

    def __init__(self, prior: float, alpha: float = 0.3, min_tokens: int = 256) -> None:
        if not math.isfinite(prior) or prior <= 0 or not 0 < alpha <= 1 or min_tokens < 1:
            raise ValueError(f"need prior > 0, alpha in (0, 1], min_tokens >= 1 (got {prior}, {alpha}, {min_tokens})")
        self.value, self.alpha, self.min_tokens = prior, alpha, min_tokens
        self.measured = False
        self._base: tuple[float, float] | None = None

    def observe(self, seconds_total: float, tokens_total: float) -> None:
        if self._base is None or tokens_total < self._base[1] or seconds_total < self._base[0]:
            self._base = (seconds_total, tokens_total)
            return
        ds, dt = seconds_total - self._base[0], tokens_total - self._base[1]
        if dt < self.min_tokens:
            return
        self._base = (seconds_total, tokens_total)
        if ds <= 0:
            return
        r = ds / dt
        self.value = r if not self.measured else (1 - self.alpha) * self.value + self.alpha * r
        self.measured = True


__all__ = ["Prediction", "Rate", "predict"]
