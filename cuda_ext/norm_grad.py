"""Backward of the fused norms (``add_layer_norm``, ``layer_norm``, ``add_rms_norm``): their
``torch.library.register_autograd`` formulas.

The forward kernels return the normalized output and h (the sum the norm read) but not the row
statistics, so the backward recomputes them from h. Both norms' backward is
``graphopt::fused_norm_backward``: on CUDA one Triton pass over g and h that also sums the weight
gradients and adds a gradient reaching h (fp32 statistics, as eager's); elsewhere, and for fp64, its
reference, the same derivatives in the compute dtype (fp32, fp64 for fp64), rounded once to each
input's dtype. A gradient reaching h (the residual stream of a pre-norm stack) is added to x's and
the residual's.
"""
from __future__ import annotations

import os

import torch

aten = torch.ops.aten


def _aten_on(h: torch.Tensor) -> bool:
    """Whether ``GRAPHOPT_FUSED_NORM_BACKWARD=0`` asks for aten's norm backward kernels (after the
    statistics are recomputed) on this CUDA tensor: an A/B switch against fused_norm_backward."""
    return h.is_cuda and h.dtype != torch.float64 and os.environ.get("GRAPHOPT_FUSED_NORM_BACKWARD", "1") == "0"


def layer_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float, needs: tuple[bool, bool, bool], extra: torch.Tensor | None = None):
    """(dh, dweight, dbias) of ``layer_norm(h) * weight + bias`` over the last dim for the output
    gradient ``g``; ``needs`` flags which are wanted (None for the others); ``extra``, a gradient h
    receives besides (added to dh, which is then always made)."""
    if _aten_on(h):
        hs = [h.shape[-1]]
        _, mean, rstd = aten.native_layer_norm(h, hs, None, None, eps)
        dh, dw, db = aten.native_layer_norm_backward(g, h, hs, mean, rstd, weight, bias, list(needs))
        return plus(dh, extra), dw, db
    need_wb = bool(needs[1] and weight is not None) or bool(needs[2] and bias is not None)
    dh, wb = torch.ops.graphopt.fused_norm_backward(g, h, weight, extra, eps, need_wb)
    dw = wb[0].to(weight.dtype) if needs[1] and weight is not None else None
    db = wb[1].to(bias.dtype) if needs[2] and bias is not None else None
    return (dh if needs[0] or extra is not None else None), dw, db


def rms_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, need_weight: bool,
                      extra: torch.Tensor | None = None):
    """(dh, dweight or None) of ``weight * (h * rsqrt(mean(h^2) + eps))`` over the last dim (fp32
    statistics; the model multiplies the normalized value rounded to h's dtype by its weight) for the
    output gradient ``g``; ``extra``, a gradient h receives besides (added)."""
    if _aten_on(h) and h.dtype == weight.dtype and hasattr(aten, "_fused_rms_norm_backward"):  # torch.nn.RMSNorm's
        hs = [h.shape[-1]]
        _, rstd = aten._fused_rms_norm(h, hs, None, eps)
        dh, dw = aten._fused_rms_norm_backward(g, h, hs, rstd, weight, [True, need_weight])
        return plus(dh, extra), (dw if need_weight else None)
    dh, wb = torch.ops.graphopt.fused_norm_backward(g, h, weight, extra, eps, need_weight, True)
    return dh, (wb[0].to(weight.dtype) if need_weight else None)


def plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b where either may be missing (a gradient that does not flow)."""
    if a is None:
        return b
    return a if b is None else a + b.to(a.dtype)
