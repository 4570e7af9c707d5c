"""kvfabric.testing.throttle: the block-I/O cgroup the load guard's SSD figure and test use (no timing:
what is checked is the group the kernel was given, its members and its removal)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from kvfabric.testing.throttle import ReadThrottle, _disk_of, unavailable

DIR = tempfile.gettempdir()


def _why() -> str | None:
    return unavailable(DIR)


def test_a_filesystem_on_no_block_device_is_refused_with_the_reason():
    why = unavailable("/proc")
    assert why is not None and ("not a block device" in why or "root" in why or "controller" in why), why
    with pytest.raises(RuntimeError, match="cannot throttle reads of /proc"):
        ReadThrottle("/proc", 1 << 20)


@pytest.mark.skipif(_why() is not None, reason=f"no throttling here: {_why()}")
def test_the_group_throttles_the_disk_its_members_and_is_removed():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with ReadThrottle(DIR, 3 << 20) as t:
            dev = _disk_of(DIR)
            limits = t.group / ("blkio.throttle.read_bps_device" if t._v1 else "io.max")
            text = limits.read_text()
            assert dev in text and (str(3 << 20) in text), text
            t.add(child.pid)
            assert str(child.pid) in (t.group / "cgroup.procs").read_text().split()
            with pytest.raises(ValueError):
                ReadThrottle(DIR, 10)
        assert not t.group.exists()
        assert os.path.exists(f"/proc/{child.pid}") and child.poll() is None   # moved back, still running
    finally:
        child.kill()
        child.wait()
