"""``graphopt::col2im`` in one Triton kernel: ``F.fold`` of windows read through any strides.

aten's CUDA col2im gives each output pixel a thread that gathers its windows' taps, with 64-bit
index arithmetic on runtime sizes; it reads a contiguous [N, C*kh*kw, L] input, so a fold of a
permuted product (VOLO's outlooker: ``(attn @ v).permute(...).reshape(...)``) copies it first.
Here a program handles BLOCK output elements in the output's memory order (channels innermost
for a channels_last output, so neighbouring lanes read neighbouring channels where the input
has them innermost); each element sums, in fp32, the taps of the windows that cover it: tap
(ki, kj) of window (ly, lx) lands on y = ly*sh - ph + ki*dh, so a tap contributes where
``y + ph - ki*dh`` is a non-negative multiple of sh below lh*sh (and likewise along x). Without
dilation only the ceil(kh/sh) taps congruent to y + ph modulo sh can, and only those are visited
(a 16x16 patch fold at stride 16 reads one tap per element, not 256). The
input is a 7-D view [N, C1, C2, kh, kw, lh, lw] (channels c = c1*C2 + c2), so a channel dim
that is two dims of a permuted tensor is read in place. Shapes, kernel, stride, padding and
dilation are compile-time constants (index division by constants); offsets are 32-bit unless
a tensor spans 2**31 elements.
"""
from __future__ import annotations

import contextlib

import torch

from .norm_triton import cached_kernel

_kernels: dict = {}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def col2im_kernel(X, OUT, total, sn, sc1, sc2, ski, skj, sly, slx, son, soc, soh, sow,
                      C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, C2: tl.constexpr,
                      LH: tl.constexpr, LW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                      SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                      DH: tl.constexpr, DW: tl.constexpr, NY: tl.constexpr, NX: tl.constexpr,
                      STEP_Y: tl.constexpr, STEP_X: tl.constexpr, CL: tl.constexpr, WIDE: tl.constexpr,
                      BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if WIDE:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < total
        if CL:  # n, y, x, c: channels innermost
            c = offs % C
            r = offs // C
            x = r % W
            r = r // W
            y = r % H
            n = r // H
        else:  # n, c, y, x
            x = offs % W
            r = offs // W
            y = r % H
            r = r // H
            c = r % C
            n = r // C
        base = n * sn + (c // C2) * sc1 + (c % C2) * sc2
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(NY):
            if STEP_Y:  # the taps congruent to y + ph modulo sh, the only ones that land on y
                ki = (y + PH) % SH + j * SH
                ly = (y + PH) // SH - j
                oky = (ki < KH) & (ly >= 0) & (ly < LH)
            else:
                ki = j
                ty = y + PH - ki * DH
                tyc = tl.maximum(ty, 0)
                ly = tyc // SH
                oky = (ty >= 0) & (tyc - ly * SH == 0) & (ly < LH)
            for i in tl.static_range(NX):
                if STEP_X:
                    kj = (x + PW) % SW + i * SW
                    lx = (x + PW) // SW - i
                    okx = (kj < KW) & (lx >= 0) & (lx < LW)
                else:
                    kj = i
                    tx = x + PW - kj * DW
                    txc = tl.maximum(tx, 0)
                    lx = txc // SW
                    okx = (tx >= 0) & (txc - lx * SW == 0) & (lx < LW)
                v = tl.load(X + base + ki * ski + kj * skj + ly * sly + lx * slx, mask=m & oky & okx, other=0.0)
                acc += v.to(tl.float32)
        tl.store(OUT + n * son + c * soc + y * soh + x * sow, acc.to(OUT.dtype.element_ty), mask=m)

    return col2im_kernel


def taps(k: int, dilation: int, stride: int) -> tuple[int, bool]:
    """(taps an output element visits along a dim, whether it steps through them by the stride):
    undilated, only the taps congruent to the position modulo the stride land on it, ceil(k / s)
    of them; dilated, each of the k taps is tested."""
    if dilation == 1 and stride > 1:
        return -(-k // stride), True
    return k, False


def _span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last element, plus one."""
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)


def col2im_triton(x: torch.Tensor, out: torch.Tensor, kernel, dilation, padding, stride, channels_last: bool):
    """``out`` [N, C, H, W] (empty, laid out as it will be returned) gets the fold of ``x``
    [N, C1, C2, kh, kw, lh, lw]; arguments as ``ops/col2im.py`` checks them."""
    N, C1, C2, kh, kw, lh, lw = x.shape
    _, C, H, W = out.shape
    total = out.numel()
    if total == 0:
        return out
    wide = max(_span(x), _span(out), total + BLOCK) >= 2 ** 31
    (ny, step_y), (nx, step_x) = taps(kh, dilation[0], stride[0]), taps(kw, dilation[1], stride[1])
    kernel_fn = _kernel()
    grid = ((total + BLOCK - 1) // BLOCK,)
    sn, sc1, sc2, ski, skj, sly, slx = x.stride()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        kernel_fn[grid](x, out, total, sn, sc1, sc2, ski, skj, sly, slx, *out.stride(),
                        C=C, H=H, W=W, C2=C2, LH=lh, LW=lw, KH=kh, KW=kw, SH=stride[0], SW=stride[1],
                        PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1], NY=ny, NX=nx,
                        STEP_Y=step_y, STEP_X=step_x, CL=bool(channels_last),
                        WIDE=wide, BLOCK=BLOCK, num_warps=4)
    return out
