"""CUDA implementation of ``graphopt::column_sum`` in Triton: the sum of a [R, N] tensor over its
rows (a linear layer's bias gradient), in one launch.

The grid is column blocks × row bands: each program walks its band of rows a tile of [ROWS,
BLOCK_N] at a time and keeps per-row fp32 sums in registers, reduces them over the tile's rows once
at the end and writes one partial row of [bands, N] fp32; the last band of a column block to
finish (a counter per block, graphopt's shared split counters) sums the block's partial rows and
writes the result. With one band the program writes the result itself. Enough
programs to fill the GPU whatever N is, where a reduction over the outer dimension that gives each
column block one program leaves most SMs idle for narrow rows.
"""
from __future__ import annotations

import contextlib

import torch

from .norm_triton import cached_kernel, fence, next_pow2, split_counters

_kernels: dict = {}


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def column_sum_kernel(X, PART, OUT, CNT, R, N, iters, bands, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_B: tl.constexpr, FENCE: tl.constexpr):
        # the sum over rows [band * iters * ROWS, (band + 1) * iters * ROWS) of X[:, cols]: with one band
        # the result (OUT, X's dtype); else an fp32 partial row PART[band, cols], and the last band of the
        # column block to finish sums the partial rows into OUT
        cb = tl.program_id(0)
        band = tl.program_id(1)
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for i in range(iters):
            rows = (band.to(tl.int64) * iters + i) * ROWS + tl.arange(0, ROWS)
            mask = (rows < R)[:, None] & cmask[None, :]
            acc += tl.load(X + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0)
        if bands == 1:
            tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=cmask)
        else:
            tl.store(PART + band.to(tl.int64) * N + cols, total, mask=cmask)
            # every thread's stores visible at GPU scope before the count goes up
            if FENCE:  # (the interpreter runs programs one after another and has no PTX)
                tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 0;", "=r,r", [cb.to(tl.int32)],
                                          dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
            done = tl.atomic_add(CNT + cb, 1, sem="acq_rel", scope="gpu")
            if done == bands - 1:
                s = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
                for b0 in range(0, bands, BLOCK_B):
                    bs = b0 + tl.arange(0, BLOCK_B)
                    s += tl.load(PART + bs[:, None].to(tl.int64) * N + cols[None, :],
                                 mask=(bs < bands)[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
                tl.store(OUT + cols, tl.sum(s, axis=0).to(OUT.dtype.element_ty), mask=cmask)
                tl.store(CNT + cb, 0)  # ready for the next call (a replayed CUDA graph reuses it)

    return column_sum_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def column_sum_plan(R: int, N: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, rows a tile, tiles a program, row bands, warps) for summing R rows N wide: column
    blocks of up to 128, tiles of about 4K elements, about four programs an SM over all blocks
    (one band when the column blocks alone fill that)."""
    block_n = min(128, next_pow2(N))
    rows = max(1, min(64, 4096 // block_n))
    col_blocks = _cdiv(N, block_n)
    tiles = _cdiv(R, rows)
    bands = max(1, min(tiles, _cdiv(4 * sms, col_blocks)))
    iters = _cdiv(tiles, bands)
    bands = _cdiv(tiles, iters)
    return block_n, rows, iters, bands, 4 if block_n * rows <= 2048 else 8


def column_sum_triton(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over every dim but the last, in x's dtype (fp32 sums, one rounding)."""
    N = x.shape[-1] if x.dim() else 1
    xc = x.contiguous()
    R = xc.numel() // N if N else 0
    if R == 0 or N == 0:
        return torch.zeros(N, dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 2
    block_n, rows, iters, bands, warps = column_sum_plan(R, N, sms)
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    part = torch.empty((bands, N), dtype=torch.float32, device=x.device) if bands > 1 else out
    col_blocks = _cdiv(N, block_n)
    cnt = split_counters(x.device, col_blocks) if bands > 1 else out
    k = cached_kernel(_kernels, _build)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        k[(col_blocks, bands)](xc, part, out, cnt, R, N, iters, bands, ROWS=rows, BLOCK_N=block_n, BLOCK_B=32,
                               FENCE=fence(), num_warps=warps)
    return out
