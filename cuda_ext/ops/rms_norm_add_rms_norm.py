"""graphopt::rms_norm_add_rms_norm: a sandwich norm, ``h = LlamaRMSNorm(y) * weight_y + residual;
(LlamaRMSNorm(h) * weight, h)``, each step rounded as ``add_rms_norm`` rounds it (GLM-4's
post-sublayer norm, the residual add and the next norm).

CUDA kernel: ``norm_triton.py`` (one Triton program per row, rows up to ``MAX_HIDDEN``; y and the
residual read once, out and h written once); wider rows and other dtypes run the reference.
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import fused_cost

from ..common import check_floating, check_norm_params, check_residual
from ..norm_triton import MAX_HIDDEN
from ..registry import define_op
from .add_rms_norm import reference as add_rms_norm

SCHEMA = ("rms_norm_add_rms_norm(Tensor y, Tensor residual, Tensor weight_y, Tensor weight, float eps_y, "
          "float eps) -> (Tensor, Tensor)")


def reference(y: torch.Tensor, residual: torch.Tensor, weight_y: torch.Tensor, weight: torch.Tensor,
              eps_y: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich norm's two RMSNorms around a residual add: ``y' = rms_norm(y) * weight_y``, then
    ``h = y' + residual`` and ``(rms_norm(h) * weight, h)``, each step rounded as
    ``add_rms_norm`` rounds it (GLM-4's post-sublayer norm, then the next sublayer's)."""
    yn, _ = add_rms_norm(y, None, weight_y, eps_y)
    return add_rms_norm(yn, residual, weight, eps)


def fake(y, residual, weight_y, weight, eps_y, eps):
    return y.new_empty(y.shape), y.new_empty(y.shape)


def cuda(y, residual, weight_y, weight, eps_y, eps):
    from ..norm_triton import rms_norm_add_rms_norm_triton

    if y.dim() == 0 or y.shape[-1] > MAX_HIDDEN:  # wider rows: correct, slower
        return reference(y, residual, weight_y, weight, eps_y, eps)
    return rms_norm_add_rms_norm_triton(y, residual, weight_y, weight, eps_y, eps)


def rms_norm_add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight_y: torch.Tensor, weight: torch.Tensor,
                          eps_y: float = 1e-6, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich norm in one pass: ``h = rms_norm(y) * weight_y + residual``; returns
    ``(rms_norm(h) * weight, h)``, each step rounded as :func:`add_rms_norm` rounds it (GLM-4's
    post-attention / post-MLP norm, the residual add and the next norm). On CUDA a Triton kernel."""
    check_floating("rms_norm_add_rms_norm", y=y, residual=residual)
    check_norm_params("rms_norm_add_rms_norm", y, weight_y=weight_y, weight=weight)
    check_residual("rms_norm_add_rms_norm", y, residual)
    return torch.ops.graphopt.rms_norm_add_rms_norm(y, residual, weight_y, weight, eps_y, eps)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(24, 32), torch.randn(32), torch.randn(32), 1e-6, 1e-6)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=rms_norm_add_rms_norm, cost=fused_cost,
               kernel="norm_triton.py", cuda=cuda, example=example)
