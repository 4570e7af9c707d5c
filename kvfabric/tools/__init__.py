"""Operator tools behind the ``kvfabric`` command: ``stats`` and ``top`` (:mod:`.stats`)."""
