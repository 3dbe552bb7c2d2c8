"""graphopt::add_layer_norm: ``h = x + residual; (layer_norm(h) * weight + bias, h)`` over the last
dim, fp32 statistics, one rounding; a missing residual gives a copy of x as h.

CUDA kernel: ``csrc/norms.cu`` (a row held in registers, one CTA per row); priced with the
one-block-per-row floor the profile measures (``op_efficiency["row_norm"]``).

Differentiable (``norm_grad.layer_norm_backward``): h is saved, the backward recomputes its row
statistics; x and the residual both take h's gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.model import norm_rows_seconds
from graphopt.cost.ops import fused_cost

from ..common import check_floating, check_norm_params, check_residual, compute_dtype, fresh
from ..norm_grad import layer_norm_backward
from ..registry import define_op

SCHEMA = "add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor)"


def reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
              bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; out = layer_norm(h) over the last dim (fp32 statistics, one rounding)."""
    h = x + residual.to(x.dtype) if residual is not None else x
    ct = compute_dtype(x.dtype)
    out = F.layer_norm(h.to(ct), (x.shape[-1],), None if weight is None else weight.to(ct),
                       None if bias is None else bias.to(ct), eps)
    return fresh(out.to(x.dtype), x, residual), fresh(h, x, residual)


def fake(x, residual, weight, bias, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def cost(call, profile):
    return fused_cost(call, floor_s=norm_rows_seconds(profile, call.inputs[0]))


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or a copy of x); returns ``(layer_norm(h) * weight + bias, h)``
    over the last dim, fp32 statistics."""
    check_floating("add_layer_norm", x=x)
    check_norm_params("add_layer_norm", x, weight=weight, bias=bias)
    check_residual("add_layer_norm", x, residual)
    return torch.ops.graphopt.add_layer_norm(x, residual, weight, bias, eps)


def setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps = inputs
    ctx.set_materialize_grads(False)
    ctx.eps, ctx.res_dtype = eps, None if residual is None else residual.dtype
    ctx.save_for_backward(output[1], weight, bias)


def backward(ctx, g_out, g_h):
    h, weight, bias = ctx.saved_tensors
    need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
    dh, dw, db = g_h, None, None
    if g_out is not None:
        dh, dw, db = layer_norm_backward(g_out, h, weight, bias, ctx.eps, (True, need_w, need_b), extra=g_h)
    dres = dh.to(ctx.res_dtype) if dh is not None and need_res and ctx.res_dtype is not None else None
    return (dh if need_x else None), dres, dw, db, None


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(24, 32), torch.randn(32), torch.randn(32), 1e-5)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=add_layer_norm, cost=cost, kernel="csrc/norms.cu",
               autograd=(backward, setup_context), example=example)
