"""graphopt::add_layer_norm_rows: ``graphopt::add_layer_norm`` (``h = x + residual; (layer_norm(h) *
weight + bias, h)`` over the last dim, fp32 statistics, one rounding of each) computed many rows per
program.

CUDA kernel: ``norm_triton.py``'s many-rows kernel, the one graphopt::layer_norm runs, with the
residual as a second summed operand and h stored. add_layer_norm's one block per row leaves narrow
rows (a conv net's channels, 64-768 wide) bound by block scheduling; here a program moves ~8K
elements whatever the row width, so it is priced without that floor. Rows up to
``norm_triton.MAX_HIDDEN`` wide. Differentiable as add_layer_norm (the same backward).
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import fused_cost

from ..common import KernelArgumentError, check_floating, check_norm_params, check_residual
from ..norm_triton import MAX_HIDDEN
from ..registry import define_op
from .add_layer_norm import backward, example, fake, reference, setup_context

SCHEMA = "add_layer_norm_rows(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor)"


def cuda(x, residual, weight, bias, eps):
    from ..norm_triton import add_layer_norm_triton

    return add_layer_norm_triton(x, residual, weight, bias, eps)


def cost(call, profile):
    """8 FLOPs an element (aten's layer_norm weight), one pass over its bytes (no per-row floor), slower
    where a row's bytes leave its accesses unvectorized (norm_triton.rows_cost)."""
    from ..norm_triton import rows_cost

    x = call.info("x")
    return rows_cost(fused_cost(call, flops_per_element=8), x.shape[-1] if x.shape else 1, x.dtype.itemsize, profile)


def add_layer_norm_rows(x, residual=None, weight=None, bias=None, eps: float = 1e-5):
    """``h = x + residual`` (or a copy of x); returns ``(layer_norm(h) * weight + bias, h)`` over the
    last dim (at most ``norm_triton.MAX_HIDDEN`` wide), fp32 statistics, many rows per program."""
    check_floating("add_layer_norm_rows", x=x)
    check_norm_params("add_layer_norm_rows", x, weight=weight, bias=bias)
    check_residual("add_layer_norm_rows", x, residual)
    if x.dim() and x.shape[-1] > MAX_HIDDEN:
        raise KernelArgumentError(f"graphopt::add_layer_norm_rows: rows of {x.shape[-1]} are wider than "
                                  f"{MAX_HIDDEN} (use add_layer_norm)")
    return torch.ops.graphopt.add_layer_norm_rows(x, residual, weight, bias, eps)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=add_layer_norm_rows, cost=cost, kernel="norm_triton.py",
               cuda=cuda, autograd=(backward, setup_context), example=example)
