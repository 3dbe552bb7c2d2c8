"""graphopt::linear_add_layer_norm: a projection feeding a residual LayerNorm, ``h = x @ weight.T +
bias + residual`` rounded once (not after the projection as well); returns ``(layer_norm(h) *
ln_weight + ln_bias, h)``.

CUDA: ``norm_triton.py``. ``bmm`` over ``splits`` slices of K writing fp32 partial products
(``out_dtype``), then one Triton kernel that sums them with the bias and the residual and
normalizes (rows up to ``MAX_HIDDEN``; fp16/bf16/fp32, else the reference). A projection with few
output tiles (BERT-base bs1's FFN down projection, 128 x 768 x 3072, 6 slices) fills the SMs
without cuBLASLt's split-K reduction kernel.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphopt.cost.opclass import dtype_of, gemm_tags
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from ..common import check_norm_params, check_projection, check_residual, compute_dtype, fresh
from ..registry import define_op

SCHEMA = ("linear_add_layer_norm(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor? ln_weight, "
          "Tensor? ln_bias, float eps, int splits) -> (Tensor, Tensor)")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
              ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float,
              splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection feeding a residual LayerNorm: ``h = x @ weight.T + bias + residual``, rounded to
    x's dtype once (the projection is not rounded before the add, one rounding fewer than
    linear -> add_layer_norm); returns ``(layer_norm(h) * ln_weight + ln_bias, h)`` over the last
    dim, fp32 statistics. ``splits`` (a divisor of K) is how many slices of K the CUDA kernel
    multiplies on their own (partial sums in fp32, added by the norm): numerics only."""
    K = x.shape[-1] if x.dim() else 0
    if splits < 1 or K % splits:
        raise ValueError(f"graphopt::linear_add_layer_norm: splits {splits} does not divide K={K}")
    ct = compute_dtype(x.dtype)
    y = F.linear(x.to(ct), weight.to(ct), None if bias is None else bias.to(ct))
    if residual is not None:
        y = y + residual.to(ct)
    h = y.to(x.dtype)
    out = F.layer_norm(h.to(ct), (h.shape[-1],), None if ln_weight is None else ln_weight.to(ct),
                       None if ln_bias is None else ln_bias.to(ct), eps)
    return fresh(out.to(x.dtype), x, residual), fresh(h, x, residual)


def fake(x, weight, bias, residual, ln_weight, ln_bias, eps, splits):
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: "graphopt::linear_add_layer_norm: weight must be [N, K] with K = x's last dim")
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def cuda(x, weight, bias, residual, ln_weight, ln_bias, eps, splits):
    from ..norm_triton import linear_add_layer_norm_triton, split_k_supported

    if split_k_supported(x, weight, splits) is not None:  # fp64, wide rows, K not divisible: correct, slower
        return reference(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)
    return linear_add_layer_norm_triton(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)


def seconds(profile, M, N, K, splits: int, dtype: torch.dtype, residual: bool,
            vectors: int) -> tuple[float, float, float, float]:
    """(GEMM seconds, norm seconds, flops, bytes) of one call: a batched GEMM over ``splits``
    slices of K writing fp32 partial products, then one norm kernel reading them (with the
    residual and ``vectors`` N-long parameters) and writing out and h."""
    flops = 2 * M * N * K
    partials = splits * M * N * 4
    itemsize = dtype.itemsize
    gemm_bytes = (M * K + N * K) * itemsize + partials
    norm_bytes = partials + (M * N * (3 if residual else 2) + vectors * N) * itemsize
    gemm = profile.kernel_seconds(flops / profile.matmul_rate(dtype), gemm_bytes / profile.bandwidth, "matmul")
    norm = profile.kernel_seconds(10 * M * N / profile.elementwise_flops, norm_bytes / profile.bandwidth)
    return gemm, norm, flops, gemm_bytes + norm_bytes


def cost(call, profile):
    """Its two kernels priced one by one (:func:`seconds`); the GEMM's flops at the matmul rate."""
    x, w = call.info("x"), call.info("weight")
    vectors = sum(1 for a in ("bias", "ln_weight", "ln_bias") if call.arg(a) is not None)
    gemm, norm, flops, nbytes = seconds(profile, x.numel // x.shape[-1], w.shape[0], x.shape[-1], call.arg("splits"),
                                        x.dtype, call.arg("residual") is not None, vectors)
    return OpCost(flops, nbytes, launches=2, kind="linear_norm", rate=profile.matmul_rate(x.dtype),
                  time_s=gemm + norm)


def op_class(call):
    """The class of the projection it replaces (x's rows by the weight's [N, K])."""
    x, w = call.info("x"), call.info("weight")
    return gemm_tags(dtype_of(x), math.prod(x.shape[:-1]), w.shape[0], w.shape[1])


def linear_add_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, ln_weight: torch.Tensor | None = None,
                          ln_bias: torch.Tensor | None = None, eps: float = 1e-5,
                          splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection feeding a residual LayerNorm: ``h = x @ weight.T + bias + residual`` (rounded
    once); returns ``(layer_norm(h) * ln_weight + ln_bias, h)``. On CUDA one batched GEMM over
    ``splits`` slices of K (fp32 partial products) and one Triton kernel that sums them into the
    norm: a small-M, long-K projection fills the GPU without cuBLAS's split-K reduction kernel."""
    check_projection("linear_add_layer_norm", x, weight, "N")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or x.shape[-1] % splits:
        raise KernelArgumentError(f"graphopt::linear_add_layer_norm: splits must be a positive divisor of K "
                                  f"({x.shape[-1]}), got {splits!r}")
    out_like = x.new_empty((*x.shape[:-1], weight.shape[0]), device="meta")
    check_norm_params("linear_add_layer_norm", out_like, bias=bias, ln_weight=ln_weight, ln_bias=ln_bias)
    check_residual("linear_add_layer_norm", out_like, residual)
    return torch.ops.graphopt.linear_add_layer_norm(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 64), torch.randn(32, 64), torch.randn(32), torch.randn(24, 32), torch.randn(32),
            torch.randn(32), 1e-5, 4)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=linear_add_layer_norm, cost=cost,
               kernel="norm_triton.py", cuda=cuda, op_class=op_class, example=example)
