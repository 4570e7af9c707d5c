"""``kvfabric bench ...``: benchmarks that print a table and write JSON.

Each submodule has ``main(argv) -> int``; ``benchmarks/<name>.py`` are thin
wrappers around them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, report: Any, *, indent: int = 2) -> Path:
    """Write a benchmark's JSON report (creating its folder) and say where; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=indent, default=str))
    print(f"wrote {out}")
    return out
