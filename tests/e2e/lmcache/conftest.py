"""Fixtures for the LMCache plugin tests: real kvfabric server processes, real LMCache engines.

These tests run in the LMCache virtualenv (``scripts/ci-lmcache.sh`` builds it);
elsewhere they are skipped as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("lmcache", reason="needs LMCache 0.5.6 (run scripts/ci-lmcache.sh)")
pytest.importorskip("torch")

from kvfabric.testing.servers import start_pool  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache_helpers import build_engine  # noqa: E402


@pytest.fixture
def pool() -> Iterator:
    with start_pool(2, capacity="64MiB") as p:
        yield p


@pytest.fixture
def engines() -> Iterator[Callable[..., tuple[str, LMCacheEngine]]]:
    """Factory for engines that are destroyed at teardown, whatever happens."""
    names: list[str] = []

    def make(config: LMCacheEngineConfig, md: LMCacheMetadata | None = None) -> tuple[str, LMCacheEngine]:
        name, engine = build_engine(config, md)
        names.append(name)
        return name, engine

    yield make
    for n in names:
        LMCacheEngineBuilder.destroy(n)
