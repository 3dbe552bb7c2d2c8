"""``graphopt::rotary_cache_write`` in one Triton kernel: rotary embedding of q and k, and the
rotated k and v written into a preallocated K/V cache at the step's positions.

A decode step of a model with a static cache runs, per layer, the rotary kernel (q and k), the
cache position ``arange(T) + cumulative_length`` and one ``index_copy_`` each for the keys and
the values: four launches that each move a few KB. Here one program handles one head row
(one batch row, one position, one head of q, k or v): it loads the row (and, for q and k, the
partner element of each rotated pair and that position's cos/sin), rotates in fp32, and stores
q's row into the output (laid out as ``ops/rotary.layout`` says), k's and v's rows into the
caches at position ``start + t`` (``pos`` a 0-dim start) or ``pos[t]`` (``pos`` [T] positions).
A position outside the cache is not written (``index_copy_`` would fail on it).
"""
from __future__ import annotations

import contextlib

import torch

from .norm_triton import cached_kernel, next_pow2, pdl_launch

_kernels: dict = {}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 1024


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def rotary_cache_kernel(Q, K, V, COS, SIN, KC, VC, POS, QO,
                            sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                            scb, sct, ssb, sst, skcb, skch, skcl, skcd, svcb, svch, svcl, svcd,
                            sob, soh, sot, sod, sp,
                            HQ, HKV, T, L, D, DV, R,
                            POS_SCALAR: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        bt = tl.program_id(0)
        j = tl.program_id(1)              # head slot: q heads, then k heads, then v heads
        b = (bt // T).to(tl.int64)
        t = (bt % T).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        if POS_SCALAR:
            p = tl.load(POS).to(tl.int64) + t
        else:
            p = tl.load(POS + t * sp).to(tl.int64)
        in_cache = (p >= 0) & (p < L)
        # a head row rotated in fp32: dims < R as rotate_half (or GLM's pairs), the rest as they are
        in_rot = d < R
        if INTERLEAVED:
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:
            half = R // 2
            partner = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(COS + b * scb + t * sct + d, mask=in_rot, other=0.0).to(tl.float32)
        s = tl.load(SIN + b * ssb + t * sst + d, mask=in_rot, other=0.0).to(tl.float32)
        if j < HQ:
            hq = j.to(tl.int64)
            src = Q + b * sqb + hq * sqh + t * sqt
            x = tl.load(src + d * sqd, mask=d < D, other=0.0).to(tl.float32)
            xp = tl.load(src + partner * sqd, mask=in_rot, other=0.0).to(tl.float32)
            y = tl.where(in_rot, x * c + sign * xp * s, x)
            tl.store(QO + b * sob + hq * soh + t * sot + d * sod, y.to(QO.dtype.element_ty), mask=d < D)
        elif j < HQ + HKV:
            hk = (j - HQ).to(tl.int64)
            src = K + b * skb + hk * skh + t * skt
            x = tl.load(src + d * skd, mask=d < D, other=0.0).to(tl.float32)
            xp = tl.load(src + partner * skd, mask=in_rot, other=0.0).to(tl.float32)
            y = tl.where(in_rot, x * c + sign * xp * s, x)
            tl.store(KC + b * skcb + hk * skch + p * skcl + d * skcd, y.to(KC.dtype.element_ty),
                     mask=(d < D) & in_cache)
        else:
            hv = (j - HQ - HKV).to(tl.int64)
            # (its own names: Triton merges a name assigned in both branches of an if, and v's row is
            # not fp32 as the rotated rows are)
            xv = tl.load(V + b * svb + hv * svh + t * svt + d * svd, mask=d < DV, other=0.0)
            tl.store(VC + b * svcb + hv * svch + p * svcl + d * svcd, xv.to(VC.dtype.element_ty),
                     mask=(d < DV) & in_cache)

    return rotary_cache_kernel


def table(t: torch.Tensor) -> torch.Tensor:
    """cos/sin as [B or 1, T, R] (a [B or 1, 1, T, R] table squeezed)."""
    return t.squeeze(1) if t.dim() == 4 else t


def rotary_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved: bool, out: torch.Tensor):
    """One launch: ``out`` (an empty tensor like rotary's q output) gets rotated q; rotated k and v
    go into the caches in place. Arguments as ``ops/rotary_cache_write.py`` checks them."""
    B, HQ, T, D = q.shape
    HKV, DV, L = k.shape[1], v.shape[3], k_cache.shape[2]
    c, s = table(cos), table(sin)
    if c.stride(-1) != 1:
        c = c.contiguous()
    if s.stride(-1) != 1:
        s = s.contiguous()
    R = c.shape[-1]
    cb = c.stride(0) if c.shape[0] > 1 else 0
    sb = s.stride(0) if s.shape[0] > 1 else 0
    scalar = pos.dim() == 0
    kernel = _kernel()
    grid = (B * T, HQ + 2 * HKV)
    if grid[0] == 0 or grid[1] == 0:
        return out
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](q, k, v, c, s, k_cache, v_cache, pos, out,
                     *q.stride(), *k.stride(), *v.stride(),
                     cb, c.stride(1), sb, s.stride(1), *k_cache.stride(), *v_cache.stride(),
                     *out.stride(), 0 if scalar else pos.stride(0),
                     HQ, HKV, T, L, D, DV, R,
                     POS_SCALAR=scalar, INTERLEAVED=bool(interleaved), BLOCK_D=max(16, next_pow2(max(D, DV))),
                     num_warps=1 if max(D, DV) <= 128 else 4, **pdl_launch(q.device))
    return out
