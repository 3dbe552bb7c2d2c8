"""graphopt::strided_bmm: ``a @ b`` for a [*batch, M, K] and b [*batch, K, N] of one batch shape (at
most three dims) read through any strides, the result [*batch, M, N] laid out in the dim order
``order`` names (outermost first; empty: contiguous).

aten's ``matmul`` copies an operand whose batch dims do not fold into one stride (cuBLAS takes one
batch stride) and writes a contiguous result; this op reads each operand where it is and writes
the layout its readers want (``lower_strided_bmm`` picks it), so neither copy is made. CUDA kernel:
``bmm_triton.py`` (fp32, fp16, bf16; fp64 runs the reference), fp32 accumulation. Differentiable:
the gradients are ``g @ b^T`` and ``a^T @ g``.
"""
from __future__ import annotations

import math

import torch

from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype
from ..registry import define_op

SCHEMA = "strided_bmm(Tensor a, Tensor b, int[] order) -> Tensor"
SECTOR = 32  # bytes a GPU reads at once


def _empty(a: torch.Tensor, b: torch.Tensor, order) -> torch.Tensor:
    shape = (*a.shape[:-1], b.shape[-1])
    if not order:
        return a.new_empty(shape)
    return torch.empty_permuted(shape, list(order), dtype=a.dtype, device=a.device)


def reference(a: torch.Tensor, b: torch.Tensor, order) -> torch.Tensor:
    """``a @ b`` in fp32 (fp64 for fp64), rounded once to a's dtype, laid out as ``order`` says."""
    ct = compute_dtype(a.dtype)
    return _empty(a, b, order).copy_(torch.matmul(a.to(ct), b.to(ct)))


def fake(a, b, order):
    torch._check(a.dim() == b.dim() and a.dim() >= 3, lambda: "graphopt::strided_bmm: a and b must be [*batch, M, K] "
                 "and [*batch, K, N]")
    return _empty(a, b, order)


def cuda(a, b, order):
    from ..bmm_triton import DTYPES, bmm_triton

    if a.dtype not in DTYPES:
        return reference(a, b, order)
    return bmm_triton(a, b, _empty(a, b, order))


def sector_bytes(shape, stride, itemsize: int) -> int:
    """Bytes a GPU moves to read (or write) a tensor of these shape and strides: its rows (the run of
    elements along the unit-stride dim, or single elements where none has unit stride) each rounded
    up to whole 32-byte sectors."""
    n = math.prod(shape)
    if n == 0:
        return 0
    unit = [d for d, (s, st) in enumerate(zip(shape, stride)) if st == 1 and s > 1]
    run = shape[unit[-1]] if unit else 1
    rows = n // run
    return rows * SECTOR * -(-run * itemsize // SECTOR)


def cost(call, profile):
    """The products over the kernel's padded tiles at the matmul rate, against the bytes of the
    sectors its strided rows touch (``sector_bytes``): a head of 19 bf16 values read from rows 912
    bytes apart moves two 32-byte sectors, not 38 bytes."""
    from ..bmm_triton import blocks

    a, b, out = call.info("a"), call.info("b"), call.outputs[0] if call.outputs else None
    try:
        *batch, M, K = (int(x) for x in a.shape)
        N = int(b.shape[-1])
        bm, bn, bk = blocks(M, N, K)
        flops = 2 * math.prod(batch) * (-(-M // bm) * bm) * (-(-N // bn) * bn) * (-(-K // bk) * bk)
        moved = sum(sector_bytes(tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride), t.dtype.itemsize)
                    for t in (a, b, out) if t is not None and t.stride is not None)
    except TypeError:  # symbolic sizes
        flops = 2 * math.prod(out.shape) * a.shape[-1] if out is not None else 0
        moved = call.in_bytes + call.out_bytes
    kind = "strided_bmm" if profile.efficiency("strided_bmm", "scale") is not None else "matmul"
    return OpCost(flops, moved, kind="matmul", efficiency=kind)


def problem(a: torch.Tensor, b: torch.Tensor, order) -> str | None:
    """Why the op does not take these arguments (None: it does)."""
    if a.dim() != b.dim() or a.dim() < 3 or a.dim() > 5:
        return f"a and b must both be [*batch, M, K] and [*batch, K, N] with 1 to 3 batch dims, got {a.dim()} " \
               f"and {b.dim()} dims"
    if a.shape[:-2] != b.shape[:-2]:
        return f"a and b must have one batch shape, got {tuple(a.shape[:-2])} and {tuple(b.shape[:-2])}"
    if a.shape[-1] != b.shape[-2]:
        return f"a's columns ({a.shape[-1]}) must be b's rows ({b.shape[-2]})"
    if a.dtype != b.dtype:
        return f"a and b must have one dtype, got {a.dtype} and {b.dtype}"
    if order and sorted(order) != list(range(a.dim())):
        return f"order must be a permutation of the output's {a.dim()} dims, got {list(order)}"
    return None


def strided_bmm(a: torch.Tensor, b: torch.Tensor, order=()) -> torch.Tensor:
    """``a @ b`` over one batch shape (at most three dims, any strides: views of permuted tensors are
    read in place), the result laid out in the dim order ``order`` (outermost first; empty: contiguous)."""
    check_floating("strided_bmm", a=a, b=b)
    order = [int(d) for d in order]
    why = problem(a, b, order)
    if why is not None:
        raise KernelArgumentError(f"graphopt::strided_bmm: {why}")
    return torch.ops.graphopt.strided_bmm(a, b, order)


def setup_context(ctx, inputs, output):
    a, b, _ = inputs
    ctx.save_for_backward(a, b)


def backward(ctx, g):
    a, b = ctx.saved_tensors
    return g @ b.transpose(-1, -2), a.transpose(-1, -2) @ g, None


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    qkv = torch.randn(2, 5, 3, 4, 6)  # [B, tokens, 3, heads, dim]: q and v as strided [B, heads, tokens, dim]
    q, v = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    return (q.transpose(-1, -2), v, [0, 2, 1, 3])


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=strided_bmm, cost=cost, kernel="bmm_triton.py",
               cuda=cuda, autograd=(backward, setup_context), example=example)
