"""graphopt::layer_norm: ``layer_norm`` over the last dim, fp32 statistics, one rounding to x's
dtype.

CUDA kernel: ``norm_triton.py``, a Triton program normalizing many rows at once (aten's kernel
gives each row a thread block: scheduling-bound for narrow rows), rows up to
``norm_triton.MAX_HIDDEN`` (8192) wide.

Differentiable (``norm_grad.layer_norm_backward``): x is saved, the backward recomputes its row
statistics.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost

from ..common import check_floating, check_norm_params, compute_dtype, fresh
from ..norm_grad import layer_norm_backward
from ..registry import define_op

SCHEMA = "layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor"


def reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """layer_norm over the last dim, fp32 statistics, one rounding to x's dtype."""
    ct = compute_dtype(x.dtype)
    h = x.shape[-1:] if x.dim() else (1,)
    y = F.layer_norm(x.to(ct), h, None if weight is None else weight.to(ct), None if bias is None else bias.to(ct),
                     eps)
    return fresh(y.to(x.dtype), x)


def fake(x, weight, bias, eps):
    return x.new_empty(x.shape)


def cuda(x, weight, bias, eps):
    from ..norm_triton import layer_norm_triton

    return layer_norm_triton(x, weight, bias, eps)


def cost(call, profile):
    """8 FLOPs an element (aten's layer_norm weight), one pass over its bytes: its kernel normalizes
    many rows per program, so aten's one-block-per-row floor (norm_rows_seconds) is not its; slower where
    a row's bytes leave its accesses unvectorized (norm_triton.rows_cost)."""
    from ..norm_triton import rows_cost

    x = call.info("x")
    return rows_cost(fused_cost(call, flops_per_element=8), x.shape[-1] if x.shape else 1, x.dtype.itemsize, profile)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``layer_norm`` over the last dim (up to 8192 wide) with fp32 statistics; on CUDA a Triton
    kernel that normalizes many rows per program (fast for narrow rows, where one block per row
    is scheduling-bound)."""
    check_floating("layer_norm", x=x)
    check_norm_params("layer_norm", x, weight=weight, bias=bias)
    return torch.ops.graphopt.layer_norm(x, weight, bias, eps)


def setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight, bias)


def backward(ctx, g):
    x, weight, bias = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx, dw, db = layer_norm_backward(g, x, weight, bias, ctx.eps, (need_x, need_w, need_b))
    return dx, dw, db, None


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(32), None, 1e-5)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=layer_norm, cost=cost, kernel="norm_triton.py",
               cuda=cuda, autograd=(backward, setup_context), example=example)
