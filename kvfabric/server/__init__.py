"""The pool server: ``kvfabric serve`` (``main``, the command line) runs :class:`native.NativeServer`,
the C io_uring data plane of csrc/ (arena, index, allocator, every byte) with its decisions in
Python: eviction policies (``eviction/``), the control thread that feeds them, the Prometheus view
of STATS (``metrics``), cluster registration (``kvfabric.membership``).

The pure-Python implementation of the same protocol is the test suite's executable reference,
:mod:`kvfabric.testing.reference`, not a second server.
"""
