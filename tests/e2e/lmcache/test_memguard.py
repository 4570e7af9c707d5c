"""MemoryGuard's own logic (the engine-level cases are in test_engine.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from kvfabric_lmcache.memguard import MemoryGuard


class Allocator:
    def __init__(self) -> None:
        self.closed = 0
        self.guard_retired_at_close: list[bool] = []

    def close(self) -> None:
        self.closed += 1
        self.guard_retired_at_close.append(MemoryGuard.of(SimpleNamespace(memory_allocator=self)).retired)


def test_one_guard_per_allocator_retired_before_the_free_and_the_free_runs_once() -> None:
    alloc = Allocator()
    backend = SimpleNamespace(memory_allocator=alloc)
    g1, g2 = MemoryGuard.of(backend), MemoryGuard.of(backend)
    assert g1 is g2  # a second connector (named instance, reconnect) shares it
    with g1.use() as live:
        assert live
    alloc.close()
    assert (alloc.closed, alloc.guard_retired_at_close) == (1, [True])
    with g1.use() as live:
        assert not live


def test_without_an_allocator_the_guard_is_only_retired_by_hand() -> None:
    for backend in (None, SimpleNamespace()):
        g = MemoryGuard.of(backend)
        with g.use() as live:
            assert live
        g.retire()
        with g.use() as live:
            assert not live


def test_retire_waits_for_every_use_in_progress() -> None:
    g = MemoryGuard()
    inside, leave, retired = threading.Barrier(3, timeout=60), threading.Event(), threading.Event()
    lives: list[bool] = []

    def user() -> None:
        with g.use() as live:
            lives.append(live)
            inside.wait()
            leave.wait(60)

    users = [threading.Thread(target=user) for _ in range(2)]
    for t in users:
        t.start()
    inside.wait()  # both users are inside
    closer = threading.Thread(target=lambda: (g.retire(), retired.set()))
    closer.start()
    closer.join(0.5)
    assert not retired.is_set()  # both users still inside
    leave.set()
    for t in users:
        t.join(60)
    closer.join(60)
    assert retired.is_set() and lives == [True, True]
