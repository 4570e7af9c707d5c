"""Operator tools behind the ``kvfabric`` command: ``stats`` and ``top`` (:mod:`.stats`), ``cluster ls``
(:mod:`.cluster`), ``ping``, ``exists``, ``get``, ``put``, ``del`` (:mod:`.admin`); how each reaches the servers
and reports a failure in one line (:mod:`.connect`)."""
