#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH=$PWD
SECONDS=0
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -1; echo "### build ${SECONDS}s"
timeout 300 python3 benchmarks/checkpoint_bench.py --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tail -40; echo "### ckpt ${SECONDS}s"
timeout 60 python3 benchmarks/diag_precision.py bert-base 64 2>&1 | grep -v "Warning\|warn(" | tail -3; echo "### diag ${SECONDS}s"
left=$((560 - SECONDS)); [ $left -gt 90 ] && timeout $left python3 benchmarks/run_models.py --configs "${1:-vit_b_16:64,resnet50:1,bert-base:1}" --budget-s $((left - 60)) --reps 20 --warmup 3 --out "$OUT" 2>&1 | grep -v Warning | tail -22
echo "### done ${SECONDS}s"
