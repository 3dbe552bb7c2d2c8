"""CUDA implementation of ``graphopt::group_norm`` in Triton: a row of a group split across programs.

aten's GroupNorm gives each (sample, group) row one thread block for its statistics, so a model
with few rows of many elements (PoolFormer's one group over C x H x W: 64 rows of 200k elements at
batch 64) leaves most of the GPU idle, and applies the normalization in a separate strided kernel.
Here the statistics kernel splits every row into ``S`` chunks, so rows x chunks fill the device;
each program walks its chunk in tiles, keeping a count, mean and sum of squared deviations merged
tile by tile (Chan's parallel formula: no cancellation however large the mean). The apply kernel,
over the same grid, merges a row's ``S`` partials, then normalizes its chunk with the per-channel
weight and bias and the activation, one rounding at the store. Two reads of x, one write.

NCHW-contiguous x: a row is contiguous, its channel ``g * C/G + j // (H*W)``. channels_last x: a
row's element ``j`` sits at pixel ``j // (C/G)``, channel ``g * C/G + j % (C/G)``, so with narrow
groups (under PIXEL_TILE_MAX_CG channels) a row reads short runs; where that width is a power of two
they take kernels of their own: a program takes a sample's run of pixels in tiles [pixels, C] (each
pixel's C channels one contiguous, vectorized run), every lane keeping a Welford count, mean and M2,
merged per group once at the end (the tile's channels viewed [groups, C/G]); the apply kernel merges
a sample's partials per group and spreads them over the channels the same way. The output keeps x's
layout.
"""
from __future__ import annotations

import contextlib

import torch

from .norm_triton import cached_kernel, next_pow2

ACTS = {"none": 0, "relu": 1, "silu": 2, "gelu": 3}
BLOCK = 2048
TARGET_PROGRAMS = 4 * 132  # rows x chunks to aim at: a few programs per SM of an H100/H200
MAX_SPLITS = 256
# channels_last with groups narrower than this many channels takes the pixel-tile kernels (a row of
# one group reads C/G channels of every pixel: runs of under 128 bytes in bf16)
PIXEL_TILE_MAX_CG = 64
_kernels: dict = {}


