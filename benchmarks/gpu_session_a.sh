#!/bin/bash
# Kernels + precision + model re-measure in one device call. Outputs under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH=$PWD
SECONDS=0
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -2; echo "### build ${SECONDS}s"
timeout 120 python3 -m pytest -m cuda tests -q -x -p no:cacheprovider -W ignore 2>&1 | tail -6 | tee "$OUT/pytest_cuda.log"; echo "### tests ${SECONDS}s"
timeout 60 python3 benchmarks/bench_kernels.py --reps 30 --no-compile --out "$OUT/kernels" 2>&1 | tail -12; echo "### kernels ${SECONDS}s"
timeout 240 python3 benchmarks/precision_bench.py --out "$OUT" --reps 15 2>&1 | grep -v Warning | tail -14; echo "### precision ${SECONDS}s"
left=$((540 - SECONDS)); [ $left -gt 60 ] && timeout $left python3 benchmarks/run_models.py --configs vit_b_16:64,glm4-9b-4l:8 --budget-s $((left - 50)) --reps 20 --warmup 3 --out "$OUT" 2>&1 | grep -v Warning | tail -16
echo "### done ${SECONDS}s"
