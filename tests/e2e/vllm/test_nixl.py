"""The vLLM connector over the nixl transport (issue 24): the identity test with ``transport: nixl``.

A pool server offers nixl (``--transports tcp,native,nixl``: its arena registered with a NIXL agent);
two engines run the same prompt with the connector's client forced to ``transport: nixl`` (nixl or an
error, never a silent fallback): the first saves, the second loads every loadable chunk with one-sided
NIXL READs into the KV blocks and its greedy output equals a cold run's. Once per UCX transport set
(``UCX_TLS=tcp``, ``UCX_TLS=sm,self``), server and engines alike. What moved over nixl is read back
from the server's STATS (connections by transport). Skipped, with the reason, where NIXL does not
import (scripts/ci-vllm.sh installs it into the vLLM virtualenv).
"""

from __future__ import annotations

import json

import pytest

from kvfabric import Client
from kvfabric.testing.servers import start_pool
from kvfabric.transport import nixl

from conftest import CHUNK, LOADABLE, PROMPTS

if (why := nixl.probe()) is not None:
    pytest.skip(f"nixl cannot be used here: {why}", allow_module_level=True)

SAVED = len(PROMPTS["single"]) // CHUNK
LOADED = LOADABLE // CHUNK
NIXL = ["--extra", json.dumps({"transport": "nixl"})]


@pytest.mark.parametrize("ucx_tls", ["tcp", "sm,self"], ids=["ucx-tcp", "ucx-sm"])
def test_engine_loads_its_prefix_over_nixl(run_engine, cold, ucx_tls, monkeypatch):
    monkeypatch.setenv("UCX_TLS", ucx_tls)   # the server and engine processes inherit it
    with start_pool(1, capacity="64MiB", extra_args=["--transports", "tcp,native,nixl"]) as pool:
        a = run_engine(["single"], pool.addresses, args=NIXL)
        assert a["cached"] == [0] and a["outputs"] == [cold["single"]], a["counters"]
        assert a["counters"]["save_chunks"] == SAVED, a["counters"]

        b = run_engine(["single"], pool.addresses, args=NIXL)
        assert b["cached"][0] >= LOADABLE, b["counters"]
        assert b["outputs"] == [cold["single"]]
        assert b["counters"]["load_chunks"] == LOADED and b["counters"]["load_failed_chunks"] == 0, b["counters"]

        with Client(pool.addresses) as c:
            st = c.stats()["servers"][pool.addresses[0]]
        used = st["transports_in_use"]
        assert used.get("nixl", 0) >= 2, used      # both engines' clients attached over nixl
        assert st["hits"] >= LOADED, st["hits"]