def _build():
    import triton
    import triton.language as tl

    global _gn_act  # a jitted helper is looked up in the kernels' module globals

    @triton.jit
    def _gn_act(y, ACT: tl.constexpr):
        if ACT == 1:
            y = tl.where(y > 0.0, y, tl.where(y != y, y, 0.0))
        elif ACT == 2:
            y = y / (1.0 + tl.exp(-y))
        elif ACT == 3:
            y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        return y

    @triton.jit
    def gn_stats_kernel(X, PART, L, CG, C, G, CHUNK, S: tl.constexpr, CL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        start = s * CHUNK
        # channels_last: element j of row (n, g) at pixel j // CG, channel g * CG + j % CG
        base_cl = (row // G) * L * G + (row % G) * CG
        cnt = tl.full([], 0.0, tl.float32)
        mean = tl.full([], 0.0, tl.float32)
        m2 = tl.full([], 0.0, tl.float32)
        for off in range(0, CHUNK, BLOCK):
            k = off + tl.arange(0, BLOCK)
            j = start + k
            mask = (k < CHUNK) & (j < L)
            if CL:
                addr = base_cl + (j // CG) * C + j % CG
            else:
                addr = row * L + j
            x = tl.load(X + addr, mask=mask, other=0.0).to(tl.float32)
            nb = tl.sum(mask.to(tl.float32), 0)
            mb = tl.sum(x, 0) / tl.maximum(nb, 1.0)
            d = tl.where(mask, x - mb, 0.0)
            tot = cnt + nb
            delta = mb - mean
            w = nb / tl.maximum(tot, 1.0)
            m2 = m2 + tl.sum(d * d, 0) + delta * delta * cnt * w
            mean = mean + delta * w
            cnt = tot
        base = (row * S + s) * 3
        tl.store(PART + base, cnt)
        tl.store(PART + base + 1, mean)
        tl.store(PART + base + 2, m2)

    @triton.jit
    def gn_apply_kernel(X, PART, W, B, OUT, L, CG, C, G, HW, CHUNK, eps, S: tl.constexpr, SP: tl.constexpr,
                        CL: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        p = tl.arange(0, SP)
        pm = p < S
        base = (row * S + p) * 3
        cnts = tl.load(PART + base, mask=pm, other=0.0)
        means = tl.load(PART + base + 1, mask=pm, other=0.0)
        m2s = tl.load(PART + base + 2, mask=pm, other=0.0)
        tot = tl.sum(cnts, 0)
        mean = tl.sum(cnts * means, 0) / tot
        dm = tl.where(pm, means - mean, 0.0)
        var = (tl.sum(m2s, 0) + tl.sum(cnts * dm * dm, 0)) / tot
        rstd = 1.0 / tl.sqrt(var + eps)
        g = row % G
        base_cl = (row // G) * L * G + g * CG
        start = s * CHUNK
        for off in range(0, CHUNK, BLOCK):
            k = off + tl.arange(0, BLOCK)
            j = start + k
            mask = (k < CHUNK) & (j < L)
            if CL:
                addr = base_cl + (j // CG) * C + j % CG
            else:
                addr = row * L + j
            y = (tl.load(X + addr, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
            if HAS_W or HAS_B:
                if CL:
                    c = g * CG + j % CG
                else:
                    c = g * CG + j // HW
                if HAS_W:
                    y = y * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_B:
                    y = y + tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
            y = _gn_act(y, ACT)
            tl.store(OUT + addr, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def gn_cl_stats_kernel(X, PART, P, C, G, CHUNK, S: tl.constexpr, BP: tl.constexpr, CP: tl.constexpr,
                           GP: tl.constexpr, CG: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        pi = tl.arange(0, BP)[:, None]
        c = tl.arange(0, CP)[None, :]
        # every lane keeps its own count, mean and M2 (Welford, no reduction in the loop) ...
        cnt = tl.zeros([BP, CP], tl.float32)
        mean = tl.zeros([BP, CP], tl.float32)
        m2 = tl.zeros([BP, CP], tl.float32)
        start = s * CHUNK
        for off in range(0, CHUNK, BP):
            pix = start + off + pi
            mask = (c < C) & (pix < P) & (off + pi < CHUNK)
            x = tl.load(X + (n * P + pix) * C + c, mask=mask, other=0.0).to(tl.float32)
            c1 = cnt + mask.to(tl.float32)
            delta = x - mean
            mean = mean + tl.where(mask, delta / tl.maximum(c1, 1.0), 0.0)
            m2 = m2 + tl.where(mask, delta * (x - mean), 0.0)
            cnt = c1
        # ... merged per group once (Chan: M2 = sum M2_i + sum n_i (mean_i - mean)^2); channel
        # g * CG + j is element [g, j] of the [GP, CG] view (CG a power of two)
        cnt = tl.reshape(cnt, [BP, GP, CG])
        mean = tl.reshape(mean, [BP, GP, CG])
        m2 = tl.reshape(m2, [BP, GP, CG])
        cnt_g = tl.sum(tl.sum(cnt, 2), 0)
        mean_g = tl.sum(tl.sum(cnt * mean, 2), 0) / tl.maximum(cnt_g, 1.0)
        dev = mean - mean_g[None, :, None]
        m2_g = tl.sum(tl.sum(m2 + cnt * dev * dev, 2), 0)
        g = tl.arange(0, GP)
        base = ((n * S + s) * G + g) * 3
        gm = g < G
        tl.store(PART + base, cnt_g, mask=gm)
        tl.store(PART + base + 1, mean_g, mask=gm)
        tl.store(PART + base + 2, m2_g, mask=gm)

    @triton.jit
    def gn_cl_apply_kernel(X, PART, W, B, OUT, P, C, G, CHUNK, eps, S: tl.constexpr, SP: tl.constexpr,
                           BP: tl.constexpr, CP: tl.constexpr, GP: tl.constexpr, CG: tl.constexpr,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        sp = tl.arange(0, SP)[:, None]
        g2 = tl.arange(0, GP)[None, :]
        pm = (sp < S) & (g2 < G)
        base = ((n * S + sp) * G + g2) * 3
        cnts = tl.load(PART + base, mask=pm, other=0.0)
        means = tl.load(PART + base + 1, mask=pm, other=0.0)
        m2s = tl.load(PART + base + 2, mask=pm, other=0.0)
        tot = tl.maximum(tl.sum(cnts, 0), 1.0)
        mean_g = tl.sum(cnts * means, 0) / tot
        dm = tl.where(pm, means - mean_g[None, :], 0.0)
        rstd_g = 1.0 / tl.sqrt((tl.sum(m2s, 0) + tl.sum(cnts * dm * dm, 0)) / tot + eps)
        # per channel: group g's value at channels g * CG .. g * CG + CG - 1
        ones = tl.full([GP, CG], 1.0, tl.float32)
        mean = tl.reshape(mean_g[:, None] * ones, [CP])[None, :]
        rstd = tl.reshape(rstd_g[:, None] * ones, [CP])[None, :]
        pi = tl.arange(0, BP)[:, None]
        c = tl.arange(0, CP)[None, :]
        if HAS_W:
            wv = tl.load(W + c, mask=c < C, other=0.0).to(tl.float32)
        if HAS_B:
            bv = tl.load(B + c, mask=c < C, other=0.0).to(tl.float32)
        start = s * CHUNK
        for off in range(0, CHUNK, BP):
            pix = start + off + pi
            mask = (c < C) & (pix < P) & (off + pi < CHUNK)
            addr = (n * P + pix) * C + c
            y = (tl.load(X + addr, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
            if HAS_W:
                y = y * wv
            if HAS_B:
                y = y + bv
            y = _gn_act(y, ACT)
            tl.store(OUT + addr, y.to(OUT.dtype.element_ty), mask=mask)

    return gn_stats_kernel, gn_apply_kernel, gn_cl_stats_kernel, gn_cl_apply_kernel


def plan(rows: int, L: int) -> tuple[int, int]:
    """(splits per row, elements per split): enough programs to fill the device, each a whole
    number of tiles."""
    tiles = max(1, -(-L // BLOCK))
    splits = max(1, min(MAX_SPLITS, tiles, -(-TARGET_PROGRAMS // max(rows, 1))))
    chunk = -(-tiles // splits) * BLOCK
    splits = -(-L // chunk)
    return splits, chunk


def pixel_tiles(c: int, groups: int) -> bool:
    """Does a channels_last input take the pixel-tile kernels: groups narrower than
    PIXEL_TILE_MAX_CG channels, a power of two wide (a tile's channels reshaped [groups, width])?"""
    cg = c // groups
    return cg < PIXEL_TILE_MAX_CG and cg & (cg - 1) == 0


def plan_channels_last(n: int, pixels: int, c: int) -> tuple[int, int, int, int]:
    """(splits per sample, pixels per split, pixels per tile, padded channels) of the channels_last
    kernels: a tile is BP whole pixels, every channel of each."""
    cp = next_pow2(c)
    bp = max(1, BLOCK // cp)
    tiles = max(1, -(-pixels // bp))
    splits = max(1, min(MAX_SPLITS, tiles, -(-TARGET_PROGRAMS // max(n, 1))))
    chunk = -(-tiles // splits) * bp
    return -(-pixels // chunk), chunk, bp, cp


def group_norm_triton(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      eps: float, act: str) -> torch.Tensor:
    """GroupNorm of an NCHW-contiguous or channels_last x (fp32 statistics), x's layout out."""
    cl = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    xc = x if cl else x.contiguous()
    N, C = x.shape[0], x.shape[1]
    HW = x[0, 0].numel() if x.dim() > 2 else 1
    CG = C // groups
    rows, L = N * groups, CG * HW
    out = torch.empty_like(xc)
    if rows == 0 or L == 0:
        return out
    stats, apply, cl_stats, cl_apply = cached_kernel(_kernels, _build)
    w = weight.contiguous() if weight is not None else xc
    b = bias.contiguous() if bias is not None else xc
    if cl and pixel_tiles(C, groups):  # tiles of whole pixels: each load reads a pixel's C channels at once
        splits, chunk, bp, cp = plan_channels_last(N, HW, C)
        part = torch.empty((N, splits, groups, 3), device=x.device, dtype=torch.float32)
        shape = dict(BP=bp, CP=cp, GP=cp // CG, CG=CG, num_warps=8 if bp * cp >= 1024 else 4)
        with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
            cl_stats[(N, splits)](xc, part, HW, C, groups, chunk, S=splits, **shape)
            cl_apply[(N, splits)](xc, part, w, b, out, HW, C, groups, chunk, float(eps), S=splits,
                                  SP=max(2, next_pow2(splits)), HAS_W=weight is not None, HAS_B=bias is not None,
                                  ACT=ACTS[act], **shape)
        return out
    splits, chunk = plan(rows, L)
    part = torch.empty((rows, splits, 3), device=x.device, dtype=torch.float32)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        stats[(rows, splits)](xc, part, L, CG, C, groups, chunk, S=splits, CL=cl, BLOCK=BLOCK, num_warps=8)
        apply[(rows, splits)](xc, part, w, b, out, L, CG, C, groups, HW, chunk, float(eps), S=splits,
                              SP=max(2, next_pow2(splits)), CL=cl, HAS_W=weight is not None,
                              HAS_B=bias is not None, ACT=ACTS[act], BLOCK=BLOCK, num_warps=8)
    return out
