#!/bin/bash
# Device session steps (outputs under $OUT):
#   core   build, every cuda-marked test, calibrate (with the efficiency fits), cost-model accuracy
#          with that profile, precision=auto vs hand-converted bf16
#   models run_models.py for the configs in $2 (MODEL:BATCH,...)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH=$PWD
SECONDS=0
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -1; echo "### build ${SECONDS}s"
case "$1" in
core)
  timeout 150 python3 -m pytest -m cuda tests -q -p no:cacheprovider -W ignore --tb=short -rf 2>&1 | grep -v "^DEBUG\|^INFO" > "$OUT/pytest_cuda.log"
  tail -30 "$OUT/pytest_cuda.log" | grep -E "passed|failed|Error|assert|FAILED" | tail -12; echo "### tests ${SECONDS}s"
  timeout 120 python3 -m graphopt.cli calibrate -o "$OUT/h200-calibrated.json" 2>&1 | tail -26; echo "### calibrate ${SECONDS}s"
  timeout 200 python3 benchmarks/cost_model_accuracy.py --profile "$OUT/h200-calibrated.json" --out "$OUT" 2>&1 | grep "^|" | tail -8; echo "### accuracy ${SECONDS}s"
  timeout $((570 - SECONDS)) python3 benchmarks/precision_bench.py --out "$OUT" --reps 15 2>&1 | grep -v Warning | grep "^|\|^-" | tail -10; echo "### precision ${SECONDS}s"
  ;;
models)
  timeout $((560 - SECONDS)) python3 benchmarks/run_models.py --configs "$2" --budget-s $((480 - SECONDS)) --reps 20 --warmup 3 --out "$OUT" 2>&1 | grep -v Warning | tail -30
  ;;
esac
echo "### done ${SECONDS}s"
