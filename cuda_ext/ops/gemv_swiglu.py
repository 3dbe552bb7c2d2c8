"""graphopt::gemv_swiglu: ``silu(x @ Wg.T) * (x @ Wu.T)`` for at most ``MAX_M`` rows of x (a decode
step's tokens), shape ``[..., n]``: a SwiGLU MLP's gate and up projections and its activation in
one weight stream.

``weight`` is either the merged ``cat([Wg, Wu])`` ([2n, K], GLM-4's gate_up_proj as the model holds
it) with ``up_weight`` None, or Wg ([n, K]) with ``up_weight`` Wu ([n, K]): Llama's gate_proj and
up_proj as they are, so no merged copy of the weights is made. ``gemv_triton.py``'s swiglu kernel
loads the matching rows of both in each program (two accumulators, as many weight bytes per
program as the plain GEMV) and stores the activation; the [M, 2n] product is never written, and the
projections are not rounded before the activation. Where the plan splits K (few output columns),
the fp32 partial sums of both go to a second kernel that adds them and applies the activation.

Written by ``fuse_gemv_swiglu``. Priced as ``graphopt::gemv`` over both weights (its measured
``op_efficiency["gemv"]``; unmeasured, as cuBLAS at the same M). fp16/bf16 on CUDA; other dtypes
and more rows run the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.opclass import dtype_of, gemm_tags
from graphopt.errors import KernelArgumentError

from .. import gemv_triton as gt
from ..common import check_floating, compute_dtype
from ..registry import define_op
from . import gemv as gv

SCHEMA = "gemv_swiglu(Tensor x, Tensor weight, Tensor? up_weight) -> Tensor"


def halves(weight: torch.Tensor, up_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wg, Wu): ``weight``'s two halves along its rows when ``up_weight`` is None (views), else
    the two weights as given."""
    if up_weight is not None:
        return weight, up_weight
    n = weight.shape[0] // 2
    return weight[:n], weight[n:]


def reference(x: torch.Tensor, weight: torch.Tensor, up_weight: torch.Tensor | None) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` computed in fp32 (fp64 stays fp64), rounded once."""
    ct = compute_dtype(x.dtype)
    wg, wu = halves(weight, up_weight)
    xc = x.to(ct)
    return (F.silu(F.linear(xc, wg.to(ct))) * F.linear(xc, wu.to(ct))).to(x.dtype)


def fake(x, weight, up_weight):
    n = weight.shape[0] if up_weight is not None else weight.shape[0] // 2
    return x.new_empty((*x.shape[:-1], n))


def cuda_impl(x, weight, up_weight):
    """The Triton kernels for fp16/bf16 and at most gt.MAX_M rows, else the reference."""
    M = gv.rows(x)
    if x.dtype not in gt.DTYPES or M > gt.MAX_M or M == 0:
        return reference(x, weight, up_weight)
    wg, wu = (w if w.stride(-1) == 1 else w.contiguous() for w in halves(weight, up_weight))
    return gt.gemv_swiglu_triton(x.reshape(M, x.shape[-1]), wg, wu).reshape(*x.shape[:-1], wg.shape[0])


def cost(call, profile):
    """Both weights, x and the output once, plus both partial sums when K is split
    (``gemv.stream_cost``)."""
    x, w, u = call.info("x"), call.info("weight"), call.info("up_weight")
    N = w.shape[0] if u is not None else w.shape[0] // 2
    nbytes = w.nbytes + (u.nbytes if u is not None else 0) + x.nbytes + call.outputs[0].nbytes
    return gv.stream_cost(gv.rows(x), N, w.shape[1], nbytes, profile, partial_columns=2 * N, planner=gt.plan_swiglu)


def op_class(call):
    """The class of the merged gate/up linear it replaces (x's rows by [2n, K])."""
    x, w, u = call.info("x"), call.info("weight"), call.info("up_weight")
    return gemm_tags(dtype_of(x), gv.rows(x), w.shape[0] * (2 if u is not None else 1), w.shape[1])


def gemv_swiglu(x: torch.Tensor, weight: torch.Tensor, up_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` for x ``[..., K]`` with at most ``MAX_M`` rows; ``weight``
    ``cat([Wg, Wu])`` [2n, K] with ``up_weight`` None, or Wg [n, K] with ``up_weight`` Wu [n, K]."""
    check_floating("gemv_swiglu", x=x, weight=weight, up_weight=up_weight)
    K = x.shape[-1] if x.dim() else None
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != K:
        raise KernelArgumentError(f"graphopt::gemv_swiglu: weight must be [rows, {K if K is not None else '?'}], "
                                  f"got {tuple(weight.shape)} for x {tuple(x.shape)}")
    if up_weight is None and weight.shape[0] % 2:
        raise KernelArgumentError(f"graphopt::gemv_swiglu: a merged gate/up weight needs an even row count, got "
                                  f"{tuple(weight.shape)}")
    if up_weight is not None and tuple(up_weight.shape) != tuple(weight.shape):
        raise KernelArgumentError(f"graphopt::gemv_swiglu: up_weight must be {tuple(weight.shape)} like the gate's, "
                                  f"got {tuple(up_weight.shape)}")
    if gv.rows(x) > gt.MAX_M:
        raise KernelArgumentError(f"graphopt::gemv_swiglu: {gv.rows(x)} rows of x; at most {gt.MAX_M} "
                                  "(a decode step's tokens)")
    if weight.dtype != x.dtype or (up_weight is not None and up_weight.dtype != x.dtype):
        raise KernelArgumentError(f"graphopt::gemv_swiglu: x {x.dtype} and the weights must share one dtype")
    if weight.device != x.device or (up_weight is not None and up_weight.device != x.device):
        raise KernelArgumentError("graphopt::gemv_swiglu: x and the weights must be on one device")
    return torch.ops.graphopt.gemv_swiglu(x, weight, up_weight)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(4, 32), torch.randn(64, 32), None)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=gemv_swiglu, cost=cost, kernel="gemv_triton.py",
               cuda=cuda_impl, op_class=op_class, example=example)
