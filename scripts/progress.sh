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
