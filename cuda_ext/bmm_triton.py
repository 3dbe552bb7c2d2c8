"""``graphopt::strided_bmm`` in one Triton kernel: batched products read and written through any strides.

cuBLAS's strided-batched GEMM takes one batch stride per operand, so aten's ``matmul`` copies an
operand whose batch dims do not fold into one (heads split out of a fused projection: a q of
[B, heads, tokens, dim] read through the [B, tokens, 3, heads, dim] output has batch strides
tokens*3*heads*dim and dim) into a contiguous tensor first, and its result is contiguous, so a
head merge after it (``transpose(1, 2).reshape(B, tokens, heads * dim)``) copies again. Here a
program computes one [BM, BN] tile of one matrix of the batch: up to three batch dims, each with
its own strides in each operand and in the output, so the operands are read where they are and
the output is written in the order its readers want. fp32 accumulation with ``tl.dot`` (fp32
operands at full precision, not TF32); offsets are 32-bit unless a tensor spans 2**31 elements.
Tiles are sized to the matrices (at least 16, at most 128 x 128 x 64): the products this serves are
small per matrix (a head's [19, 3137] x [3137, 19] in a factorized attention), many per batch.
"""
from __future__ import annotations

import contextlib

import torch

from .col2im_triton import _span
from .norm_triton import cached_kernel

_kernels: dict = {}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BATCH_DIMS = 3


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def bmm_kernel(A, B, C, M, N, K, sa0, sa1, sa2, sam, sak, sb0, sb1, sb2, sbk, sbn, sc0, sc1, sc2, scm, scn,
                   D1: tl.constexpr, D2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr, WIDE: tl.constexpr):
        bat = tl.program_id(0)  # (the batch on the grid's first axis: it may pass the others' 65535)
        pid = tl.program_id(1)
        if WIDE:
            bat = bat.to(tl.int64)
        tiles_n = tl.cdiv(N, BN)
        pm = pid // tiles_n
        pn = pid % tiles_n
        i2 = bat % D2
        i1 = (bat // D2) % D1
        i0 = bat // (D2 * D1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        if WIDE:
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        a_ptr = A + i0 * sa0 + i1 * sa1 + i2 * sa2 + rm[:, None] * sam + rk[None, :] * sak
        b_ptr = B + i0 * sb0 + i1 * sb1 + i2 * sb2 + rk[:, None] * sbk + rn[None, :] * sbn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ka = (k0 + rk) < K
            a = tl.load(a_ptr, mask=(rm[:, None] < M) & ka[None, :], other=0.0)
            b = tl.load(b_ptr, mask=ka[:, None] & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
            a_ptr += BK * sak
            b_ptr += BK * sbk
        c_ptr = C + i0 * sc0 + i1 * sc1 + i2 * sc2 + rm[:, None] * scm + rn[None, :] * scn
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return bmm_kernel


def _pow2(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def blocks(M: int, N: int, K: int) -> tuple[int, int, int]:
    """The tile (BM, BN, BK) for [M, K] x [K, N] matrices: each the next power of two of its size,
    at least 16 (``tl.dot``'s least), at most 128, 128 and 64."""
    return _pow2(M, 16, 128), _pow2(N, 16, 128), _pow2(K, 16, 64)


def _five_d(t: torch.Tensor) -> torch.Tensor:
    """t [*batch, r, c] with its batch dims padded in front to three (size-1 views)."""
    while t.dim() < MAX_BATCH_DIMS + 2:
        t = t.unsqueeze(0)
    return t


def bmm_triton(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` [*batch, M, N] (empty, laid out as it will be returned) gets ``a @ b`` for a
    [*batch, M, K] and b [*batch, K, N] of the same batch shape (at most three dims, any strides)."""
    import triton

    a5, b5, c5 = _five_d(a), _five_d(b), _five_d(out)
    D0, D1, D2, M, K = a5.shape
    N = b5.shape[-1]
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    wide = max(_span(a), _span(b), _span(out)) >= 2 ** 31
    BM, BN, BK = blocks(M, N, K)
    grid = (D0 * D1 * D2, triton.cdiv(M, BM) * triton.cdiv(N, BN))
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        _kernel()[grid](a5, b5, c5, M, N, K, *a5.stride(), *b5.stride(), *c5.stride(), D1=D1, D2=D2,
                        BM=BM, BN=BN, BK=BK, IEEE=a.dtype == torch.float32, WIDE=wide, num_warps=4)
    return out

