# Answered: Does linking the shared libstdc++ stop a failing TORCH_CHECK crashing the H200 image? No, cause open; the Python wrappers check arguments first (results/archive/SUMMARY_history.md, 'The C++-check crash').
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHOPT_CACHE_DIR=/tmp/graphopt-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH=$PWD
timeout 150 python3 -m graphopt.cuda_ext.build --arch sm_90 2>&1 | tail -1
cat > /tmp/bad.py <<'PY'
import sys, torch, graphopt.cuda_ext as ce
which = sys.argv[1]
try:
    if which == "swiglu":
        torch.ops.graphopt.swiglu(torch.randn(4, 7, device="cuda"))
    elif which == "pool":
        torch.ops.graphopt.max_pool2d_nhwc(torch.randn(2, 16, 6, 6, device="cuda"), 3, 2, 2)
    elif which == "swiglu_cpu":
        torch.ops.graphopt.swiglu(torch.randn(4, 7))
    print("no error")
except Exception as e:
    print("raised", type(e).__name__, str(e).splitlines()[0][:100])
PY
for w in swiglu pool; do
  timeout 60 python3 /tmp/bad.py $w > /tmp/o.txt 2>&1; echo "$w rc=$? $(tail -1 /tmp/o.txt)"
  TORCH_SHOW_CPP_STACKTRACES=1 timeout 60 python3 /tmp/bad.py $w > /tmp/o.txt 2>&1; echo "$w stacktraces=1 rc=$? $(tail -1 /tmp/o.txt)"
done
timeout 100 python3 -m pytest -m cuda tests/cuda_ext/test_kernels.py -q -p no:cacheprovider -W ignore 2>&1 | grep -E "passed|failed|Fatal" | tail -2
which gdb && timeout 120 gdb -batch -ex run -ex bt --args python3 /tmp/bad.py swiglu 2>&1 | grep -E "^#|signal" | head -40
so=$(ls /tmp/graphopt-cache/ext/*/graphopt_kernels.so | head -1); echo "$so"
readelf -S "$so" | grep -E "eh_frame|gcc_except" ; nm -D "$so" | grep -c " U " ; ldd "$so" | grep -E "stdc|torch|c10" | head
echo "--- NEEDED"; readelf -d "$so" | grep NEEDED
echo "--- exception runtime symbols (D: defined here, U: from a shared library)"
nm -D "$so" | grep -E "__cxa_throw|__cxa_begin_catch|__cxa_allocate_exception|_Unwind_Resume|__gxx_personality" | head
echo "--- link line"; grep -h -E "\-shared" /tmp/graphopt-cache/ext/*/build.ninja 2>/dev/null | head -3
g++ --version | head -1; c++ -v 2>&1 | grep -i "configured\|static" | head -2
