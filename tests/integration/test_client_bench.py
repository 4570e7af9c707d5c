"""The transport benchmark runs end to end (tiny sizes) and writes the JSON it promises."""

from __future__ import annotations

import json

from kvfabric.bench import transport as bench


def test_bench_transport_quick_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = bench.main(["--quick", "--sizes", "64KiB", "--threads", "1", "--servers", "1",
                     "--transports", "tcp", "--duration", "0.05", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {c["op"] for c in report["ceilings"]} == {"put", "get"}
    assert [(r["name"], r["op"]) for r in report["results"]] == [("tcp", "put"), ("tcp", "get")]
    for r in report["results"]:
        assert r["ops"] >= 3 and r["gbps"] > 0 and r["misses"] == 0
        assert r["ratio"][bench.REFERENCE_CEILING] > 0
    table = capsys.readouterr().out
    assert "python-socket" in json.dumps(report["meta"]) and "ratio" in table
