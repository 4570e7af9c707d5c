"""The transport conformance matrix: which (server kind, client transport) pairs must agree.

The integration tests in ``tests/integration/test_client_*.py`` run once per
pair in :data:`TRANSPORT_PAIRS`, so every transport passes the same suite as
the pure-Python reference server (content byte for byte, exact eviction order,
checksum corruption, concurrency, a killed and restarted shard). A transport
joins the suite by appending its pair here; a server kind by adding the
``start_pool`` keyword arguments that start it to :data:`SERVER_KINDS`.

A pair whose client transport is not available in this process (see
``kvfabric.transport.available()``) is skipped with the reason, never run
against a silently different transport: the tests force the transport by name.
"""

from __future__ import annotations

from typing import Any

from .servers import ServerPool, start_pool

#: (server_kind, client_transport) pairs every test in the suite runs against.
TRANSPORT_PAIRS: list[tuple[str, str]] = [
    ("reference", "tcp"),
    ("reference", "native"),
    ("native", "tcp"),
    ("native", "native"),
    ("native", "shm"),
    ("native-nixl", "nixl"),  # skipped where nixl does not import (scripts/ci-nixl.sh runs it)
]

#: client transports whose GET reply payloads travel in the TCP byte stream
#: (so a proxy on that stream can corrupt them); ``shm`` copies from a shared
#: arena instead, and its corruption check has to be exercised on the arena.
SOCKET_PAYLOAD_TRANSPORTS: frozenset[str] = frozenset({"tcp", "native"})

#: server kind -> extra keyword arguments for :func:`kvfabric.testing.servers.start_pool`.
#: "native" is the product server (``kvfabric serve``, csrc/'s io_uring data plane), started
#: with shm offered so that the native-shm pair can attach; "reference" the pure-Python
#: executable reference (:mod:`kvfabric.testing.reference`).
SERVER_KINDS: dict[str, dict[str, Any]] = {
    "reference": {"module": "kvfabric.testing.reference"},
    "native": {"extra_args": ["--transports", "tcp,native,shm"]},
    # the product server offering nixl too (its arena registered with a NIXL agent; UCX_TLS from the environment)
    "native-nixl": {"extra_args": ["--transports", "tcp,native,shm,nixl"]},
}


#: server kind -> the client transport whose machinery the server needs in this process
#: (the C extension; NIXL's agent for the server's arena). A kind whose need is not
#: available here cannot start (``kvfabric serve`` exits with status 2) and is skipped.
SERVER_KIND_NEEDS: dict[str, str] = {"native": "native", "native-nixl": "nixl"}


def server_kind_unavailable(server_kind: str) -> str | None:
    """Why ``server_kind`` cannot start in this process, or ``None`` when it can."""
    from kvfabric import transport

    need = SERVER_KIND_NEEDS.get(server_kind)
    if need is None or need in transport.available():
        return None
    return f"server kind {server_kind!r} needs transport {need!r}: {transport.unavailable().get(need)}"


#: server kind -> extra arguments that make it evict only when a PUT finds no room,
#: so a test can fill it to exactly its capacity (the native server's command line
#: otherwise keeps some headroom free: ``--evict-watermarks auto``).
EXACT_CAPACITY_ARGS: dict[str, list[str]] = {
    "reference": [],
    "native": ["--evict-watermarks", "0,0"],
    "native-nixl": ["--evict-watermarks", "0,0"],
}


def pair_id(pair: tuple[str, str]) -> str:
    """Test id of a pair: ``"reference-tcp"``."""
    return f"{pair[0]}-{pair[1]}"


def start_pool_of(server_kind: str, n: int, **kwargs: Any) -> ServerPool:
    """``start_pool(n, ...)`` for a server kind; ``KeyError`` for an unknown kind."""
    if server_kind not in SERVER_KINDS:
        raise KeyError(f"unknown server kind {server_kind!r}; known: {sorted(SERVER_KINDS)}")
    merged = {**SERVER_KINDS[server_kind], **kwargs}
    extra = list(SERVER_KINDS[server_kind].get("extra_args", ())) + list(kwargs.get("extra_args", ()))
    if extra:
        merged["extra_args"] = extra
    return start_pool(n, **merged)


__all__ = ["TRANSPORT_PAIRS", "SERVER_KINDS", "SERVER_KIND_NEEDS", "server_kind_unavailable", "EXACT_CAPACITY_ARGS", "SOCKET_PAYLOAD_TRANSPORTS", "pair_id", "start_pool_of"]
