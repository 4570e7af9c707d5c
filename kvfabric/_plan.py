"""Pure planning helpers of :class:`kvfabric.client.Client` (no sockets, unit tested alone).

``plan_chunks`` splits a shard's keys into requests that fit the server's
limits, ``leading_run`` folds per-shard answers into a prefix length, and
``combine_puts`` folds per-owner put statuses into a :class:`PutResult`.
``kvfabric.client`` re-exports all four.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .protocol import PutStatus

__all__ = ["PutResult", "plan_chunks", "leading_run", "combine_puts"]


@dataclass(frozen=True, slots=True)
class PutResult:
    """Per-call put outcome, counted in keys.

    A key is ``stored`` when at least one owner stored it, ``existed`` when no
    owner stored it but one already held it, ``dropped`` otherwise (owners
    down, slow, out of space, or the object too large for them).
    """

    stored: int = 0
    existed: int = 0
    dropped: int = 0


def plan_chunks(
    idx: Sequence[int], max_keys: int, max_payload: int, nbytes: Callable[[int], int] | None = None
) -> list[list[int]]:
    """Split key indices, in order, into requests of at most ``max_keys`` keys and
    ``max_payload`` payload bytes (``nbytes(i)`` per key; a single key larger
    than ``max_payload`` still gets a request of its own)."""
    # Without sizes only the key count splits: slices, no per-key loop (a lone chunk may be ``idx`` itself).
    if nbytes is None and max_keys >= 1 and max_payload >= 0:
        idx = idx if type(idx) is list else list(idx)
        if len(idx) <= max_keys:
            return [idx] if idx else []
        return [idx[i : i + max_keys] for i in range(0, len(idx), max_keys)]
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in idx:
        n = nbytes(i) if nbytes else 0
        if cur and (len(cur) >= max_keys or size + n > max_payload):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


def leading_run(nkeys: int, first_missing: Sequence[int]) -> int:
    """The longest leading run of an ordered key list, given for each shard the
    global index of the first of *its* keys that it does not hold (shards that
    hold all their keys contribute nothing). Every key before the smallest such
    index belongs to some shard's held prefix, so it is present."""
    return min(first_missing, default=nkeys)


def combine_puts(status: Sequence[Sequence[int]]) -> tuple[PutResult, int]:
    """Fold per-key, per-owner put statuses (-1 = never answered) into a
    :class:`PutResult` plus the number of replica copies not stored."""
    stored = existed = dropped = replica_drops = 0
    for row in status:
        replica_drops += sum(1 for st in row if st not in (PutStatus.STORED, PutStatus.EXISTS))
        if PutStatus.STORED in row:
            stored += 1
        elif PutStatus.EXISTS in row:
            existed += 1
        else:
            dropped += 1
    return PutResult(stored, existed, dropped), replica_drops
