"""Fixtures for the LMCache plugin tests: real kvfabric server processes, real LMCache engines.

These tests run in the LMCache virtualenv (``scripts/ci-lmcache.sh`` builds it);
in any other environment nothing here is collected.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest

from kvfabric.testing.servers import start_pool

if importlib.util.find_spec("lmcache") is None or importlib.util.find_spec("torch") is None:
    # not the LMCache virtualenv (scripts/ci-lmcache.sh): nothing to run here
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def pool() -> Iterator:
    with start_pool(2, capacity="64MiB") as p:
        yield p


@pytest.fixture
def engines() -> Iterator[Callable]:
    """Factory for LMCache engines that are destroyed at teardown, whatever happens."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache_helpers import build_engine

    names: list[str] = []

    def make(config, md=None):
        name, engine = build_engine(config, md)
        names.append(name)
        return name, engine

    yield make
    for n in names:
        LMCacheEngineBuilder.destroy(n)
