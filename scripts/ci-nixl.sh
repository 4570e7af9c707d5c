#!/usr/bin/env bash
# The nixl transport's tests on real NIXL 1.5.1 (UCX backend), from a fresh clone; scripts/test-all calls this.
#
# Idempotent: creates .venvs/nixl on first use (CPU torch pinned in the same
# command: an unpinned nixl pulls a multi-GB CUDA torch), puts this checkout of
# kvfabric on its path (scripts/engine-venv.sh) and runs
# tests/integration/test_transport_nixl.py: real `kvfabric serve --transports
# tcp,native,nixl` processes on loopback, each test over UCX_TLS=tcp and
# UCX_TLS=sm,self, then the client conformance suite's nixl pair over UCX tcp and
# over UCX shared memory (KVFABRIC_NIXL_CONFORMANCE, below). Extra arguments go to pytest. NIXL_VENV overrides the
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

# Two runs, each bounded far above its time; SIGINT, so pytest still prints what ran.
#  1. tests/integration/test_transport_nixl.py, every test over UCX tcp and UCX shared memory (~55 s quiet);
#  2. the client conformance suite (kvfabric.testing.conformance) on its (native-nixl, nixl) pair, once per
#     UCX transport set in KVFABRIC_NIXL_CONFORMANCE (default "tcp sm,self", ~65 s each quiet; "tcp" for
#     tcp alone, "none" skips it).
set +e
rc=0
run_pytest() {
  timeout -s INT -k 60 1800 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=8 "$@"
  local r=$?
  if [ "$r" -ge 128 ]; then
    echo "ci-nixl: pytest died with signal $((r - 128)) (rc $r): a crash at exit is a failure here"
  fi
  [ "$r" -eq 0 ] || rc=$r
}
run_pytest tests/integration/test_transport_nixl.py "$@"
for tls in ${KVFABRIC_NIXL_CONFORMANCE-tcp sm,self}; do
  [ "$tls" = none ] && continue
  echo "ci-nixl: the conformance suite's nixl pair over UCX_TLS=$tls"
  UCX_TLS=$tls run_pytest tests/integration/test_client_*.py -k "nixl" "$@"
done
set -e
exit "$rc"
