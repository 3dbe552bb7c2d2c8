"""graphopt::add_layer_norm: ``h = x + residual; (layer_norm(h) * weight + bias, h)`` over the last
dim, fp32 statistics, one rounding; a missing residual gives a copy of x as h.

CUDA kernel: ``csrc/norms.cu`` (a row held in registers, one CTA per row); priced with the
one-block-per-row floor the profile measures (``op_efficiency["row_norm"]``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.model import norm_rows_seconds
from graphopt.cost.ops import fused_cost

from ..common import check_floating, check_norm_params, check_residual, compute_dtype, fresh
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


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=add_layer_norm, cost=cost, kernel="csrc/norms.cu")
