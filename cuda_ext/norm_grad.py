"""Backward of the fused norms (``add_layer_norm``, ``layer_norm``, ``add_rms_norm``): their
``torch.library.register_autograd`` formulas.

The forward kernels return the normalized output and h (the sum the norm read) but not the row
statistics, so the backward recomputes them from h (one read of h) and hands the rest to the
kernels eager's own backward runs: on CUDA aten's ``native_layer_norm_backward`` (bf16/fp16
tensors, fp32 statistics, as eager's LayerNorm backward) and, where the running torch has it,
``_fused_rms_norm_backward`` (torch.nn.RMSNorm's); elsewhere (the CPU reference, fp64) the
same derivatives computed in the op's compute dtype (fp32, fp64 for fp64), rounded once to each
input's dtype. A gradient reaching h (the residual stream of a pre-norm stack) is added to x's
and the residual's.
"""
from __future__ import annotations

import torch

from .common import compute_dtype

aten = torch.ops.aten


def _cuda_has(op: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA")
    except RuntimeError:  # an older torch without the op
        return False


_FUSED_RMS = hasattr(aten, "_fused_rms_norm") and _cuda_has("_fused_rms_norm_backward")


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return None if t is None or dtype is None else t.to(dtype)


def layer_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float, needs: tuple[bool, bool, bool]):
    """(dh, dweight, dbias) of ``layer_norm(h) * weight + bias`` over the last dim for the output
    gradient ``g``; ``needs`` flags which are wanted (None for the others)."""
    hs = [h.shape[-1]]
    if h.is_cuda:
        _, mean, rstd = aten.native_layer_norm(h, hs, None, None, eps)  # fp32 statistics on CUDA
        return aten.native_layer_norm_backward(g, h, hs, mean, rstd, weight, bias, list(needs))
    ct = compute_dtype(h.dtype)
    hc = h.to(ct)
    _, mean, rstd = aten.native_layer_norm(hc, hs, None, None, eps)
    dh, dw, db = aten.native_layer_norm_backward(g.to(ct), hc, hs, mean, rstd, _cast(weight, ct), _cast(bias, ct),
                                                 list(needs))
    return (_cast(dh, h.dtype), _cast(dw, None if weight is None else weight.dtype),
            _cast(db, None if bias is None else bias.dtype))


def rms_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, need_weight: bool):
    """(dh, dweight or None) of ``weight * (h * rsqrt(mean(h^2) + eps))`` over the last dim (fp32
    statistics) for the output gradient ``g``."""
    hs = [h.shape[-1]]
    if h.is_cuda and _FUSED_RMS and h.dtype == weight.dtype:
        _, rstd = aten._fused_rms_norm(h, hs, None, eps)
        dh, dw = aten._fused_rms_norm_backward(g, h, hs, rstd, weight, [True, need_weight])
        return dh, (dw if need_weight else None)
    ct = compute_dtype(h.dtype)
    hc, gc = h.to(ct), g.to(ct)
    rstd = torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + eps)
    xhat = hc * rstd
    dw = None
    if need_weight:  # the model multiplies the normalized value rounded to h's dtype by its weight
        dw = (gc * xhat.to(h.dtype).to(ct)).reshape(-1, hs[0]).sum(0).to(weight.dtype)
    gn = gc * weight.to(ct)
    dh = rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))
    return dh.to(h.dtype), dw


def plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b where either may be missing (a gradient that does not flow)."""
    if a is None:
        return b
    return a if b is None else a + b.to(a.dtype)
