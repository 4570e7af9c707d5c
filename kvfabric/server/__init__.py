"""The pool server: arena (allocator), store (index, pins, leases, checksums),
eviction policies, request handlers, the TCP socket loop, and ``kvfabric serve``.

Layers, each usable alone: ``arena.Arena`` <- ``store.Store`` <-
``handlers.Handlers`` (transport-independent request logic) <- ``tcp.TcpServer``
(and the native / shm data planes beside it) <- ``main.main`` (the CLI).
"""
