#!/bin/bash
# Second device session: lowering tests, a ViT kernel profile with per-pass ablation, then the
# model benchmark for the configs given.
set -u
OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH=$PWD
SECONDS=0
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -1
timeout 100 python3 -m pytest -m cuda tests/test_lower.py tests/test_api.py -q -p no:cacheprovider -W ignore 2>&1 | tee "$OUT/pytest_lower.log" | tail -4
echo "### tests done at ${SECONDS}s"
timeout 120 python3 benchmarks/profile_model.py vit_b_16 --batch 64 --ablate --out "$OUT" 2>&1 | tail -45
echo "### profile done at ${SECONDS}s"
timeout $(( 560 - SECONDS )) python3 benchmarks/run_models.py --configs "$1" --budget-s $(( 470 - SECONDS )) --reps 30 --warmup 5 \
   --out "$OUT" 2>&1 | tee "$OUT/models.log" | tail -32
echo "### all done at ${SECONDS}s"
