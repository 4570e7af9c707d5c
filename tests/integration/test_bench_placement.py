"""``kvfabric bench placement`` at a tiny size (issue 23): it runs, and its JSON says what it measured.

Real servers on loopback, a real trace; no timing is asserted. What must hold whatever the load: with
replicas 1 a victim's death never raises the hit rate above the healthy one, and with two replicas
one dead server of four costs no chunk (every chunk has a live copy).
"""

from __future__ import annotations

import json

from kvfabric.bench import placement


def test_placement_smoke(tmp_path):
    out = tmp_path / "placement.json"
    rc = placement.main(["--traces", "mooncake-synthetic", "--limit", "40", "--sizes", "4", "--layouts", "object,chunk,seg4",
                         "--replicas", "1,2", "--layers", "16", "--victims", "1", "--lab", "loopback",
                         "--long-tokens", "4096", "--long-object-bytes", "4096", "--reps", "1", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    cases = {(r["placement"], r["replicas"]): r for r in report["results"]}
    assert set(cases) == {(p, r) for p in ("object", "chunk", "seg4") for r in (1, 2)}
    for (place, replicas), r in cases.items():
        h = r["healthy"]
        assert r["hit_healthy"] == h["hit_chunks"] / h["chunks"] and h["chunks"] > 0, r
        assert len(r["killed"]) == 1 and r["hit_killed_worst"] <= r["hit_healthy"] + 1e-9, r
        assert h["bytes_max"] >= h["bytes_mean"] > 0 and h["lookup_requests"] >= 1, h
        assert h["long_get_found"] == 1.0 and h["long_put_dropped"] == 0, h   # healthy: the long prompt is whole
        if replicas == 2 and place != "object":
            assert r["killed"][0]["hit_chunks"] == h["hit_chunks"], r   # a live copy of every chunk
    # the same trace and warm-up in every case: the healthy hit rate does not depend on placement
    assert len({r["hit_healthy"] for r in report["results"]}) == 1, [r["hit_healthy"] for r in report["results"]]
