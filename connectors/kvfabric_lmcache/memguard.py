"""``MemoryGuard``: no kvfabric thread touches LMCache's memory after LMCache frees it.

LMCache's teardown (``StorageManager.close``) closes ``LocalCPUBackend``
first, and that frees the allocator's whole arena (``memory_allocator.close``
-> ``free_pinned_ptr``) whatever the memory objects' reference counts say;
the remote backend, and so this connector, is closed after. A put that
LMCache queued on its event loop just before (``run_coroutine_threadsafe``:
the coroutine has not run yet) would then copy from freed memory, and a get
still receiving on an I/O thread would write into it: a segfault, seen in CI
(the copy in ``encode_into`` on the loop thread while the main thread was in
``free_pinned_ptr``). LMCache offers no hook before that free, so the guard
wraps the allocator instance's ``close``:

* every access to LMCache memory (the put's copy out, the get's allocation
  and receive into it) runs inside ``with guard.use() as live:``; ``live`` is
  False once the arena is being freed, and the caller then does nothing with
  that memory (the put is dropped, the get is a miss, both counted);
* the wrapped ``close`` marks the guard retired, waits for the accesses in
  progress to finish, then frees. Those accesses are bounded (a copy, or a
  pool call under the client's deadline), so teardown waits at most about
  one call's deadline.

One guard per allocator, shared by every kvfabric connector on it (named
instances, reconnects): it is installed once and found again by attribute.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

log = logging.getLogger("kvfabric.lmcache")

_ATTR = "_kvfabric_memory_guard"


class MemoryGuard:
    """See the module docstring. Build with :meth:`of`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._users = 0
        self._retired = False

    @classmethod
    def of(cls, local_cpu_backend: Optional[Any]) -> "MemoryGuard":
        """The guard of ``local_cpu_backend``'s allocator, installed on first use.

        Without a backend (LMCache's scheduler role: no memory objects) the
        guard never retires; an allocator without a callable ``close`` is
        logged, as nothing can then tell this connector its memory is gone.
        """
        allocator = getattr(local_cpu_backend, "memory_allocator", None)
        if allocator is None:
            return cls()
        guard = getattr(allocator, _ATTR, None)
        if isinstance(guard, cls):
            return guard
        guard = cls()
        close = getattr(allocator, "close", None)
        if not callable(close):
            log.warning("kvfabric-lmcache: %s has no close(); puts queued at teardown may read freed memory",
                        type(allocator).__name__)
            return guard

        def close_after_kvfabric(*args: Any, **kwargs: Any) -> Any:
            guard.retire()
            return close(*args, **kwargs)

        allocator.close = close_after_kvfabric
        setattr(allocator, _ATTR, guard)
        return guard

    @contextmanager
    def use(self) -> Iterator[bool]:
        """Yields True while the memory may be touched (teardown waits for the block to end), else False."""
        with self._cond:
            if self._retired:
                live = False
            else:
                live = True
                self._users += 1
        try:
            yield live
        finally:
            if live:
                with self._cond:
                    self._users -= 1
                    if not self._users:
                        self._cond.notify_all()

    def retire(self) -> None:
        """No new access may start; returns once the ones in progress have ended."""
        with self._cond:
            self._retired = True
            while self._users:
                self._cond.wait()

    @property
    def retired(self) -> bool:
        with self._cond:
            return self._retired


__all__ = ["MemoryGuard"]
