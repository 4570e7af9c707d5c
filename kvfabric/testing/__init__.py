"""Helpers for tests and benchmarks: real server processes on loopback (``servers``), ``wait_for`` (``poll``)."""

from .poll import wait_for
from .servers import ServerPool, ServerProcess, start_pool, start_server, stop_process_group

__all__ = ["ServerPool", "ServerProcess", "start_pool", "start_server", "stop_process_group", "wait_for"]
