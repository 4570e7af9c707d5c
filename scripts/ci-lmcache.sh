#!/usr/bin/env bash
# LMCache plugin tests on real LMCache 0.5.6, from a fresh clone; scripts/test-all calls this.
#
# Idempotent: creates .venvs/lmcache on first use (CPU torch pinned first: an
# unpinned torch would pull a multi-GB CUDA build, then lmcache==0.5.6), puts
# this checkout of kvfabric on its path (scripts/engine-venv.sh), and
# runs tests/e2e/lmcache (real `kvfabric serve` processes on loopback, real
# LMCache engines with a CPU stand-in for the GPU connector). Extra arguments go
# to pytest. Runtime once the virtualenv exists: under a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh
. scripts/engine-venv.sh
# --venv-only: build the virtualenv and stop (scripts/test-all runs that in the background)
VENV_ONLY=0
if [ "${1:-}" = "--venv-only" ]; then VENV_ONLY=1; shift; fi
PY=${PYTHON:-python3}
VENV=.venvs/lmcache
TORCH_PIN=torch==2.13.0
LMCACHE_PIN=lmcache==0.5.6

have_engine() {
  "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
assert md.version("lmcache") == "0.5.6", md.version("lmcache")
assert md.version("torch").startswith("2.13.0"), md.version("torch")
import pytest, pytest_timeout  # noqa: F401
PYEOF
}

if [ ! -x "$VENV/bin/python" ] || ! have_engine; then
  echo "ci-lmcache: building $VENV ($TORCH_PIN, $LMCACHE_PIN)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  with_progress "ci-lmcache: pip install $TORCH_PIN" pip_quiet "$VENV/bin/python" install -q "$TORCH_PIN"
  with_progress "ci-lmcache: pip install $LMCACHE_PIN" pip_quiet "$VENV/bin/python" install -q "$LMCACHE_PIN" "$TORCH_PIN"
  pip_quiet "$VENV/bin/python" install -q pytest pytest-timeout
  have_engine || { echo "ci-lmcache: $VENV does not hold $LMCACHE_PIN + $TORCH_PIN"; exit 1; }
fi

# kvfabric from this checkout: a .pth file puts the checkout and connectors/ on the
# venv's path, with kvfabric's own dependencies (no second build: the native extension
# is the one the dev venv built in place, same interpreter).
checkout_on_path "$VENV" || exit 1
[ "$VENV_ONLY" = 1 ] && { echo "ci-lmcache: $VENV ready"; exit 0; }
native_built "$VENV" || exit 1

# A bound on the whole part, far above its time at load 20 (~1 min quiet, ~4 at load 5-9
# beside a CPU hog); SIGINT, so pytest still prints what ran, failed and took long.
exec timeout -s INT -k 120 1800 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/e2e/lmcache "$@"
