#!/usr/bin/env bash
# Issue 21's GPU check: ONE prepared run on a lent GPU machine (the device tool), from a checkout.
#
# Installs nothing from any package registry: the machine's image holds Python 3.12, torch with
# CUDA, numpy, msgpack, xxhash, prometheus-client, pytest, gcc/nvcc. Steps, each logged under $OUT
# (default ./gpu-results; at most 7 files, as the device tool brings back 8):
#   1. env.txt     nvidia-smi, kernel, Python / torch / CUDA versions, loadavg, which pool server
#   2. build.log   the C extension built in place (setup.py build_ext --inplace) and the product
#                  server started once; if either fails (no compiler or headers, or a sandbox
#                  without io_uring), the tests and the benchmark use the pure-Python reference
#                  server over tcp (KVFABRIC_GPU_SERVER / --server)
#   3. tests-gpu.log   pytest tests/gpu (the transfer core on CUDA KV tensors, real pool servers)
#   4. bench.txt + gpu_transfer_<layout>.json   benchmarks/gpu_transfer.py for FlashAttention's
#                  layout (LBNHC), the CPU / FlashInfer-SM100 one (LBHNC) and a head-outer one (LHBNC)
# Exit status: 0 when the tests and every benchmark run passed. About 3-5 minutes on an H200.
# Usage (device tool): bash scripts/gpu-check.sh        (the tool sets OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/connectors${PYTHONPATH:+:$PYTHONPATH}"
rc=0

{ date -u; uname -a; echo "loadavg: $(cat /proc/loadavg)"; echo "cpus: $(nproc)"; nvidia-smi || echo "no nvidia-smi"
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
             torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")'
  "$PY" -c 'import numpy, msgpack, xxhash, prometheus_client, pytest; print("python deps: ok")'
} > "$OUT/env.txt" 2>&1

server=reference
if timeout 300 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  echo "== C extension built; starting the product server once" >> "$OUT/build.log"
  if timeout 60 "$PY" -c 'from kvfabric.testing.servers import start_server
s = start_server(capacity="64MiB"); print("product server started:", s.address); s.stop()' >> "$OUT/build.log" 2>&1
  then server=native; fi
else
  echo "== the C extension did not build: reference server, tcp" >> "$OUT/build.log"
fi
echo "pool server for the tests and the benchmark: $server" | tee -a "$OUT/env.txt"
cat "$OUT/env.txt"
export KVFABRIC_GPU_SERVER=$server

timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/tests-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

for layout in LBNHC LBHNC LHBNC; do
  echo "== benchmarks/gpu_transfer.py --layout $layout --server $server" | tee -a "$OUT/bench.txt"
  timeout 180 "$PY" benchmarks/gpu_transfer.py --layout "$layout" --server "$server" \
    --out "$OUT/gpu_transfer_$layout.json" 2>&1 | tee -a "$OUT/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
echo "gpu-check: rc=$rc; results under $OUT" | tee -a "$OUT/bench.txt"
exit $rc
