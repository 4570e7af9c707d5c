#!/usr/bin/env bash
# The packaged kvfabric, as a user installs it; standalone (bash scripts/ci-wheel.sh), scripts/test-all
# runs it as the `wheel` part.
#
# 1. `python -m build` (the `build` package, in a throwaway virtualenv) makes the sdist and, from
#    that sdist, the wheel, out of a copy of the working tree (tracked files and untracked ones git
#    does not ignore: a stale kvfabric.egg-info or an in-place _native.so never leaks in), into a
#    temporary directory; the build output must hold no deprecation warning;
# 2. the sdist holds every C source and header the extension needs, the wheel the kvfabric
#    package with its compiled _native, and the connectors' packages pyproject.toml declares;
# 3. the wheel (not editable) goes into a fresh virtualenv (its dependencies from pip), and from a
#    temporary directory outside the checkout (so the checkout cannot be what is imported):
#    `kvfabric --version`, `import kvfabric._native`, a real `kvfabric serve --port 0` from that
#    virtualenv, waited for until it prints its listening line, one object PUT and GET back
#    byte-exact by the installed Client, then SIGTERM and a clean exit.
# Needs python3 with venv, gcc and the Python headers; every package comes from pip. Prints
# "N passed, N failed" last; the exit status is non-zero if any check failed. The temporary
# directory is removed at exit (KVFABRIC_KEEP_WHEEL_WORK=1 keeps it, and says where).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/progress.sh
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-wheel.XXXXXX") || exit 1
mkdir -p "$WORK/logs" "$WORK/run"
SERVER_PID=

cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then kill -KILL "$SERVER_PID"; fi
  if [ "${KVFABRIC_KEEP_WHEEL_WORK:-0}" = 1 ]; then echo "ci-wheel: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

passed=0
failed=0
# check NAME CMD...: run CMD with its output in $WORK/logs; on failure print that output
check() {
  local name=$1 log
  shift
  log="$WORK/logs/$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1))
    echo "ok     $name"
  else
    failed=$((failed + 1))
    echo "FAILED $name"
    sed 's/^/    | /' "$log" | tail -n 60
    return 1
  fi
}
finish() {
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit
}

# ---- 1. build
echo "== ci-wheel: build the sdist and the wheel (in $WORK)"
SRC=$WORK/src
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"
  done | tar --null -T - -cf - | tar -xf - -C "$SRC"
else  # not a git checkout (an unpacked sdist or tarball): everything but what builds and venvs leave
  tar --exclude=./.git --exclude=./.venv --exclude=./.venvs --exclude=./build --exclude=./dist \
      --exclude='*.egg-info' --exclude='*.so' --exclude='*.o' -cf - . | tar -xf - -C "$SRC"
fi

build_tools() {
  "$PY" -m venv "$WORK/build-venv" && pip_quiet "$WORK/build-venv/bin/python" install -q --upgrade pip build
}
check "a virtualenv with the build package" build_tools || finish
[ -x "$WORK/build-venv/bin/python" ] || finish

build_dists() {
  "$WORK/build-venv/bin/python" -m build -o "$WORK/dist" "$SRC" >"$WORK/build.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then   # the compiler's own error lines first: the traceback after them says little
    grep -E "error:|^ERROR" "$WORK/build.log" | head -n 20
    echo "... the end of the build output:"
    tail -n 30 "$WORK/build.log"
    return "$rc"
  fi
  ls "$WORK"/dist/kvfabric-*.tar.gz "$WORK"/dist/kvfabric-*.whl
}
check "python -m build makes an sdist and a wheel (from the sdist)" \
  with_progress "ci-wheel: python -m build (compiles the C extension)" build_dists
SDIST=$(ls "$WORK"/dist/kvfabric-*.tar.gz 2>/dev/null | head -n 1)
WHEEL=$(ls "$WORK"/dist/kvfabric-*.whl 2>/dev/null | head -n 1)
[ -n "$SDIST" ] && [ -n "$WHEEL" ] || finish
echo "   $(basename "$SDIST"): $(du -k "$SDIST" | cut -f1) KiB; $(basename "$WHEEL"): $(du -k "$WHEEL" | cut -f1) KiB"

no_deprecations() {
  # setuptools' and pip's deprecation notices (SetuptoolsDeprecationWarning blocks, "... is deprecated")
  ! grep -n -i -B2 -A6 "deprecat" "$WORK/build.log"
}
check "the build prints no deprecation warning" no_deprecations

