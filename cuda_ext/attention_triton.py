"""CUDA implementation of ``graphopt::short_attention`` in Triton: attention over short key sequences
in one pass, no workspace.

At small batch the SDPA backends cost more around their kernel than in it: on the H200 a
BERT-base layer at bs1 seq128 spends 5.7 µs in cuDNN's fused attention kernel, plus a memset
and a launch gap (measured inside a CUDA graph, ``benchmarks/results/diag_busy_…130233.md``);
the memory-efficient kernel takes 9.8 µs. When every key of a head fits in one tile
(``MAX_KEYS``), one program computes a ``[BLOCK_M, keys]`` block of scores with one ``tl.dot``,
adds the mask, takes the softmax in fp32 over registers and multiplies by V with a second
``tl.dot``: no running maximum, no rescaling, no second pass, no scratch memory.

Semantics are ``scaled_dot_product_attention`` in inference: ``softmax(q @ k^T * scale + mask) @
v`` with an additive float mask or a boolean mask (True = attend), broadcast over batch, heads
and rows through its strides; ``is_causal`` is the top-left-aligned triangle (key j visible to
query i when j <= i) as SDPA's; grouped-query attention when q has a multiple of k's heads
(query head h reads key/value head h // (Hq / Hk)). A row that masks out every key gives zeros,
as SDPA does (its "safe softmax"). The unnormalized probabilities are rounded to the value dtype
before the second product, as the flash kernels round theirs.

The output is laid out [B, S, H, D] in memory and returned as the [B, H, S, D] view, so the
usual ``transpose(1, 2).reshape(B, S, H * D)`` after attention is a view, not a copy.
"""
from __future__ import annotations

import contextlib

import torch

from .norm_triton import cached_kernel, next_pow2

_kernels: dict = {}
MAX_KEYS = 256       # every key of a head in one tile
MAX_HEAD_DIM = 128
DTYPES = (torch.bfloat16, torch.float16)


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def attn_one_tile_kernel(Q, K, V, M, O, scale,
                             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                             smb, smh, smm, smn, sob, soh, som, sod,
                             H, GROUP, SQ, SK, D,
                             HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = bh % H
        hk = (h // GROUP).to(tl.int64)
        h = h.to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.arange(0, BLOCK_N)
        rd = tl.arange(0, BLOCK_D)
        row_ok = rm < SQ
        key_ok = rn < SK
        d_ok = rd < D
        q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :] * sqd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        k = tl.load(K + b * skb + hk * skh + rn[:, None] * skn + rd[None, :] * skd,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        keep = key_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (rn[None, :] <= rm[:, None])
        if HAS_MASK:
            mk = tl.load(M + b * smb + h * smh + rm[:, None] * smm + rn[None, :] * smn, mask=keep, other=0)
            if MASK_BOOL:
                keep = keep & (mk != 0)
            else:
                s = s + mk.to(tl.float32)
        s = tl.where(keep, s, float("-inf"))
        mx = tl.max(s, 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        p = tl.exp(s - mx[:, None])
        p = tl.where(keep, p, 0.0)
        den = tl.sum(p, 1)
        v = tl.load(V + b * svb + hk * svh + rn[:, None] * svn + rd[None, :] * svd,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        o = tl.dot(p.to(v.dtype), v)
        o = o / tl.where(den > 0, den, 1.0)[:, None]  # a row that masks out every key: zeros, as SDPA
        tl.store(O + b * sob + h * soh + rm[:, None] * som + rd[None, :] * sod, o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    return attn_one_tile_kernel


def supported(q_shape, k_shape, dtype) -> str | None:
    """None when the kernel covers these shapes and dtype, else why not (for the pass's report)."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (bf16 and fp16 only)"
    return shape_problem(q_shape, k_shape)


def shape_problem(q_shape, k_shape) -> str | None:
    """None when one tile covers q [B, H, Sq, D] over k [B, Hk, Sk, D], else why not."""
    if len(q_shape) != 4 or len(k_shape) != 4:
        return "q, k and v must be [batch, heads, sequence, head_dim]"
    if k_shape[2] > MAX_KEYS:
        return f"{k_shape[2]} keys > {MAX_KEYS} (at most {MAX_KEYS} keys: one tile holds every key of a head)"
    if not 1 <= q_shape[3] <= MAX_HEAD_DIM:
        return f"head dim {q_shape[3]} (1-{MAX_HEAD_DIM})"
    if k_shape[1] == 0 or q_shape[1] % k_shape[1]:
        return f"{q_shape[1]} query heads over {k_shape[1]} key heads (q's heads must be a multiple of k's)"
    return None


def mask_problem(mask_shape, mask_dtype, target) -> str | None:
    """None when a mask of this shape and dtype (bool, or float added to the scores) broadcasts
    to ``target`` = (B, H, Sq, Sk), else why not."""
    if not (mask_dtype == torch.bool or mask_dtype.is_floating_point):
        return f"mask dtype {mask_dtype} (bool or float only)"
    try:
        ok = tuple(torch.broadcast_shapes(tuple(mask_shape), tuple(target))) == tuple(target)
    except RuntimeError:
        ok = False
    return None if ok else f"mask {tuple(mask_shape)} does not broadcast to {tuple(target)}"


def blocks(B: int, H: int, SQ: int, SK: int, D: int, sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): the query tile covers the queries, at most 64, and shrinks (-> 32
    -> 16) until the grid fills the device; a score tile of more than 64x128 gets 8 warps."""
    bn = max(16, next_pow2(SK))
    bm = min(64, max(16, next_pow2(SQ)))
    while bm > 16 and -(-SQ // bm) * B * H < sms:
        bm //= 2
    warps = 8 if bm * bn > 64 * 128 or bm * max(16, next_pow2(D)) > 64 * 128 else 4
    return bm, bn, warps


def padded_flops(B: int, H: int, SQ: int, SK: int, D: int, sms: int = 132) -> int:
    """The kernel's work: both products over whole tiles (queries up to BLOCK_M, keys up to
    BLOCK_N, the head dim up to BLOCK_D), causal or not (the one tile is computed whole)."""
    bm, bn, _ = blocks(B, H, SQ, SK, D, sms)
    return 4 * B * H * (-(-SQ // bm) * bm) * bn * max(16, next_pow2(D))


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     is_causal: bool) -> torch.Tensor:
    import triton

    why = supported(tuple(q.shape), tuple(k.shape), q.dtype)
    if why is not None:
        raise ValueError(f"graphopt::short_attention: {why}")
    B, H, SQ, D = q.shape
    Hk, SK = k.shape[1], k.shape[2]
    out = torch.empty((B, SQ, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    if out.numel() == 0:
        return out
    if mask is not None:
        mask = mask.expand(B, H, SQ, SK)  # stride 0 where broadcast
        ms = mask.stride()
    else:
        ms = (0, 0, 0, 0)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else 132
    bm, bn, warps = blocks(B, H, SQ, SK, D, sms)
    kern = _kernel()
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        kern[(triton.cdiv(SQ, bm), B * H)](
            q, k, v, mask if mask is not None else q, out, float(scale),
            *q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(),
            H, H // Hk, SQ, SK, D,
            HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.bool, CAUSAL=bool(is_causal),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, next_pow2(D)), num_warps=warps)
    return out
