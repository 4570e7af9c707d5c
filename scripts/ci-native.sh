#!/usr/bin/env bash
# CI for the native part (csrc/): idempotent, from the repository's files alone.
#
# 1. the regular build (the one `pip install -e .` made, rebuilt here with
#    warnings as errors and renamed into place; a failed compile is an error),
#    then tests/native;
# 2. an AddressSanitizer build in a copy of the tree under .venvs/native-asan/
#    (so the dev build is untouched), then tests/native, the conformance pairs
#    that run the C server (native-tcp, native-native, native-shm: the C client
#    too, against it and through the tests' fault proxies) and the SSD tier's
#    tests with libasan preloaded; server subprocesses inherit it. The
#    reference-native pair (C client, Python server) runs in the plain build
#    only: under ASan it repeated the native-native client paths for ~60 s.
# Needs gcc, the Python headers and <linux/io_uring.h>; nothing else.
# A failing build stops the script; a failing test step does not: every step
# runs (so the ASan pairs run even after a plain test failed) and the exit
# status says whether any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh
ROOT=$(pwd)
PY=${KVFABRIC_PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { echo "ci-native: no dev virtualenv at $PY (run scripts/test-all first)"; exit 1; }

failed=()
run_step() { # name, command...: run it, remember a failure, go on
  local name=$1; shift
  "$@" || failed+=("$name")
}

# setup.py runs here outside pip's isolated build, on the venv's own setuptools: pyproject.toml's
# SPDX license string needs setuptools >= 77 (an older one stops at "project.license must be valid")
pip_quiet "$PY" install -q 'setuptools>=77' || { echo "ci-native: cannot install setuptools>=77"; exit 1; }

echo "== native: regular build (-Werror) + tests/native"
# Built outside the tree, then renamed over the in-place extension: other parts may be running tests on
# it meanwhile (scripts/test-all runs the vLLM part beside this one), and a process that has the old file
# mapped keeps it (a rename), where build_ext --inplace would rewrite it under them (SIGBUS).
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-native.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT
CFLAGS="-Werror" "$PY" setup.py -q build_ext --build-lib "$BUILD/lib" --build-temp "$BUILD/temp"
SO=$(cd "$BUILD/lib" && ls kvfabric/_native*.so)
cp "$BUILD/lib/$SO" "${SO%.so}.new.so" && mv -f "${SO%.so}.new.so" "$SO"  # *.so: ignored by git meanwhile
run_step "tests/native" "$PY" -m pytest -q -p no:cacheprovider tests/native

echo "== native: AddressSanitizer build + tests/native + native conformance pairs"
WORK=$ROOT/.venvs/native-asan
rm -rf "$WORK/src"
mkdir -p "$WORK/src"
# tracked files plus untracked ones that git does not ignore (the working tree as CI sees it)
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
cd "$WORK/src"
CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g -O1" \
  LDFLAGS="-fsanitize=address" "$PY" setup.py -q build_ext --inplace
LIBASAN=$(gcc -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "ci-native: libasan not found ($LIBASAN)"; exit 1; }
# detect_leaks=0: CPython itself keeps memory alive at exit; ASan still catches
# overflows, use-after-free and double frees in csrc/.
export LD_PRELOAD=$LIBASAN ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONPATH=$WORK/src
"$PY" -c "import kvfabric._native as n, sys; assert n.__file__.startswith('$WORK/src'), n.__file__"
run_step "tests/native (ASan)" "$PY" -m pytest -q -p no:cacheprovider tests/native
run_step "conformance pairs (ASan)" "$PY" -m pytest -q -p no:cacheprovider --durations=10 tests/integration \
  -k "native-tcp or native-native or native-shm"
run_step "SSD tier (ASan)" "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_ssd_tier.py
if [ ${#failed[@]} -gt 0 ]; then
  echo "ci-native: FAILED: ${failed[*]}"
  exit 1
fi
echo "ci-native: all passed"
