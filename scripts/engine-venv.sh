# Sourced by scripts/ci-vllm.sh and scripts/ci-lmcache.sh (run from the repository root).
# checkout_on_path VENV: install kvfabric's dependencies into VENV when missing and make
#   VENV's python import kvfabric and the connectors from this
#   checkout through a .pth file (an earlier `pip install -e` of kvfabric is removed first,
#   its finder would win). Nothing is compiled here, so it is safe to run while tests use
#   the native extension.
# native_built VENV: the checkout's native extension imports in VENV; builds it in place
#   when it is missing (ci-*.sh run alone, without scripts/test-all's dev venv).
checkout_on_path() {
  local venv=$1 site
  "$venv/bin/python" -c "import xxhash, msgpack, numpy, prometheus_client" 2>/dev/null \
    || pip_quiet "$venv/bin/python" install -q xxhash msgpack numpy prometheus-client || return 1
  if "$venv/bin/python" -m pip show -q kvfabric >/dev/null 2>&1; then
    pip_quiet "$venv/bin/python" uninstall -q -y kvfabric
  fi
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$(pwd)" "$(pwd)/connectors" >"$site/kvfabric-checkout.pth"
}

native_built() {
  local venv=$1
  "$venv/bin/python" -c "import kvfabric._native" 2>/dev/null && return 0
  echo "$(basename "$venv"): building the native extension in place"
  pip_quiet "$venv/bin/python" install -q 'setuptools>=77' && KVFABRIC_NATIVE_REQUIRED=1 "$venv/bin/python" setup.py -q build_ext --inplace \
    && "$venv/bin/python" -c "import kvfabric._native" || { echo "native extension does not build or import"; return 1; }
}
