"""Pure planning helpers of :class:`kvfabric.client.Client` (no sockets, unit tested alone).

``plan_chunks`` splits a shard's keys into requests that fit the server's
limits (``plan_groups`` likewise, never splitting a group), ``leading_run``
folds per-shard answers into a prefix length (``whole_group_run`` cuts it back
to whole groups, ``whole_groups`` does the same for per-key presence), and
``combine_puts`` folds per-owner put statuses into a :class:`PutResult`.
``kvfabric.client`` re-exports ``PutResult``, ``plan_chunks``, ``leading_run``
and ``combine_puts``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .protocol import PutStatus

__all__ = ["LookupRun", "PutResult", "plan_chunks", "plan_groups", "leading_run", "whole_group_run", "whole_groups",
           "check_contiguous_groups", "combine_puts"]


class LookupRun(NamedTuple):
    """:meth:`Client.lookup_media`'s answer: ``count`` leading keys held, ``on_ssd`` of them held
    only on a server's SSD tier (None where the medium is unknown: without ``media``, or with
    replicas, whose presence comes from EXISTS)."""

    count: int
    on_ssd: int | None


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
    if type(idx) is list and len(idx) == 1 and max_keys >= 1:  # one key: one request whatever its size
        return [idx]
    # Without sizes only the key count splits: slices, no per-key loop (a lone chunk may be ``idx`` itself).
    if nbytes is None and max_keys >= 1 and max_payload >= 0:
        idx = idx if type(idx) is list else list(idx)
        if len(idx) <= max_keys:
            return [idx] if idx else []
        return [idx[i : i + max_keys] for i in range(0, len(idx), max_keys)]
    return _pack((([i], nbytes(i) if nbytes else 0) for i in idx), max_keys, max_payload)


def _pack(units: Iterable[tuple[list[int], int]], max_keys: int, max_payload: int) -> list[list[int]]:
    """Requests of whole units (key indices, their bytes), in order: a unit joins the current request
    only if it still fits ``max_keys`` keys and ``max_payload`` bytes, else it starts the next one
    (so a unit over a limit on its own gets a request of its own)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for parts, n in units:
        if cur and (len(cur) + len(parts) > max_keys or size + n > max_payload):
            out.append(cur)
            cur, size = [], 0
        cur.extend(parts)
        size += n
    if cur:
        out.append(cur)
    return out


def plan_groups(
    idx: Sequence[int], group_of: Callable[[int], bytes], max_keys: int, max_payload: int,
    nbytes: Callable[[int], int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """``plan_chunks`` for grouped keys: requests of whole groups, never one group over two requests.

    ``group_of(i)`` is key ``i``'s group. Groups keep the order of their first
    key in ``idx``; a request lists each of its groups' keys one after another
    (in ``idx`` order), and a group joins the current request only if all of it
    fits (``max_keys`` keys, ``max_payload`` bytes), else it starts the next.
    Returns ``(requests, refused)``: ``refused`` holds the keys of every group
    of two or more keys that alone exceeds a limit (the caller refuses those
    whole; one key larger than ``max_payload`` still gets a request of its own,
    as in ``plan_chunks``).
    """
    groups: dict[bytes, list[int]] = {}
    for i in idx:
        groups.setdefault(group_of(i), []).append(i)
    refused: list[int] = []

    def whole() -> Iterator[tuple[list[int], int]]:
        for parts in groups.values():
            n = sum(map(nbytes, parts)) if nbytes else 0
            if len(parts) > 1 and (len(parts) > max_keys or n > max_payload):
                refused.extend(parts)
            else:
                yield parts, n

    return _pack(whole(), max_keys, max_payload), refused


def check_contiguous_groups(groups: Sequence[bytes]) -> None:
    """``ValueError`` unless each group's keys are consecutive (chunk-major: all parts of one group,
    then the next), which is what a leading run in whole groups needs."""
    seen: set[bytes] = set()
    for i, g in enumerate(groups):
        if i and g == groups[i - 1]:
            continue
        if g in seen:
            raise ValueError(f"key {i}: the parts of a group must be consecutive (chunk-major), "
                             f"but group {g.hex()[:32]} appears again after another group")
        seen.add(g)


def whole_group_run(run: int, groups: Sequence[bytes]) -> int:
    """A leading run of keys cut back to whole groups (groups consecutive, ``check_contiguous_groups``):
    when key ``run`` (the first missing one) belongs to the group of key ``run - 1``, that group is
    partial and the run ends where it starts."""
    if 0 < run < len(groups):
        g = groups[run]
        while run > 0 and groups[run - 1] == g:
            run -= 1
    return run


def whole_groups(present: list[bool], groups: Sequence[bytes]) -> None:
    """Per-key presence made per group, in place: a key counts present only when every key of its
    group (the same entry in ``groups``) does."""
    missing = {g for p, g in zip(present, groups) if not p}
    if missing:
        for i, g in enumerate(groups):
            if g in missing:
                present[i] = False


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
