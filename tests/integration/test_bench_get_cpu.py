"""``kvfabric bench get_cpu`` on small objects: a table, JSON with every row, both CPU columns measured."""

from __future__ import annotations

import json

from kvfabric.bench import get_cpu as bench


def test_get_cpu_quick_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "get_cpu.json"
    assert bench.main(["--size", "1MiB", "--objects", "2", "--rounds", "3", "--repeat", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "client verifies" in text and "ceiling: c-socket" in text
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"client verifies", "server verifies", "ceiling: c-socket"}
    assert all(r["gbps"] > 0 for r in rows.values())
    for name in ("client verifies", "server verifies"):
        assert rows[name]["server_cpu_ms_per_gib"] >= 0 and rows[name]["client_cpu_ms_per_gib"] > 0
