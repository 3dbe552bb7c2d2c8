"""graphopt::gemv: ``linear(x, weight, bias)`` for at most ``MAX_M`` rows of x (a decode step's
tokens): the weight streamed once, split along K over the SMs (``gemv_triton.py``: a split kernel
multiplying on tensor cores with x padded to 16 rows, and with several splits a kernel adding the
fp32 partial sums and the bias, rounding once).

Replaces ``aten.linear`` where ``lower_gemv`` finds it pays: priced with the profile's
``op_efficiency["gemv"]`` (its measured bandwidth fraction and fixed time) against cuBLAS at the
same M priced with ``op_efficiency["small_m_linear"]``; both are measured by
``benchmarks/diag/diag_decode_gemm.py``. Unmeasured, it is priced as cuBLAS is (plus its partial
sums), so it is never chosen on a guess. fp16/bf16 on CUDA; other dtypes and more rows run the
reference (``F.linear`` in fp32).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphopt.cost.opclass import dtype_of, gemm_tags
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from .. import gemv_triton as gt
from ..common import check_floating, compute_dtype
from ..registry import define_op

SCHEMA = "gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
EFFICIENCY = "gemv"  # the op_efficiency key it is priced with
CUBLAS_SMALL_M = "small_m_linear"  # cuBLAS's at the same M (graphopt.cost.model.SMALL_M_LINEAR)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T + bias [N], computed in fp32 (fp64 stays fp64), rounded once."""
    ct = compute_dtype(x.dtype)
    y = F.linear(x.to(ct), weight.to(ct), None if bias is None else bias.to(ct))
    return y.to(x.dtype)


def fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def rows(x) -> int:
    return math.prod(x.shape[:-1])


def cuda_impl(x, weight, bias):
    """The Triton kernels for fp16/bf16 and at most gt.MAX_M rows, else the reference."""
    M = rows(x)
    if x.dtype not in gt.DTYPES or M > gt.MAX_M or M == 0:
        return reference(x, weight, bias)
    x2 = x.reshape(M, x.shape[-1])
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return gt.gemv_triton(x2, w, bias).reshape(*x.shape[:-1], weight.shape[0])


def stream_cost(M, N, K, nbytes, profile, partial_columns=None, planner=gt.plan) -> OpCost:
    """A weight stream of ``nbytes`` (weights, x, y) for ``[M, K] x [K, N]`` products, plus the fp32
    partial sums (``partial_columns`` per row, N unless given) written and read back when
    ``planner`` splits K (two launches then); at the profile's "gemv" efficiency where it is
    measured, else as cuBLAS at the same M (its "small_m_linear" entry, or any matmul's): an
    unmeasured GEMV is never predicted faster than cuBLAS."""
    launches = 1
    try:
        p = planner(int(M), int(N), int(K), (profile.sm_count if profile is not None else None) or gt.SM_COUNT)
        if p["splits"] > 1:
            nbytes += 2 * p["splits"] * M * (partial_columns or N) * 4
            launches = 2
    except TypeError:  # symbolic sizes: one pass
        pass
    extra = (launches - 1) * profile.kernel_fixed_s if profile is not None else 0.0
    table = profile.op_efficiency if profile is not None else {}
    efficiency = next((k for k in (EFFICIENCY, CUBLAS_SMALL_M) if k in table), "matmul")
    return OpCost(2 * M * (partial_columns or N) * K, nbytes, launches=launches, kind="matmul", efficiency=efficiency,
                  extra_s=extra)


def cost(call, profile):
    """The weight, x, y and the bias once, plus the partial sums when K is split (:func:`stream_cost`)."""
    x, w, b = call.info("x"), call.info("weight"), call.info("bias")
    nbytes = w.nbytes + x.nbytes + call.outputs[0].nbytes + (b.nbytes if b is not None else 0)
    return stream_cost(rows(x), w.shape[0], w.shape[1], nbytes, profile)


def op_class(call):
    """The class of the linear it replaces (x's rows by the weight's [N, K])."""
    x, w = call.info("x"), call.info("weight")
    return gemm_tags(dtype_of(x), rows(x), w.shape[0], w.shape[1])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias)`` for x ``[..., K]`` with at most ``MAX_M`` rows (the leading dims'
    product), weight ``[N, K]``, bias ``[N]``."""
    check_floating("gemv", x=x, weight=weight, bias=bias)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise KernelArgumentError(f"graphopt::gemv: weight must be [N, {x.shape[-1] if x.dim() else '?'}], got "
                                  f"{tuple(weight.shape)} for x {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise KernelArgumentError(f"graphopt::gemv: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if rows(x) > gt.MAX_M:
        raise KernelArgumentError(f"graphopt::gemv: {rows(x)} rows of x; at most {gt.MAX_M} (a decode step's tokens)")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise KernelArgumentError(f"graphopt::gemv: x {x.dtype}, weight {weight.dtype} and bias must share one dtype")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise KernelArgumentError("graphopt::gemv: x, weight and bias must be on one device")
    return torch.ops.graphopt.gemv(x, weight, bias)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(4, 32), torch.randn(48, 32), None)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=gemv, cost=cost, kernel="gemv_triton.py",
               cuda=cuda_impl, op_class=op_class, example=example)
