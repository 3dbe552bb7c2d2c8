"""Backward of the fused norms (``add_layer_norm``, ``layer_norm``, ``add_rms_norm``): their
``torch.library.register_autograd`` formulas.

The forward kernels return the normalized output and h (the sum the norm read) but not the row
statistics, so the backward recomputes them from h. On CUDA both norms' backward is
``graphopt::fused_norm_backward`` (one Triton pass over g and h that also sums the weight gradients and
adds a gradient reaching h; fp32 statistics, as eager's). Elsewhere (the CPU reference, fp64) the
same derivatives computed in the op's compute dtype (fp32, fp64 for fp64), rounded once to each
input's dtype. A gradient reaching h (the residual stream of a pre-norm stack)
is added to x's and the residual's.
"""
from __future__ import annotations

import os

import torch

from .common import compute_dtype

aten = torch.ops.aten


def _fused_on() -> bool:
    """graphopt::fused_norm_backward on CUDA unless ``GRAPHOPT_FUSED_NORM_BACKWARD=0`` (an A/B switch:
    then aten's norm backward kernels after the statistics are recomputed)."""
    return os.environ.get("GRAPHOPT_FUSED_NORM_BACKWARD", "1") != "0"


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return None if t is None or dtype is None else t.to(dtype)


def layer_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float, needs: tuple[bool, bool, bool], extra: torch.Tensor | None = None):
    """(dh, dweight, dbias) of ``layer_norm(h) * weight + bias`` over the last dim for the output
    gradient ``g``; ``needs`` flags which are wanted (None for the others); ``extra``, a gradient h
    receives besides (added to dh, which is then always made)."""
    hs = [h.shape[-1]]
    if h.is_cuda and h.dtype != torch.float64 and _fused_on():
        need_wb = bool(needs[1] and weight is not None) or bool(needs[2] and bias is not None)
        dh, wb = torch.ops.graphopt.fused_norm_backward(g, h, weight, extra, eps, need_wb)
        dw = wb[0].to(weight.dtype) if needs[1] and weight is not None else None
        db = wb[1].to(bias.dtype) if needs[2] and bias is not None else None
        return (dh if needs[0] or extra is not None else None), dw, db
    if h.is_cuda and h.dtype != torch.float64:  # aten's kernels after the statistics, as eager's backward
        _, mean, rstd = aten.native_layer_norm(h, hs, None, None, eps)
        dh, dw, db = aten.native_layer_norm_backward(g, h, hs, mean, rstd, weight, bias, list(needs))
        return plus(dh, extra), dw, db
    ct = compute_dtype(h.dtype)
    hc = h.to(ct)
    _, mean, rstd = aten.native_layer_norm(hc, hs, None, None, eps)
    dh, dw, db = aten.native_layer_norm_backward(g.to(ct), hc, hs, mean, rstd, _cast(weight, ct), _cast(bias, ct),
                                                 list(needs))
    return (plus(_cast(dh, h.dtype), extra), _cast(dw, None if weight is None else weight.dtype),
            _cast(db, None if bias is None else bias.dtype))


def rms_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, need_weight: bool,
                      extra: torch.Tensor | None = None):
    """(dh, dweight or None) of ``weight * (h * rsqrt(mean(h^2) + eps))`` over the last dim (fp32
    statistics) for the output gradient ``g``; ``extra``, a gradient h receives besides (added)."""
    hs = [h.shape[-1]]
    if h.is_cuda and h.dtype != torch.float64 and _fused_on():
        dh, wb = torch.ops.graphopt.fused_norm_backward(g, h, weight, extra, eps, need_weight, True)
        return dh, (wb[0].to(weight.dtype) if need_weight else None)
    if h.is_cuda and h.dtype == weight.dtype and hasattr(aten, "_fused_rms_norm_backward"):  # torch.nn.RMSNorm's
        _, rstd = aten._fused_rms_norm(h, hs, None, eps)
        dh, dw = aten._fused_rms_norm_backward(g, h, hs, rstd, weight, [True, need_weight])
        return plus(dh, extra), (dw if need_weight else None)
    ct = compute_dtype(h.dtype)
    hc, gc = h.to(ct), g.to(ct)
    rstd = torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + eps)
    xhat = hc * rstd
    dw = None
    if need_weight:  # the model multiplies the normalized value rounded to h's dtype by its weight
        dw = (gc * xhat.to(h.dtype).to(ct)).reshape(-1, hs[0]).sum(0).to(weight.dtype)
    gn = gc * weight.to(ct)
    dh = rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))
    return plus(dh.to(h.dtype), extra), dw


def plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b where either may be missing (a gradient that does not flow)."""
    if a is None:
        return b
    return a if b is None else a + b.to(a.dtype)
