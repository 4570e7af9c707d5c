"""Helpers for tests and benchmarks: real server processes on loopback (``servers``)."""

from .servers import ServerPool, ServerProcess, start_pool, start_server

__all__ = ["ServerPool", "ServerProcess", "start_pool", "start_server"]
