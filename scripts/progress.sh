# Sourced by scripts/test-all and scripts/ci-*.sh.
# with_progress LABEL CMD...: run CMD (a long, quiet install), printing "LABEL: still running (N s)"
# every 30 s so a log shows it is alive; returns CMD's exit status.
with_progress() {
  local label=$1 t=0 pid
  shift
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    t=$((t + 5))
    if [ $((t % 30)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then echo "$label: still running ($t s)"; fi
  done
  wait "$pid"
}
# pip_quiet PYTHON ARGS...: PYTHON -m pip ARGS, without the "Location 'file:///...' is ignored:
# it is neither a file nor a directory" line that pip prints for every package when its
# configuration names local index folders that lack it (this workplace's machines do: one
# line per package and folder, ~300 in a full run); every other line is kept. Returns pip's status,
# also under `set -euo pipefail` (the ci-*.sh scripts): a quiet pip that prints nothing must not
# read as a failure, which grep's "no line selected" status would be under pipefail (that killed
# the engines' virtualenv builds without a word).
pip_quiet() {
  local py=$1
  shift
  "$py" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
