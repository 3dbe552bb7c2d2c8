"""graphopt::gemv_add_rms_norm: ``y = linear(x, weight, bias)`` for at most ``MAX_M`` rows of x,
then ``graphopt::add_rms_norm(y, residual, norm_weight, eps)``: ``h = y + residual`` and
``(rmsnorm(h) * norm_weight, h)``, in two launches instead of three or four. With ``pre_weight``,
``graphopt::rms_norm_add_rms_norm(y, residual, pre_weight, norm_weight, pre_eps, eps)`` instead: y
is RMS-normalized and scaled by ``pre_weight`` before the add (a sandwich norm, GLM-4's
post-sublayer norm before the residual add and the next sublayer's norm).

A decoder's output projections (attention's o, the MLP's down) are followed by the residual add
and the next norm. At a decode step's few rows the projection is split along K anyway
(``gemv_triton.py``): its second kernel, which adds the fp32 partial sums, holds whole rows of y,
so it adds the residual and normalizes the row too, and the norm's own launch is gone. Roundings
are the unfused graph's: y rounded to x's dtype (as ``linear`` returns it), h rounded, fp32
statistics, ``norm_weight * normed.to(dtype)``.

Written by ``lower_gemv`` where the cost model prices it below the linear and the norm apart.
fp16/bf16 on CUDA; other dtypes and more rows run the reference.
"""
from __future__ import annotations

import torch

from graphopt.cost.model import norm_rows_seconds
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from .. import gemv_triton as gt
from ..common import check_floating, check_residual
from ..registry import define_op
from . import add_rms_norm as arn
from . import gemv as gv

SCHEMA = ("gemv_add_rms_norm(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor norm_weight, "
          "float eps, Tensor? pre_weight=None, float pre_eps=0.) -> (Tensor, Tensor)")


def reference(x, weight, bias, residual, norm_weight, eps, pre_weight=None, pre_eps=0.0):
    """``gemv``'s reference (fp32 accumulation, rounded once), then ``add_rms_norm``'s (with
    ``pre_weight``: ``rms_norm_add_rms_norm``'s, the same roundings)."""
    y = gv.reference(x, weight, bias)
    if pre_weight is not None:
        y = arn.reference(y, None, pre_weight, pre_eps)[0]
    return arn.reference(y, residual, norm_weight, eps)


def fake(x, weight, bias, residual, norm_weight, eps, pre_weight=None, pre_eps=0.0):
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def cuda_impl(x, weight, bias, residual, norm_weight, eps, pre_weight=None, pre_eps=0.0):
    """The Triton kernels for fp16/bf16, at most gt.MAX_M rows and one dtype, else the reference."""
    M, N = gv.rows(x), weight.shape[0]
    dtypes = {t.dtype for t in (x, weight, bias, residual, norm_weight, pre_weight) if t is not None}
    if x.dtype not in gt.DTYPES or M > gt.MAX_M or M == 0 or len(dtypes) != 1:
        return reference(x, weight, bias, residual, norm_weight, eps, pre_weight, pre_eps)
    shape = (*x.shape[:-1], N)
    x2 = x.reshape(M, x.shape[-1])
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    r = None if residual is None else residual.expand(shape).reshape(M, N)
    pw = pre_weight.reshape(-1).contiguous() if pre_weight is not None else None
    out, h = gt.gemv_add_rms_norm_triton(x2, w, bias, r, norm_weight.reshape(-1).contiguous(), eps, pw, pre_eps)
    return out.reshape(shape), h.reshape(shape)


def cost(call, profile):
    """``gemv``'s price (its split kernel and, when K is split, its second kernel) with the norm
    riding on that second kernel: the residual read, h and the output written, the norm weight
    read and the row-norm floor; when K is not split the second kernel is added (its fixed time,
    the partial sums written and read back). A pre-norm adds its weight's read, a pass over y and
    a second row-norm floor."""
    g = gv.cost(call, profile)
    y = call.outputs[0]
    res = call.info("residual")
    pre = call.info("pre_weight")
    extra = y.nbytes + (res.nbytes if res is not None else 0) + call.info("norm_weight").nbytes
    extra_s = g.extra_s + (norm_rows_seconds(profile, y) if profile is not None else 0.0)
    if pre is not None:
        extra += pre.nbytes + 2 * y.nbytes
        extra_s += norm_rows_seconds(profile, y) if profile is not None else 0.0
    if g.launches == 1:
        extra += 2 * gv.rows(call.info("x")) * y.shape[-1] * 4
        extra_s += profile.kernel_fixed_s if profile is not None else 0.0
    return OpCost(g.flops, g.bytes + extra, launches=2, kind=g.kind, efficiency=g.efficiency, extra_s=extra_s)


def op_class(call):
    return gv.op_class(call)


def gemv_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float = 1e-6, pre_weight: torch.Tensor | None = None,
                      pre_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)`` for x ``[..., K]`` of at
    most ``MAX_M`` rows: returns ``(rmsnorm(h) * norm_weight, h)`` with ``h = y + residual``; with
    ``pre_weight``, ``y = rmsnorm(linear(...)) * pre_weight`` (eps ``pre_eps``) first."""
    check_floating("gemv_add_rms_norm", x=x, weight=weight, bias=bias, residual=residual, norm_weight=norm_weight,
                   pre_weight=pre_weight)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise KernelArgumentError(f"graphopt::gemv_add_rms_norm: weight must be [N, {x.shape[-1] if x.dim() else '?'}]"
                                  f", got {tuple(weight.shape)} for x {tuple(x.shape)}")
    N = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (N,):
        raise KernelArgumentError(f"graphopt::gemv_add_rms_norm: bias must be [{N}], got {tuple(bias.shape)}")
    if norm_weight.numel() != N:
        raise KernelArgumentError(f"graphopt::gemv_add_rms_norm: norm_weight must have {N} elements, got shape "
                                  f"{tuple(norm_weight.shape)}")
    if pre_weight is not None and pre_weight.numel() != N:
        raise KernelArgumentError(f"graphopt::gemv_add_rms_norm: pre_weight must have {N} elements, got shape "
                                  f"{tuple(pre_weight.shape)}")
    if gv.rows(x) > gt.MAX_M:
        raise KernelArgumentError(f"graphopt::gemv_add_rms_norm: {gv.rows(x)} rows of x; at most {gt.MAX_M}")
    check_residual("gemv_add_rms_norm", torch.empty((*x.shape[:-1], N), device="meta"), residual)
    if len({t.device for t in (x, weight, bias, residual, norm_weight, pre_weight) if t is not None}) != 1:
        raise KernelArgumentError("graphopt::gemv_add_rms_norm: every tensor must be on one device")
    return torch.ops.graphopt.gemv_add_rms_norm(x, weight, bias, residual, norm_weight, eps, pre_weight, pre_eps)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(4, 32), torch.randn(48, 32), None, None, torch.randn(48), 1e-6)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=gemv_add_rms_norm, cost=cost,
               kernel="gemv_triton.py",
               cuda=cuda_impl, op_class=op_class, example=example)
