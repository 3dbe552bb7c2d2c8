"""graphopt::layer_norm's Triton kernel (many rows per program): on the CPU through Triton's
interpreter, on the GPU when marked cuda; against the fp64 reference."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.cuda_ext import norm_triton, reference
from tests.helpers import run_in_triton_interpreter


def _check(y, x, w, b, eps, dtype):
    ref = F.layer_norm(x.double(), x.shape[-1:], None if w is None else w.double(), None if b is None else b.double(),
                       eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def interpreter_cases():
    """Every CPU case through Triton's interpreter (run in a fresh process: the interpreter must
    be on before triton is imported for tl.sum and the other library functions to work)."""
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (1, 7, 96, 200):
            torch.manual_seed(hidden)
            x = (torch.randn(37, hidden) * 3 + 1).to(dtype)  # 37 rows: the last program is partial
            w, b = torch.randn(hidden), torch.randn(hidden)
            _check(norm_triton.layer_norm_triton(x, w, b, 1e-6), x, w, b, 1e-6, dtype)
            _check(norm_triton.layer_norm_triton(x, None, None, 1e-5), x, None, None, 1e-5, dtype)
    x = torch.randn(4, 96, 5).transpose(1, 2)  # a permuted view, as ConvNeXt's NHWC LayerNorm reads
    _check(norm_triton.layer_norm_triton(x, None, None, 1e-6), x, None, None, 1e-6, torch.float32)
    print("interpreter cases ok")


def _check_sandwich(y, r, wy, w, dtype):
    out, h = norm_triton.rms_norm_add_rms_norm_triton(y, r, wy, w, 1e-6, 1e-5)
    ref_out, ref_h = reference.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == y.shape
    # rsqrt against 1/sqrt can move a 16-bit rounding by one step, and h's step carries into out: a
    # tolerance of about two steps at the values' size (|h| < 8, |out| < 16 here)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 6.25e-2)
    torch.testing.assert_close(h.double(), ref_h.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=rtol, atol=2 * atol)


def interpreter_sandwich_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (1, 7, 96, 200):
            torch.manual_seed(hidden)
            y, r = torch.randn(37, hidden).to(dtype), torch.randn(37, hidden).to(dtype)
            _check_sandwich(y, r, torch.randn(hidden), torch.randn(hidden).to(dtype), dtype)
    y = torch.randn(3, 5, 64)
    _check_sandwich(y, torch.randn(1, 5, 64), torch.randn(64), torch.randn(64), torch.float32)  # a broadcast residual
    print("interpreter cases ok")


def test_rms_norm_add_rms_norm_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_norm_triton:interpreter_sandwich_cases")


def test_layer_norm_rows_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_norm_triton:interpreter_cases")


def test_too_wide_rows_refused():
    with pytest.raises(ValueError, match="hidden size"):
        norm_triton.layer_norm_triton(torch.zeros(1, norm_triton.MAX_HIDDEN + 1), None, None, 1e-5)


def test_reference_matches_torch():
    x = torch.randn(6, 33, dtype=torch.bfloat16)
    w = torch.randn(33)
    y = reference.layer_norm(x, w, None, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.layer_norm(x.float(), (33,), w, None, 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 192, 384, 768, 1000, 4096])
def test_layer_norm_op_on_gpu(dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(3, 57, hidden, device="cuda").to(dtype)
    w, b = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    _check(torch.ops.graphopt.layer_norm(x, w, b, 1e-6), x, w, b, 1e-6, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 1000, 4096, 8192])
def test_rms_norm_add_rms_norm_op_on_gpu(dtype, hidden):
    torch.manual_seed(0)
    y, r = torch.randn(3, 57, hidden, device="cuda").to(dtype), torch.randn(3, 57, hidden, device="cuda").to(dtype)
    _check_sandwich(y, r, torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda").to(dtype), dtype)
    # the op (what the pass emits) gives the kernel's result, also replayed from a CUDA graph
    wy, w = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda").to(dtype)
    eager = torch.ops.graphopt.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.graphopt.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        graphed = torch.ops.graphopt.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
