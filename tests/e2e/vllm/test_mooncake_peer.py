"""The Mooncake Store peer (kvfabric/bench/mooncake_store.py) on real Mooncake, in the vLLM virtualenv
where scripts/ci-vllm.sh installs its non-CUDA build: the store starts on loopback and stops whole, the
in-process client's bytes come back, the keys a PUT cell wrote are gone after it, and
``kvfabric bench transport_native`` reports the peer's rows and each path's ratio to them. Never a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

mooncake_store = pytest.importorskip("kvfabric.bench.mooncake_store")
pytest.importorskip("mooncake.store", reason="Mooncake is installed by scripts/ci-vllm.sh")

ROOT = Path(__file__).resolve().parents[3]


def test_the_peer_store_moves_bytes_and_stops_whole():
    peer = mooncake_store.MooncakePeer(64 << 10, capacity=16 << 20)   # checks one PUT/GET round's bytes
    procs = list(peer.store.procs)
    try:
        assert peer.store.rpc.startswith("127.0.0.1:") and peer.store.admin_url.startswith("http://127.0.0.1:")
        before = peer.store.metrics()
        assert before["capacity_bytes"] == 16 << 20, before
        for op in ("get", "put"):
            gbps, p50_us, p99_us, cpu = peer.measure(op, 0.2)
            assert gbps > 0 and 0 < p50_us <= p99_us and cpu >= 0, (op, gbps, p50_us, p99_us, cpu)
        after = peer.store.metrics()
        # the PUT cell's fresh keys were removed after it: the store holds what it held before
        assert after["keys"] == before["keys"] == 1 and after["put_items"] + after["put_requests"] > 0, (before, after)
    finally:
        peer.close()
    assert all(p.poll() is not None for p in procs), [p.pid for p in procs]


def test_a_missing_installation_is_said_not_raised_as_a_crash(tmp_path):
    with pytest.raises(mooncake_store.NotAvailable, match="mooncake_master"):
        mooncake_store.MooncakeStore("", 16 << 20, tmp_path)
    with pytest.raises(mooncake_store.NotAvailable, match="exited"):
        (tmp_path / "bin").mkdir()
        for b in mooncake_store.BINARIES:      # binaries that exit at once, as a broken install would
            f = tmp_path / "bin" / b
            f.write_text("#!/bin/sh\necho 'E1208 broken: libibverbs.so.1 not found' >&2\nexit 127\n")
            f.chmod(0o755)
        mooncake_store.MooncakeStore(str(tmp_path / "bin"), 16 << 20, tmp_path)


def test_transport_native_reports_the_peer_rows(tmp_path):
    out = tmp_path / "tn.json"
    cmd = [sys.executable, "-m", "kvfabric", "bench", "transport_native", "--paths", "native", "--size", "64KiB",
           "--duration", "0.2", "--repeat", "1", "--no-redis", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["name"], r["op"]): r for r in json.loads(out.read_text())["rows"]}
    for op in ("get", "put"):
        assert rows[("mooncake", op)]["gbps"] > 0, rows.get(("mooncake", op))
        assert rows[("native", op)]["ratio"]["mooncake"] > 0, rows[("native", op)]
    assert "/mooncake" in proc.stdout, proc.stdout[-3000:]
