#!/usr/bin/env bash
# The nixl transport's tests on real NIXL 1.5.1 (UCX backend), from a fresh clone; scripts/test-all calls this.
#
# Idempotent: creates .venvs/nixl on first use (CPU torch pinned in the same
# command: an unpinned nixl pulls a multi-GB CUDA torch), puts this checkout of
# kvfabric on its path (scripts/engine-venv.sh) and runs
# tests/integration/test_transport_nixl.py: real `kvfabric serve --transports
# tcp,native,nixl` processes on loopback, each test over UCX_TLS=tcp and
# UCX_TLS=sm,self. Extra arguments go to pytest. NIXL_VENV overrides the
# virtualenv's path. A crash at exit (rc 139: seen when Debian's
# ibverbs-providers sits beside NIXL's own libraries) fails the part with that said.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh
. scripts/engine-venv.sh
VENV_ONLY=0
if [ "${1:-}" = "--venv-only" ]; then VENV_ONLY=1; shift; fi
PY=${PYTHON:-python3}
VENV=${NIXL_VENV:-.venvs/nixl}
TORCH_PIN=torch==2.13.0
NIXL_PIN=nixl==1.5.1

have_nixl() {
  "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
assert md.version("nixl") == "1.5.1", md.version("nixl")
assert md.version("torch").startswith("2.13.0"), md.version("torch")
from nixl._api import nixl_agent  # noqa: F401
import pytest, pytest_timeout  # noqa: F401
PYEOF
}

if [ ! -x "$VENV/bin/python" ] || ! have_nixl; then
  echo "ci-nixl: building $VENV ($TORCH_PIN, $NIXL_PIN)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  with_progress "ci-nixl: pip install $NIXL_PIN $TORCH_PIN" pip_quiet "$VENV/bin/python" install -q "$TORCH_PIN" "$NIXL_PIN"
  pip_quiet "$VENV/bin/python" install -q pytest pytest-timeout
  have_nixl || { echo "ci-nixl: $VENV does not hold $NIXL_PIN + $TORCH_PIN"; exit 1; }
fi

checkout_on_path "$VENV" || exit 1
[ "$VENV_ONLY" = 1 ] && { echo "ci-nixl: $VENV ready"; exit 0; }
native_built "$VENV" || exit 1

# A bound on the whole part, far above its time (~40 s at load 4); SIGINT, so pytest still prints what ran.
set +e
# KVFABRIC_NIXL_CONFORMANCE=1: also the client conformance suite on its (native-nixl, nixl) pair
# (kvfabric.testing.conformance; ~5 min at load 5, so not by default: test-all's budget for this part is ~4)
tests=(tests/integration/test_transport_nixl.py)
if [ "${KVFABRIC_NIXL_CONFORMANCE:-0}" = 1 ]; then tests+=(tests/integration/test_client_*.py -k "nixl"); fi
timeout -s INT -k 60 1800 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=8 "${tests[@]}" "$@"
rc=$?
set -e
if [ "$rc" -ge 128 ]; then
  echo "ci-nixl: pytest died with signal $((rc - 128)) (rc $rc): a crash at exit is a failure here"
fi
exit "$rc"
