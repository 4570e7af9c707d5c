"""scripts/progress.sh, the helpers every CI script sources, under the scripts' own shell options.

The ci-*.sh scripts run with `set -euo pipefail`; a helper whose pipeline status differs from
the command it wraps stops them without a word (pip_quiet once did, for a pip that printed
nothing, and no engine virtualenv could be built from a fresh clone). A fake `python` stands in
for pip here: what is tested is the shell plumbing, not pip.
"""

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = "Location 'file:///nowhere' is ignored: it is neither a file nor a directory."


def fake_python(tmp_path, lines, rc):
    """An executable that, run as `PY -m pip ...`, prints LINES on stderr and exits RC."""
    path = tmp_path / "python"
    body = "".join(f"echo {line!r} >&2\n" for line in lines)
    path.write_text(f"#!/bin/sh\n{body}exit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_helper(snippet, options="set -euo pipefail"):
    script = f'{options}\ncd "{ROOT}"\n. scripts/progress.sh\n{snippet}\necho "after rc=$?"\n'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LC_ALL": "C"})


@pytest.mark.parametrize("options", ["set -euo pipefail", "set -uo pipefail"])
@pytest.mark.parametrize("lines", [[], [NOISE], [NOISE, NOISE]], ids=["silent", "noise", "noise2"])
def test_a_quiet_successful_pip_is_a_success(tmp_path, options, lines):
    py = fake_python(tmp_path, lines, 0)
    r = run_helper(f'pip_quiet "{py}" install -q x', options)
    assert r.returncode == 0 and "after rc=0" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "is ignored" not in r.stdout + r.stderr, r.stdout


def test_with_progress_around_pip_quiet_keeps_success(tmp_path):
    py = fake_python(tmp_path, [], 0)
    r = run_helper(f'with_progress "label" pip_quiet "{py}" install -q x')
    assert r.returncode == 0 and "after rc=0" in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_a_failing_pip_keeps_its_status_and_its_error(tmp_path):
    py = fake_python(tmp_path, [NOISE, "ERROR: No matching distribution found for x"], 3)
    r = run_helper(f'pip_quiet "{py}" install -q x || echo "pip said $?"')
    assert "pip said 3" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "ERROR: No matching distribution found for x" in r.stdout, r.stdout
    assert "is ignored" not in r.stdout, r.stdout


def test_a_failing_pip_stops_a_set_e_script(tmp_path):
    py = fake_python(tmp_path, ["ERROR: broken"], 4)
    r = run_helper(f'with_progress "label" pip_quiet "{py}" install -q x')
    assert r.returncode != 0 and "after rc" not in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "ERROR: broken" in r.stdout, r.stdout
