"""graphopt::add_rms_norm: ``h = x + residual; (LlamaRMSNorm(h) * weight, h)`` with Hugging Face's
roundings (h rounded to x's dtype, fp32 statistics, ``weight * normed.to(x.dtype)``); a missing
residual gives a copy of x as h (custom ops may not alias their inputs).

CUDA kernel: ``csrc/norms.cu`` (a row held in registers, one CTA per row); priced with the
one-block-per-row floor the profile measures (``op_efficiency["row_norm"]``).

Differentiable (``norm_grad.rms_norm_backward``): h is saved, the backward recomputes its row
statistics; x and the residual both take h's gradient.
"""
from __future__ import annotations

import torch

from graphopt.cost.model import norm_rows_seconds
from graphopt.cost.ops import fused_cost

from ..common import check_floating, check_norm_params, check_residual, compute_dtype, fresh
from ..norm_grad import rms_norm_backward
from ..registry import define_op

SCHEMA = "add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)"


def reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x's dtype, as the model's residual stream is);
    out = weight * (h_fp32 * rsqrt(mean(h_fp32^2) + eps)).to(x.dtype), returned in x's dtype."""
    h = x + residual.to(x.dtype) if residual is not None else x
    ct = compute_dtype(x.dtype)
    hf = h.to(ct)
    var = hf.pow(2).mean(-1, keepdim=True)
    normed = (hf * torch.rsqrt(var + eps)).to(x.dtype)
    out = (weight.to(ct) * normed.to(ct)).to(x.dtype)
    return fresh(out, x, residual, weight), fresh(h, x, residual)


def fake(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def cost(call, profile):
    return fused_cost(call, floor_s=norm_rows_seconds(profile, call.inputs[0]))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or a copy of x); returns ``(rmsnorm(h) * weight, h)``. Numerics of
    Hugging Face's LlamaRMSNorm: fp32 statistics over h, ``weight * normed.to(x.dtype)``."""
    check_floating("add_rms_norm", x=x)
    check_norm_params("add_rms_norm", x, weight=weight)
    check_residual("add_rms_norm", x, residual)
    return torch.ops.graphopt.add_rms_norm(x, residual, weight, eps)


def setup_context(ctx, inputs, output):
    x, residual, weight, eps = inputs
    ctx.set_materialize_grads(False)
    ctx.eps, ctx.res_dtype = eps, None if residual is None else residual.dtype
    ctx.save_for_backward(output[1], weight)


def backward(ctx, g_out, g_h):
    h, weight = ctx.saved_tensors
    need_x, need_res, need_w = ctx.needs_input_grad[:3]
    dh, dw = g_h, None
    if g_out is not None:
        dh, dw = rms_norm_backward(g_out, h, weight, ctx.eps, need_w, extra=g_h)
    dres = dh.to(ctx.res_dtype) if dh is not None and need_res and ctx.res_dtype is not None else None
    return (dh if need_x else None), dres, dw, None


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(24, 32), torch.randn(32), 1e-6)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=add_rms_norm, cost=cost, kernel="csrc/norms.cu",
               autograd=(backward, setup_context), example=example)
