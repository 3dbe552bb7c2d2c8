#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH=$PWD
SECONDS=0
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -1; echo "### build ${SECONDS}s"
timeout 150 python3 benchmarks/diag_checkpoint.py 2>&1 | grep -v "Warning\|warn(\|return cls" | tail -45; echo "### diag ${SECONDS}s"
timeout $((560 - SECONDS)) python3 benchmarks/precision_bench.py --out "$OUT" --reps 15 2>&1 | grep -v Warning | grep "^|\|^-" | tail -10; echo "### precision ${SECONDS}s"
