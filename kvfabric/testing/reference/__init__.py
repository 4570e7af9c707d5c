"""The pure-Python pool server: the executable reference of the test suite, not a product.

``kvfabric serve`` runs the one product server (the C io_uring data plane,
:mod:`kvfabric.server.native`). This package keeps the pure-Python
implementation of the same wire protocol so that the conformance suite
(:mod:`kvfabric.testing.conformance`) and the golden-frame tests can check
the product server against an independent, readable implementation: every
client transport runs the same tests against both, and a difference is a bug
in one of them.

Run it as ``python -m kvfabric.testing.reference serve --port 0 ...`` (the
common options of ``kvfabric serve``; it offers ``tcp`` only). It prints the
same ``kvfabric serve: listening on HOST:PORT`` line once it can answer.

Layers: ``arena.Arena`` <- ``store.Store`` <- ``handlers.Handlers``
(transport-independent request logic) <- ``tcp.TcpServer`` (thread per
connection) <- ``main.main`` (the command line).
"""
