"""graphopt::fused_norm_backward: the gradients of ``layer_norm(h) * weight + bias`` (or, with ``rms``, of
``weight * rms_norm(h)`` as HF spells it, the normalized value rounded to h's dtype before the weight)
over the last dim for an output gradient g, in one pass over g and h: ``dh`` (h's dtype, plus
``extra``, a gradient h also receives, such as a pre-norm stack's residual stream) and ``wb = [sum of
g * xhat, sum of g]`` over the rows ([2, N] in the compute dtype, fp32; empty without
``weight_grads``), from which the weight's and the bias's gradients are cast. Row statistics are
recomputed from h.

CUDA kernel: ``norm_triton.py`` (``norm_bwd_kernel``): each program normalizes tiles of rows again,
writes their dh and keeps its rows' weight-gradient sums in registers; one sum over the programs'
partial rows follows. The backward of ``add_layer_norm``, ``layer_norm`` and ``add_rms_norm``
(``norm_grad.py``) on CUDA; aten's LayerNorm and fused RMSNorm backwards reduce the weight gradients
in a second kernel.
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, check_norm_params, compute_dtype, fresh
from ..registry import define_op

SCHEMA = ("fused_norm_backward(Tensor g, Tensor h, Tensor? weight, Tensor? extra, float eps, bool weight_grads, "
          "bool rms=False) -> (Tensor, Tensor)")


def reference(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None, extra: torch.Tensor | None,
              eps: float, weight_grads: bool, rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, wb) in the compute dtype, dh rounded once to h's dtype."""
    ct = compute_dtype(h.dtype)
    n = h.shape[-1]
    hc, gc = h.to(ct), g.to(ct)
    d = hc if rms else hc - hc.mean(-1, keepdim=True)
    rstd = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    xhat = d * rstd
    gw = gc * weight.to(ct) if weight is not None else gc
    dh = gw - xhat * (xhat * gw).mean(-1, keepdim=True)
    if not rms:
        dh = dh - gw.mean(-1, keepdim=True)
    dh = dh * rstd
    if extra is not None:
        dh = dh + extra.to(ct)
    if weight_grads:
        xw = xhat.to(h.dtype).to(ct) if rms else xhat  # the model multiplies the rounded value by its weight
        wb = torch.stack([(gc * xw).reshape(-1, n).sum(0), gc.reshape(-1, n).sum(0)])
    else:
        wb = torch.empty(0, dtype=ct, device=h.device)
    return fresh(dh.to(h.dtype), g, h, extra), wb


def fake(g, h, weight, extra, eps, weight_grads, rms=False):
    ct = compute_dtype(h.dtype)
    return h.new_empty(h.shape), h.new_empty((2, h.shape[-1]) if weight_grads else (0,), dtype=ct)


def cuda(g, h, weight, extra, eps, weight_grads, rms=False):
    from ..norm_triton import MAX_HIDDEN, norm_backward_triton

    if h.dtype == torch.float64 or h.shape[-1] > MAX_HIDDEN:
        return reference(g, h, weight, extra, eps, weight_grads, rms)
    return norm_backward_triton(g, h, weight, extra, eps, weight_grads, rms)


def cost(call, profile):
    """One pass: g, h (and extra) read, dh written (12 FLOPs an element), then the sum of the
    programs' partial rows: its bytes at the profile's measured rate for this kernel and at least
    its per-row time (``op_efficiency["fused_norm_backward"]``: ``memory_scale``, ``row_s``)."""
    h = call.inputs[1]
    rows = h.numel / h.shape[-1] if h.shape and h.shape[-1] else 0
    scale = profile.efficiency("fused_norm_backward", "memory_scale", 1.0) if profile is not None else 1.0
    row_s = profile.efficiency("fused_norm_backward", "row_s", 0.0) if profile is not None else 0.0
    c = fused_cost(call, flops_per_element=12, floor_s=rows * row_s or None)
    c.slowdown, c.launches = 1.0 / scale, 2
    return c


def fused_norm_backward(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None = None,
                  extra: torch.Tensor | None = None, eps: float = 1e-5, weight_grads: bool = True,
                  rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, wb)``: h's gradient through ``layer_norm(h) * weight + bias`` (``rms``: ``weight *
    rms_norm(h)``) over the last dim for the output gradient g (plus ``extra``), and ``wb = [sum of
    g * xhat, sum of g]`` over the rows (the weight's and the bias's gradients, in the compute
    dtype), recomputing the row statistics."""
    check_floating("fused_norm_backward", g=g, h=h, extra=extra)
    check_norm_params("fused_norm_backward", h, weight=weight)
    if g.shape != h.shape or (extra is not None and extra.shape != h.shape):
        raise KernelArgumentError(f"graphopt::fused_norm_backward: g {tuple(g.shape)} and extra "
                                  f"{None if extra is None else tuple(extra.shape)} must have h's shape {tuple(h.shape)}")
    return torch.ops.graphopt.fused_norm_backward(g, h, weight, extra, eps, weight_grads, rms)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(24, 32), torch.randn(32), None, 1e-5, True, False)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=fused_norm_backward, cost=cost,
               kernel="norm_triton.py",
               cuda=cuda, example=example)
