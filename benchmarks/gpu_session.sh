#!/bin/bash
# One device session: install, build the kernels, run every cuda-marked test, then the model
# benchmark for the configs given (MODEL:BATCH list) within BUDGET seconds. Outputs under $OUT.
#   bash benchmarks/gpu_session.sh "bert-base:64,glm4-9b-4l:8" 330
set -u
CONFIGS=${1:-}
BUDGET=${2:-300}
TESTS=${3:-1}
OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { echo "pip -e failed: $(tail -1 /tmp/pip.log)"; export PYTHONPATH=$PWD; }
SECONDS=0
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -3
echo "### build done at ${SECONDS}s"
if [ "$TESTS" = 1 ]; then
  timeout 150 python3 -m pytest -m cuda tests -q -p no:cacheprovider -W ignore 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
  echo "### cuda tests done at ${SECONDS}s"
fi
if [ -n "$CONFIGS" ]; then
  timeout $((BUDGET + 90)) python3 benchmarks/run_models.py --configs "$CONFIGS" --budget-s "$BUDGET" --reps 30 --warmup 5 \
     --out "$OUT" 2>&1 | tee "$OUT/models.log" | tail -60
fi
echo "### all done at ${SECONDS}s"
