"""graphopt::fused_norm_backward (the fused norms' backward on CUDA, cuda_ext/norm_triton.py): the
Triton kernel on the CPU through Triton's interpreter and on the GPU when marked cuda, against the
fp64 gradients of the model's own spelling (F.layer_norm, HF's RMSNorm); the reference against
torch's autograd; the op's conformance checks."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.cuda_ext import norm_triton, reference
from tests.helpers import run_in_triton_interpreter, same_when_graphed, skip_old_interpreter


def _norm_grads64(g, h, w, eps, rms):
    """fp64 (dh, dweight, dbias) of the model's own spelling: F.layer_norm, or HF's RMSNorm
    (the normalized value rounded to h's dtype before the weight: its weight gradient sums
    g * that rounded value)."""
    n = h.shape[-1]
    h64 = h.double().requires_grad_()
    w64 = (w.double() if w is not None else torch.ones(n, dtype=torch.float64, device=h.device)).requires_grad_()
    b64 = torch.zeros(n, dtype=torch.float64, device=h.device, requires_grad=True)
    if rms:
        y = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
        y.backward(g.double() * w64.detach())
        xr = (h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype).double()
        return h64.grad, (g.double() * xr).reshape(-1, n).sum(0), g.double().reshape(-1, n).sum(0)
    F.layer_norm(h64, (n,), w64, b64, eps).backward(g.double())
    return h64.grad, w64.grad, b64.grad


def _check_backward(g, h, w, extra, eps, dtype, weight_grads=True, rms=False):
    """graphopt::fused_norm_backward's kernel against the fp64 gradients: dh (plus extra) within a 16-bit
    step or two of its size, the weight sums in fp32 to fp32 accuracy (the sums of unit weights'
    gradients where there is no weight)."""
    dh, wb = norm_triton.norm_backward_triton(g, h, w, extra, eps, weight_grads, rms)
    ref, dw, db = _norm_grads64(g, h, w, eps, rms)
    ref = ref + (extra.double() if extra is not None else 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert dh.dtype == dtype and dh.shape == h.shape
    torch.testing.assert_close(dh.double(), ref, rtol=tol, atol=tol * max(1.0, ref.abs().max().item()))
    if weight_grads:
        rows = h.shape[:-1].numel()
        assert wb.dtype == torch.float32 and wb.shape == (2, h.shape[-1])
        # RMS: xhat is rounded to h's dtype from fp32 here, from fp64 there: a step apart at a tie
        step = torch.finfo(dtype).eps * g.double().abs().reshape(-1, h.shape[-1]).sum(0).max().item() if rms else 0.0
        torch.testing.assert_close(wb[0].double(), dw, rtol=1e-4, atol=1e-5 * rows + step)
        torch.testing.assert_close(wb[1].double(), db, rtol=1e-4, atol=1e-5 * rows)
    else:
        assert wb.numel() == 0


def interpreter_backward_cases():
    for rms in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            for rows, hidden in ((37, 1), (37, 7), (37, 96), (300, 200)):  # 300 rows: programs loop over tiles
                torch.manual_seed(hidden)
                h = (torch.randn(rows, hidden) * 3 + 1).to(dtype)
                g = torch.randn(rows, hidden).to(dtype)
                w = (1 + 0.2 * torch.randn(hidden)).to(dtype)
                _check_backward(g, h, w, None, 1e-5, dtype, rms=rms)
                _check_backward(g, h, None, torch.randn(rows, hidden).to(dtype), 1e-6, dtype, rms=rms)
                _check_backward(g, h, w, None, 1e-5, dtype, weight_grads=False, rms=rms)
    rows, iters, programs, _ = norm_triton.norm_backward_plan(300, 200, 2)
    assert iters > 1 and (programs - 1) * iters * rows < 300 <= programs * iters * rows  # every row, no empty program
    x = torch.randn(4, 96, 5).transpose(1, 2)  # a permuted view
    _check_backward(torch.randn(4, 5, 96), x, None, None, 1e-5, torch.float32)
    print("interpreter cases ok")


def test_norm_backward_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_fused_norm_backward:interpreter_backward_cases")


def test_norm_backward_op_conformance():
    from kx_conformance import check_op

    h = torch.randn(3, 5, 24)
    check_op("fused_norm_backward", (torch.randn(3, 5, 24), h, torch.randn(24), torch.randn(3, 5, 24), 1e-5, True, False))
    check_op("fused_norm_backward", (torch.randn(3, 5, 24), h, None, None, 1e-5, False, False))
    check_op("fused_norm_backward", (torch.randn(3, 5, 24), h, torch.randn(24), None, 1e-6, True, True))


@pytest.mark.parametrize("rms", [False, True])
def test_norm_backward_reference_matches_torch(rms):
    torch.manual_seed(0)
    h, g, w = (torch.randn(6, 40, dtype=torch.float64), torch.randn(6, 40, dtype=torch.float64),
               torch.randn(40, dtype=torch.float64))
    dh, wb = reference.fused_norm_backward(g, h, w, None, 1e-5, True, rms)
    ref = _norm_grads64(g, h, w, 1e-5, rms)
    for a, b in zip((dh, wb[0], wb[1]), ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(16384, 768), (4096, 4096), (1000, 8192), (37, 200)])
def test_norm_backward_op_on_gpu(dtype, rows, hidden, rms):
    torch.manual_seed(0)
    h = (torch.randn(rows, hidden, device="cuda") * 3 + 1).to(dtype)
    g = torch.randn(rows, hidden, device="cuda").to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, device="cuda")).to(dtype)
    _check_backward(g, h, w, torch.randn(rows, hidden, device="cuda").to(dtype), 1e-5, dtype, rms=rms)
    same_when_graphed(lambda: torch.ops.graphopt.fused_norm_backward(g, h, w, None, 1e-5, True, rms))
