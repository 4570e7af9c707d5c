"""csrc/ is layers: no call cycle between C files (scripts/c-layers.py, which compiles each file
and reads its symbols with nm). A failure prints every cycle with the symbols on its edges."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "scripts" / "c-layers.py"


def layers(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)


def test_csrc_has_no_call_cycle_between_files():
    r = layers()
    assert r.returncode == 0, f"scripts/c-layers.py found a call cycle (calls must go one way):\n{r.stdout}{r.stderr}"
    assert "no call cycle" in r.stdout and "kvf_server.c" in r.stdout, r.stdout
    top = r.stdout.splitlines()[1]
    assert "kvf_module.c" in top, f"the module init should be the top layer:\n{r.stdout}"


def test_a_cycle_is_found_and_named(tmp_path):
    (tmp_path / "a.c").write_text("int b_fn(void);\nint a_fn(void) { return b_fn(); }\n")
    (tmp_path / "b.c").write_text("int c_fn(void);\nint b_fn(void) { return c_fn(); }\n")
    (tmp_path / "c.c").write_text("int a_fn(void);\nint c_fn(void) { return a_fn(); }\n")
    (tmp_path / "d.c").write_text("int a_fn(void);\nint d_fn(void) { return a_fn(); }\n")
    r = layers("--csrc", str(tmp_path))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "cycle: a.c b.c c.c" in r.stdout, r.stdout
    assert "a.c -> b.c: b_fn" in r.stdout and "c.c -> a.c: a_fn" in r.stdout, r.stdout
    assert "d.c ->" not in r.stdout, f"d.c is above the cycle, not in it:\n{r.stdout}"


def test_layers_are_printed_top_first(tmp_path):
    (tmp_path / "low.c").write_text("int low(void) { return 1; }\n")
    (tmp_path / "mid.c").write_text("int low(void);\nint mid(void) { return low(); }\n")
    (tmp_path / "top.c").write_text("int mid(void);\nint low(void);\nint top(void) { return mid() + low(); }\n")
    r = layers("--csrc", str(tmp_path))
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = [l.split()[1] for l in r.stdout.splitlines()[1:]]
    assert lines == ["top.c", "mid.c", "low.c"], r.stdout
