"""CUDA implementation of ``graphopt::layer_norm`` in Triton: many rows per program.

aten's LayerNorm kernel (and graphopt's ``add_layer_norm``) give each row its own thread block,
which is the right shape for transformer hidden sizes (768-4096) but leaves small rows bound by
block scheduling: ConvNeXt-T's 96-768-wide rows ran at about a tenth of the copy bandwidth on
the H200 (benchmarks/results/profile_convnext_tiny_bs64.md). Here one program normalizes
``ROWS`` rows at once as a [ROWS, BLOCK_H] tile (fp32 statistics, two-pass over registers, one
rounding at the store), so a program always moves ~8K elements whatever the row width.
"""
from __future__ import annotations

import contextlib
import os

import torch

_kernels: dict = {}
MAX_HIDDEN = 8192


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cached_kernel(kernels: dict, build):
    """``build()`` (which defines a ``@triton.jit`` function) once per TRITON_INTERPRET setting:
    the interpreter must be chosen before a kernel is defined, and the tests switch it."""
    key = os.environ.get("TRITON_INTERPRET", "0")
    if key not in kernels:
        kernels[key] = build()
    return kernels[key]


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def ln_rows_kernel(X, W, B, Y, R, H, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_H: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        mask = (rows < R)[:, None] & cmask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / H
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1) / H
        y = d * (1.0 / tl.sqrt(var + eps))[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=1.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    return ln_rows_kernel


_sandwich_kernels: dict = {}


def _build_sandwich():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_add_rms_kernel(Y, RES, WY, W, OUT, HOUT, R, H, eps_y, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        mask = (rows < R)[:, None] & cmask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        dt = OUT.dtype.element_ty
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        ry = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / H + eps_y)
        wy = tl.load(WY + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        yn = (wy * (y * ry[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        h = (yn + tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / H + eps)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        out = w * (hf * r[:, None]).to(dt).to(tl.float32)
        tl.store(HOUT + offs, h, mask=mask)
        tl.store(OUT + offs, out.to(dt), mask=mask)

    return rms_add_rms_kernel


def rms_norm_add_rms_norm_triton(y: torch.Tensor, residual: torch.Tensor, weight_y: torch.Tensor,
                                 weight: torch.Tensor, eps_y: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``graphopt::rms_norm_add_rms_norm`` (see reference.rms_norm_add_rms_norm) in one pass: each
    row of y and residual read once, out and h written once; rows up to MAX_HIDDEN wide."""
    import triton

    H = y.shape[-1] if y.dim() else 1
    if H > MAX_HIDDEN:
        raise ValueError(f"graphopt::rms_norm_add_rms_norm: hidden size {H} > {MAX_HIDDEN}")
    yc = y.contiguous()
    rc = residual.to(y.dtype).expand(y.shape).contiguous()
    out, h = torch.empty_like(yc), torch.empty_like(yc)
    R = yc.numel() // H if H else 0
    if R == 0 or H == 0:
        return out, h
    wy, w = weight_y.to(y.device).contiguous(), weight.to(y.device).contiguous()
    bh = next_pow2(H)
    rows = max(1, min(64, 2048 // bh))
    warps = 8 if bh * rows >= 4096 else 4
    k = cached_kernel(_sandwich_kernels, _build_sandwich)
    with torch.cuda.device(y.device) if y.device.type == "cuda" else contextlib.nullcontext():
        k[(triton.cdiv(R, rows),)](yc, rc, wy, w, out, h, R, H, float(eps_y), float(eps), ROWS=rows, BLOCK_H=bh,
                                   num_warps=warps)
    return out, h


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
    """layer_norm over the last dim of x (made contiguous explicitly), fp32 statistics."""
    import triton

    H = x.shape[-1] if x.dim() else 1
    if H > MAX_HIDDEN:
        raise ValueError(f"graphopt::layer_norm: hidden size {H} > {MAX_HIDDEN} (use add_layer_norm)")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    R = xc.numel() // H if H else 0
    if R == 0 or H == 0:
        return y
    w = weight.to(x.device).contiguous() if weight is not None else None
    b = bias.to(x.device).contiguous() if bias is not None else None
    bh = next_pow2(H)
    rows = max(1, min(128, 8192 // bh))
    warps = 4 if bh * rows <= 4096 else 8
    k = _kernel()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        k[(triton.cdiv(R, rows),)](xc, w if w is not None else xc, b if b is not None else xc, y, R, H, float(eps),
                                   HAS_W=w is not None, HAS_B=b is not None, ROWS=rows, BLOCK_H=bh,
                                   num_warps=warps)
    return y
