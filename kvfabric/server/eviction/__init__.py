"""Eviction policies for the pool server, selected by name (``--policy``)."""

from __future__ import annotations

from .base import EvictionPolicy
from .lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
}


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """Build the policy called ``name``; ``ValueError`` lists the known names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(**kwargs)


__all__ = ["EvictionPolicy", "LRUPolicy", "POLICIES", "make_policy"]
