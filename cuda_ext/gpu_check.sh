#!/bin/bash
# One GPU session for cuda_ext: install, build the kernels, run the cuda-marked tests,
# benchmark, then compute-sanitizer memcheck + racecheck on a small driver. Everything lands
# in $OUT (or /tmp/gpu_check_out). Each step is bounded so the whole run fits BUDGET seconds.
#   bash cuda_ext/gpu_check.sh [BUDGET_SECONDS]
set -u
BUDGET=${1:-400}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache GRAPHOPT_KERNELS=cuda
export TRITON_CACHE_DIR=/tmp/triton-cache
PY=${PY:-python3}
left() { echo $(( BUDGET - SECONDS )); }
step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  local t=$(( $(left) - 5 )); (( t > max )) && t=$max
  if (( t < 15 )); then echo "### $name: skipped (no time left)"; return 99; fi
  echo "### $name (limit ${t}s, ${SECONDS}s elapsed)"
  timeout "$t" "$@"; local rc=$?
  echo "### $name: rc=$rc at ${SECONDS}s"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), sys.version.split()[0])"
if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || \
   ! $PY -c "import graphopt.cuda_ext.build" 2>/dev/null; then
  echo "editable install failed ($(tail -1 /tmp/pip.log)); using a shim package dir"
  mkdir -p /tmp/shim && cp -r graphopt /tmp/shim/ && ln -sfn "$PWD/cuda_ext" /tmp/shim/graphopt/cuda_ext \
    && ln -sfn "$PWD/passes" /tmp/shim/graphopt/passes && ln -sfn "$PWD/examples" /tmp/shim/graphopt/examples
  export PYTHONPATH=/tmp/shim
fi

step build 150 $PY -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tee "$OUT/build.log"
cp /tmp/graphopt-cache/ext/*/build.log "$OUT/ninja_build.log" 2>/dev/null
so=$(ls /tmp/graphopt-cache/ext/*/graphopt_kernels.so 2>/dev/null | head -1)
if [ -z "$so" ]; then echo "BUILD FAILED"; tail -40 "$OUT/ninja_build.log"; exit 1; fi
cuobjdump --dump-resource-usage "$so" 2>/dev/null | grep -E "spill|STACK" | grep -v "STACK:0 .*LOCAL:0" | head -5

step pytest 140 $PY -m pytest -m cuda tests/cuda_ext -q -p no:cacheprovider --maxfail=25 -W ignore 2>&1 | tee "$OUT/pytest.log" | tail -40
step bench 100 $PY benchmarks/bench_kernels.py --no-compile --out "$OUT/kernels_h200" 2>&1 | tail -25
step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 $PY tests/cuda_ext/sanitize_driver.py >"$OUT/memcheck.log" 2>&1
tail -4 "$OUT/memcheck.log"
step racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 9 $PY tests/cuda_ext/sanitize_driver.py >"$OUT/racecheck.log" 2>&1
tail -4 "$OUT/racecheck.log"
step bench_compile 150 $PY benchmarks/bench_kernels.py --reps 30 --out "$OUT/kernels_h200_compile" 2>&1 | tail -14
echo "### done at ${SECONDS}s"