# ---- 2. contents
sdist_has_sources() {
  local listing missing=0 f
  listing=$(tar -tzf "$SDIST" | sed 's|^[^/]*/||')
  for f in setup.py pyproject.toml MANIFEST.in LICENSE README.md; do
    grep -qxF "$f" <<<"$listing" || { echo "sdist lacks $f"; missing=1; }
  done
  # every C source and header of the checkout (setup.py compiles the .c files, they include the .h)
  while IFS= read -r f; do
    grep -qxF "$f" <<<"$listing" || { echo "sdist lacks $f"; missing=1; }
  done < <(cd "$SRC" && find csrc -type f \( -name '*.c' -o -name '*.h' \) | sort)
  if grep -E '\.(o|so)$' <<<"$listing"; then echo "sdist holds build products (above)"; missing=1; fi
  return "$missing"
}
check "the sdist holds setup.py, pyproject.toml and every csrc source and header" sdist_has_sources

wheel_has_packages() {
  "$WORK/build-venv/bin/python" - "$WHEEL" <<'PYEOF'
import re, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["kvfabric/__init__.py", "kvfabric/cli.py", "kvfabric/server/__init__.py", "kvfabric/bench/__init__.py",
        "kvfabric_vllm/__init__.py", "kvfabric_lmcache/__init__.py"]
missing = [n for n in need if n not in names]
if not any(re.fullmatch(r"kvfabric/_native\..*\.so", n) for n in names):
    missing.append("kvfabric/_native.*.so")
if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
    missing.append("*.dist-info/licenses/LICENSE")
if missing:
    sys.exit(f"the wheel lacks {missing}; it holds {sorted({n.split('/')[0] for n in names})}")
print(f"{len(names)} files; top level: {sorted({n.split('/')[0] for n in names})}")
PYEOF
}
check "the wheel holds kvfabric with _native, kvfabric_vllm and kvfabric_lmcache" wheel_has_packages

# ---- 3. install and run
VENV=$WORK/venv
install_wheel() {
  "$PY" -m venv "$VENV" && pip_quiet "$VENV/bin/python" install -q "$WHEEL"
}
check "the wheel installs into a fresh virtualenv (not editable)" \
  with_progress "ci-wheel: pip install the wheel" install_wheel
[ -x "$VENV/bin/kvfabric" ] || finish
cd "$WORK/run"   # outside the checkout: nothing imports from it

VERSION=$(basename "$WHEEL" | cut -d- -f2)
version_line() {
  local out
  out=$("$VENV/bin/kvfabric" --version) || return 1
  echo "$out"
  grep -q "^kvfabric $VERSION " <<<"$out"
}
check "kvfabric --version says $VERSION" version_line

installed_native() {
  "$VENV/bin/python" - "$VENV" <<'PYEOF'
import importlib.util, os, sys
import kvfabric, kvfabric._native
venv = os.path.realpath(sys.argv[1])
for mod in ("kvfabric", "kvfabric._native", "kvfabric_vllm", "kvfabric_lmcache"):
    spec = importlib.util.find_spec(mod)
    where = os.path.realpath(spec.origin if spec else "")
    assert spec and where.startswith(venv + os.sep), f"{mod} comes from {where or 'nowhere'}, not {venv}"
    print(mod, where)
from kvfabric import transport
assert "native" in transport.available(), transport.unavailable()
PYEOF
}
check "import kvfabric._native from the installed wheel" installed_native

serve_and_roundtrip() {
  local out=$WORK/serve.out err=$WORK/serve.err addr="" i rc
  "$VENV/bin/kvfabric" serve --host 127.0.0.1 --port 0 --capacity 16MiB >"$out" 2>"$err" </dev/null &
  SERVER_PID=$!
  for i in $(seq 1 600); do   # up to 60 s: CI machines may be loaded
    addr=$(sed -n 's/^kvfabric serve: listening on //p' "$out" | head -n 1)
    [ -n "$addr" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$addr" ]; then
    echo "kvfabric serve printed no listening line; stdout:"; cat "$out"; echo "stderr:"; cat "$err"
    return 1
  fi
  echo "listening on $addr"
  "$VENV/bin/python" - "$addr" <<'PYEOF' || { echo "server stderr:"; cat "$err"; return 1; }
import os, sys
from kvfabric import Client, ClientConfig

key, value = os.urandom(16), os.urandom(1 << 20)
with Client([sys.argv[1]], config=ClientConfig(timeout_s=30)) as c:
    res = c.put([key], [value])
    assert res.stored == 1, res
    got = c.get([key])
    assert got == [value], f"GET returned {None if got[0] is None else len(got[0])} bytes, not the 1 MiB stored"
    print(f"PUT and GET of 1 MiB byte-exact over {c.transports}")
PYEOF
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID"
  rc=$?
  SERVER_PID=
  [ "$rc" -eq 0 ] || { echo "kvfabric serve exited $rc on SIGTERM; stderr:"; cat "$err"; return 1; }
  echo "stopped by SIGTERM, exit 0"
}
check "kvfabric serve --port 0 from the wheel: PUT and GET byte-exact, SIGTERM exits 0" serve_and_roundtrip

finish
