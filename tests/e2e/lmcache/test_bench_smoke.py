"""``benchmarks/lmcache_backend.py`` runs at its smallest on real LMCache (a smoke run for
``tests/integration/test_bench_smoke.py``'s ``SMOKED`` table).

Run as the docs run it (``python benchmarks/lmcache_backend.py``, a subprocess
from the repository root): the tiny model's KV shape, one 256-token chunk,
one measured round, every row (memcpy, client ceilings, kvfabric x1 and x2,
the shm row, LMCache's own ``lm://`` server). The benchmark itself refuses a
round that is not a full bit-identical hit, so exit 0 means every backend
returned the bytes; asserted beside that: the JSON's structure, no speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_lmcache_backend_smoke(tmp_path):
    out = tmp_path / "lmcache_backend.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lmcache_backend.py"), "--model", "tiny", "--tokens", "256",
           "--repeats", "1", "--capacity", "32MiB", "--shm", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                  f"--- stderr\n{proc.stderr[-6000:]}")
    rep = json.loads(out.read_text())
    meta = rep["meta"]
    assert (meta["model"], meta["prompt_tokens"], meta["repeats"], meta["chunk_tokens"]) == ("tiny", 256, 1, 256), meta
    assert meta["lmcache"] and meta["torch"], meta
    by = {r["backend"]: r for r in rep["rows"]}
    engines = {"LMCache + kvfabric x1", "LMCache + kvfabric x2", "LMCache + kvfabric x1 shm", "LMCache + lm:// server"}
    assert engines <= set(by), sorted(by)
    for r in rep["rows"]:
        assert r["bytes"] == meta["kv_bytes_per_token"] * 256, r
        assert len(r["store_s"]) == len(r["retrieve_s"]) == 1, r
        assert r["store_gbps"] > 0 and r["retrieve_gbps"] > 0, r
    for name in engines:
        assert len(by[name]["lookup_s"]) == 1 and by[name]["lookup_ms"] > 0, by[name]
    assert "wrote" in proc.stdout, proc.stdout[-6000:]
