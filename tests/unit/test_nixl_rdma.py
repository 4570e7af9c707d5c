"""Where ``transport: auto`` may pick nixl: an active RDMA port in sysfs (kvfabric/transport/nixl.py,
``rdma_ports`` / ``auto_reason``), read from a directory laid out as /sys/class/infiniband is. The
machines here have no RDMA device, so the positive case exists only as this layout."""

from __future__ import annotations

from kvfabric.transport import nixl


def _port(root, dev: str, port: str, state: str) -> None:
    d = root / dev / "ports" / port
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")


def test_active_ports_only(tmp_path):
    _port(tmp_path, "mlx5_0", "1", "4: ACTIVE")
    _port(tmp_path, "mlx5_0", "2", "1: DOWN")
    _port(tmp_path, "rxe0", "1", "2: INIT")
    (tmp_path / "broken").mkdir()                    # a device without ports/: skipped
    assert nixl.rdma_ports(str(tmp_path)) == ["mlx5_0/1"]
    assert nixl.auto_reason(str(tmp_path)) is None


def test_no_device_or_none_active_is_a_reason(tmp_path):
    assert nixl.rdma_ports(str(tmp_path / "missing")) == []
    assert "no active RDMA port" in nixl.auto_reason(str(tmp_path / "missing"))
    _port(tmp_path, "mlx5_0", "1", "1: DOWN")
    assert nixl.rdma_ports(str(tmp_path)) == [] and nixl.auto_reason(str(tmp_path)) is not None
