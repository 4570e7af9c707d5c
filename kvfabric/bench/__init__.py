"""``kvfabric bench ...``: benchmarks that print a table and write JSON.

Each submodule has ``main(argv) -> int``; ``benchmarks/<name>.py`` are thin
wrappers around them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) process ``pid`` (or its thread ``tid``) has used so far, from
    ``/proc/PID/stat`` (``/proc/PID/task/TID/stat``)."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_json(path: str | Path, report: Any, *, indent: int = 2) -> Path:
    """Write a benchmark's JSON report (creating its folder) and say where; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=indent, default=str))
    print(f"wrote {out}")
    return out
