"""Eviction policies for the pool server, selected by name (``--policy``).

* ``lru``: least recently used, the baseline every peer system ships.
* ``tail-lru``: LRU over the blocks no other block builds on (a chain is
  evicted from its tail, so its head stays useful).
* ``s3fifo``: S3-FIFO, a small probationary FIFO, a main FIFO with
  reinsertion and a ghost FIFO; one-use blocks leave fast.
* ``prefix-lfu``: LFU with dynamic aging and a remembered frequency history,
  evicting tails first; the combination of the two ideas above.
"""

from __future__ import annotations

from .base import EvictionPolicy
from .lru import LRUPolicy
from .prefix_lfu import PrefixLFUPolicy
from .s3fifo import S3FIFOPolicy
from .tail_lru import TailLRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    TailLRUPolicy.name: TailLRUPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
    PrefixLFUPolicy.name: PrefixLFUPolicy,
}


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """Build the policy called ``name``; ``ValueError`` lists the known names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(**kwargs)


__all__ = ["EvictionPolicy", "LRUPolicy", "POLICIES", "PrefixLFUPolicy", "S3FIFOPolicy", "TailLRUPolicy", "make_policy"]
