"""graphopt::biased_linear: ``x @ weight.T + bias`` (``weight_t``: ``x @ weight + bias``, a GPT-2
``Conv1D``'s ``addmm``), the forward aten's linear / addmm runs (one cuBLAS GEMM, the bias in its
epilogue), with a backward whose bias gradient is a product with a ones vector: ``g[R, N].T @ ones[R]``.

Autograd differentiates aten's linear into two GEMMs and a reduction over the outer dim for the
bias, a reduction the profile measures well below the copy rate on the GPU
(``op_efficiency["bias_grad_sum"]``); here the two GEMMs are the same products and the bias
gradient is cuBLAS's matrix-vector product, which streams the gradient once (priced as a one-row
matmul). No kernel of our own: every call is aten's. For training graphs: ``lower_bias_grad`` puts
it where the cost model prices that backward faster.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphopt.cost.opclass import dtype_of, gemm_tags
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from ..common import check_at_least_1d, check_floating
from ..registry import define_op

SCHEMA = "biased_linear(Tensor x, Tensor weight, Tensor bias, bool weight_t=False) -> Tensor"


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, weight_t: bool = False) -> torch.Tensor:
    """aten's own product: linear(x, weight, bias), or addmm(bias, x, weight) over x's rows."""
    if weight_t:
        out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)
        return out.view(*x.shape[:-1], weight.shape[1])
    return F.linear(x, weight, bias)


def fake(x, weight, bias, weight_t=False):
    n = weight.shape[1] if weight_t else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


def _n_k(call):
    w = call.info("weight")
    return (w.shape[1], w.shape[0]) if call.arg("weight_t") else (w.shape[0], w.shape[1])


def cost(call, profile):
    """The GEMM it runs, as aten's linear: 2·M·N·K FLOPs at the matmul efficiency."""
    x = call.info("x")
    n, k = _n_k(call)
    return OpCost(2 * (x.numel // x.shape[-1]) * n * k, call.in_bytes + call.out_bytes, kind="matmul",
                  efficiency="matmul")


def op_class(call):
    """The class of the projection it is (x's rows by N by K)."""
    x = call.info("x")
    n, k = _n_k(call)
    return gemm_tags(dtype_of(x), math.prod(x.shape[:-1]), n, k)


_ONES: dict = {}


def ones_like_rows(g2: torch.Tensor) -> torch.Tensor:
    """A ones vector with one entry per row of ``g2`` (its dtype and device), kept for the next
    call of that length, except one made while a CUDA graph is being captured (its fill would be
    recorded, not run)."""
    key = (g2.device, g2.dtype, g2.shape[0])
    ones = _ONES.get(key)
    if ones is None:
        ones = torch.ones(g2.shape[0], dtype=g2.dtype, device=g2.device)
        if not (g2.is_cuda and torch.cuda.is_current_stream_capturing()):
            if len(_ONES) >= 32:
                _ONES.clear()
            _ONES[key] = ones
    return ones


def setup_context(ctx, inputs, output):
    x, weight, bias, weight_t = inputs
    ctx.weight_t = weight_t
    ctx.save_for_backward(x, weight)


def backward(ctx, g):
    """The products aten's addmm backward runs for x and the weight; the bias's gradient as
    ``g.T @ ones`` (torch.mv) over g's rows."""
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    g2 = g.reshape(-1, g.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dx = dw = db = None
    if need_x:
        dx = (g2 @ weight.t() if ctx.weight_t else g2 @ weight).view(x.shape)
    if need_w:
        dw = x2.t() @ g2 if ctx.weight_t else g2.t() @ x2
    if need_b:
        db = torch.mv(g2.t(), ones_like_rows(g2))
    return dx, dw, db, None


def biased_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, weight_t: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` (``weight_t``: ``x @ weight + bias``) as aten computes it, whose
    bias gradient is a ones-vector product over the output gradient's rows."""
    check_floating("biased_linear", x=x, weight=weight, bias=bias)
    check_at_least_1d("biased_linear", "x", x)
    k, n = (weight.shape[0], weight.shape[1]) if weight_t else (weight.shape[1], weight.shape[0])
    if weight.dim() != 2 or k != x.shape[-1]:
        layout = "[K, N]" if weight_t else "[N, K]"
        raise KernelArgumentError(f"graphopt::biased_linear: weight must be {layout} with K = x's last dim "
                                  f"({x.shape[-1]}), got shape {tuple(weight.shape)}")
    if bias.dim() != 1 or bias.shape[0] != n:
        raise KernelArgumentError(f"graphopt::biased_linear: bias must be 1-D of length {n}, got shape {tuple(bias.shape)}")
    if not x.dtype == weight.dtype == bias.dtype:
        raise KernelArgumentError(f"graphopt::biased_linear: x, weight and bias must share a dtype, got {x.dtype}, "
                                  f"{weight.dtype}, {bias.dtype}")
    return torch.ops.graphopt.biased_linear(x, weight, bias, weight_t)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(48, 32), torch.randn(48), False)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=biased_linear, cost=cost,
               kernel="ops/biased_linear.py", cuda=reference, op_class=op_class, autograd=(backward, setup_context),
               example=example)
