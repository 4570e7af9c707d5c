"""A disk made slow for real: a block-I/O cgroup that throttles the reads of the processes put in it.

Used by the load guard's figure and its end-to-end test (issue 26 part 3): a pool server whose SSD
tier reads at a few MB/s, as a congested or throttled disk does, with the same binary, the same
``O_DIRECT`` io_uring reads and nothing faked on the wire.

    with ReadThrottle(ssd_dir, bytes_per_s=4 << 20) as throttle:
        throttle.add(server.pid)       # every thread of the process, io_uring's workers included
        ...

Linux's blkio controller (cgroup v1, ``blkio.throttle.read_bps_device``) or, on a unified
hierarchy, the io controller (``io.max rbps=``), on the whole disk that holds ``path`` (a
partition's parent disk). Needs root. :func:`unavailable` says why it cannot run here (not root,
no controller, a filesystem not on a block device such as tmpfs or overlay on a file), in which
case the callers skip or say so; nothing is throttled silently or partly. Close moves the
processes back to the root group and removes the group.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ReadThrottle", "unavailable"]

_V1 = Path("/sys/fs/cgroup/blkio")
_V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def _disk_of(path: str | os.PathLike) -> str:
    """``MAJ:MIN`` of the whole disk that holds ``path``; ValueError when it is on no block device."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / dev
    if not sys_dev.exists():
        raise ValueError(f"{path} is on device {dev}, which is not a block device (tmpfs, overlay, a network fs)")
    if (sys_dev / "partition").exists():  # a partition: throttles apply to its disk
        dev = (sys_dev.resolve().parent / "dev").read_text().strip()
    return dev


def _v2_root() -> Path | None:
    for root in _V2_ROOTS:
        ctl = root / "cgroup.controllers"
        if ctl.exists() and "io" in ctl.read_text().split():
            return root
    return None


def unavailable(path: str | os.PathLike) -> str | None:
    """Why reads of ``path``'s disk cannot be throttled here (None: they can)."""
    if os.geteuid() != 0:
        return "throttling a disk needs root (a block-I/O cgroup)"
    if not (_V1 / "blkio.throttle.read_bps_device").exists() and _v2_root() is None:
        return "no blkio (cgroup v1) or io (cgroup v2) controller is mounted"
    try:
        _disk_of(path)
    except (OSError, ValueError) as e:
        return str(e)
    return None


class ReadThrottle:
    """A cgroup of its own whose members read ``path``'s disk at most ``bytes_per_s``."""

    def __init__(self, path: str | os.PathLike, bytes_per_s: int) -> None:
        why = unavailable(path)
        if why is not None:
            raise RuntimeError(f"cannot throttle reads of {path}: {why}")
        if type(bytes_per_s) is not int or bytes_per_s < 4096:
            raise ValueError(f"bytes_per_s must be an int >= 4096, got {bytes_per_s!r}")
        self.device = _disk_of(path)
        self.bytes_per_s = bytes_per_s
        name = f"kvfabric-throttle-{os.getpid()}-{id(self):x}"
        if (_V1 / "blkio.throttle.read_bps_device").exists():
            self._root, self._v1 = _V1, True
        else:
            root = _v2_root()
            assert root is not None
            self._root, self._v1 = root, False
            # the io controller must be enabled for the root's children
            (root / "cgroup.subtree_control").write_text("+io")
        self.group = self._root / name
        self.group.mkdir()
        try:
            if self._v1:
                (self.group / "blkio.throttle.read_bps_device").write_text(f"{self.device} {bytes_per_s}")
            else:
                (self.group / "io.max").write_text(f"{self.device} rbps={bytes_per_s}")
        except BaseException:
            self.group.rmdir()
            raise
        self.pids: list[int] = []

    def add(self, pid: int) -> None:
        """Put process ``pid`` (all its threads) in the group."""
        (self.group / "cgroup.procs").write_text(str(pid))
        self.pids.append(pid)

    def close(self) -> None:
        """Move the members still alive back to the root group and remove the group."""
        if not self.group.exists():
            return
        for pid in (self.group / "cgroup.procs").read_text().split():
            try:
                (self._root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        self.group.rmdir()

    def __enter__(self) -> ReadThrottle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
