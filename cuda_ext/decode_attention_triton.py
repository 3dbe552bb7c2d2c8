"""``graphopt::decode_attention``: attention of a few query positions over a long key/value cache
(a decode step, or a speculative-decoding step of up to ``MAX_TQ`` tokens), split along the keys.

Semantics: ``scaled_dot_product_attention(q, k, v, mask, scale=scale)`` in inference, with
grouped queries (query head h reads key/value head h // (Hq / Hkv)), a boolean mask (True =
attend) or an additive float mask broadcastable to [B, Hq, Tq, L], and an optional ``kv_len``:
an integer tensor of B values (or one for every row) after which no key is read; key j of batch
row b takes part only when j < kv_len[b]. ``kv_len`` only bounds the work: the result equals the
mask-only result whenever the mask already excludes every key at or past kv_len (a bool mask, or
an additive one whose excluded entries are -inf). A row whose every key is excluded gives zeros,
as SDPA does.

On CUDA (bf16/fp16, head dim 16-256 a multiple of 8, ``(Hq / Hkv) * Tq <= MAX_ROWS``) it is
flash-decoding in two Triton kernels. The first runs one program per (batch row, key/value head,
split of the keys): it holds the ``Hq / Hkv * Tq`` query rows that read that head, so every K/V
block is loaded once for the whole group, keeps a running maximum and sum in fp32 and writes the
split's unnormalized output with its maximum and sum. The split boundaries are computed inside
the kernel from the real length (``min(kv_len, L)``), so in a replayed CUDA graph the work
follows the past length, not the cache's size. The second kernel combines the splits of each
query row by their log-sum-exp. With one split the first kernel normalizes and stores the output
itself (one launch). The probabilities are rounded to v's dtype before the product with V, as
flash kernels round theirs (the reference does not round them).

The output is [B, Hq, Tq, D] laid out [B, Tq, Hq, D] (as ``short_attention``'s), so the usual
``transpose(1, 2).reshape(B, Tq, Hq * D)`` after attention is a view.

The reference, the fake implementation, the argument check and the cost formula are the small
functions below; ``_register.py``, ``reference.py`` and ``ops.py`` only import them.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .norm_triton import cached_kernel, fence, next_pow2, pdl_launch, split_counters

_kernels: dict = {}
DTYPES = (torch.bfloat16, torch.float16)
MAX_TQ = 16      # query positions per call the kernel takes (decode: 1; speculative decoding: a few)
MAX_ROWS = 64    # query rows one program holds: (Hq / Hkv) * Tq
MAX_SPLITS = 128
SM_COUNT = 132   # the H200's, for planning without a device
COMBINE_ELEMENTS = 8192   # fp32 partial-output elements the combining program loads at once


# ---------------------------------------------------------------------------------- semantics

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def output_layout(q: torch.Tensor) -> torch.Tensor:
    """An empty [B, Hq, Tq, D] output laid out [B, Tq, Hq, D] in memory."""
    B, H, T, D = q.shape
    return q.new_empty((B, T, H, D)).transpose(1, 2)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              kv_len: torch.Tensor | None, scale: float) -> torch.Tensor:
    """What the op computes, in plain torch: scores in fp32 (fp64 for fp64 inputs), grouped
    queries, a bool mask keeps True, a float mask is added, keys at or past kv_len[b] excluded, a
    row with every key excluded gives zeros. Output [B, Hq, Tq, D] laid out [B, Tq, Hq, D]."""
    ct = _compute_dtype(q.dtype)
    B, H, T, D = q.shape
    Hk, L = k.shape[1], k.shape[2]
    if H != Hk:
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = (q.to(ct) @ k.to(ct).transpose(-1, -2)) * scale
    keep = torch.ones(1, 1, 1, L, dtype=torch.bool, device=q.device)
    if kv_len is not None:
        n = kv_len.reshape(-1).to(device=q.device, dtype=torch.int64)
        keep = keep & (torch.arange(L, device=q.device) < n[:, None, None, None])
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.to(ct)
    keep = keep.expand(s.shape)
    s = s.masked_fill(~keep, -math.inf)
    mx = s.amax(dim=-1, keepdim=True)
    mx = torch.where(mx == -math.inf, torch.zeros((), dtype=ct, device=q.device), mx)
    p = torch.exp(s - mx).masked_fill(~keep, 0.0)
    den = p.sum(-1, keepdim=True)
    o = (p @ v.to(ct)) / torch.where(den > 0, den, torch.ones((), dtype=ct, device=q.device))
    return output_layout(q).copy_(o)


def fake(q, k, v, mask, kv_len, scale):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "graphopt::decode_attention: q, k and v must be [batch, heads, sequence, head_dim]")
    return output_layout(q)


def argument_problem(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, mask_shape=None, mask_dtype=None,
                     kv_len_shape=None, kv_len_dtype=None) -> str | None:
    """None when the op accepts these arguments (any device, any dtype the reference takes), else
    why not, in one line."""
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return "q, k and v must be [batch, heads, sequence, head_dim]"
    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    if q_dtype not in floats or k_dtype != q_dtype or v_dtype != q_dtype:
        return f"q, k, v are {q_dtype}, {k_dtype}, {v_dtype}; one floating dtype for all three"
    B, H, T, D = q_shape
    if tuple(k_shape) != tuple(v_shape) or k_shape[0] != B or k_shape[3] != D:
        return f"k and v must both be [{B}, Hkv, L, {D}], got {tuple(k_shape)} and {tuple(v_shape)}"
    if k_shape[1] == 0 or H % k_shape[1]:
        return f"{H} query heads over {k_shape[1]} key heads (q's heads must be a multiple of k's)"
    target = (B, H, T, k_shape[2])
    if mask_shape is not None:
        if not (mask_dtype == torch.bool or mask_dtype.is_floating_point):
            return f"mask dtype {mask_dtype} (bool or float only)"
        try:
            ok = tuple(torch.broadcast_shapes(tuple(mask_shape), target)) == target
        except RuntimeError:
            ok = False
        if not ok:
            return f"mask {tuple(mask_shape)} does not broadcast to {target}"
    if kv_len_shape is not None:
        n = math.prod(kv_len_shape)
        if kv_len_dtype not in (torch.int32, torch.int64) or n not in (1, B):
            return (f"kv_len must be an int32/int64 tensor of 1 or {B} values, got {kv_len_dtype} "
                    f"{tuple(kv_len_shape)}")
    return None


def decode_shape(q_shape, k_shape) -> bool:
    """A decode step's attention: at most MAX_TQ query positions, fewer than the keys."""
    return len(q_shape) == 4 and len(k_shape) == 4 and q_shape[2] <= MAX_TQ and q_shape[2] < k_shape[2]


def kernel_problem(q_shape, k_shape, dtype) -> str | None:
    """None when the Triton kernels cover these shapes and dtype (else the CUDA op runs the
    reference), else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (bf16 and fp16 only)"
    B, H, T, D = q_shape
    if D < 16 or D > 256 or D % 8:
        return f"head dim {D} (16-256, a multiple of 8)"
    if T > MAX_TQ:
        return f"{T} query positions (at most {MAX_TQ})"
    if H // k_shape[1] * T > MAX_ROWS:
        return f"{H // k_shape[1]} query heads per key head x {T} positions > {MAX_ROWS} rows per program"
    return None


# ------------------------------------------------------------------------------- the launch plan

def blocks(group_rows: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) for ``group_rows`` query rows per program and head dim D."""
    bd = max(16, next_pow2(D))
    return max(16, next_pow2(group_rows)), (64 if bd <= 128 else 32), bd


def num_splits(B: int, Hkv: int, L: int, block_n: int, sms: int = SM_COUNT) -> int:
    """Splits of the key length: enough programs (B * Hkv * splits) to give every SM one, each
    split at least one key block; 1 when B * Hkv programs already fill the device."""
    programs = B * Hkv
    if programs >= sms or L <= 0:
        return 1
    most = max(1, -(-L // block_n))
    return int(max(1, min(-(-sms // programs), most, MAX_SPLITS)))


def plan(q_shape, k_shape, sms: int = SM_COUNT) -> dict:
    """The launch of one call: blocks, splits and the fp32 workspace (elements) it needs."""
    B, H, T, D = (int(x) for x in q_shape)
    Hkv, L = int(k_shape[1]), int(k_shape[2])
    bm, bn, bd = blocks(H // Hkv * T, D)
    s = num_splits(B, Hkv, L, bn, sms)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, "splits": s, "fused": combine_fused(H // Hkv * T, s, D),
            "workspace": 0 if s == 1 else B * H * T * s * (D + 2)}


def combine_fused(group_rows: int, splits: int, D: int) -> bool:
    """Whether the last split of each key/value head combines the splits itself (one kernel): only
    while that one program reads at most 2 * COMBINE_ELEMENTS fp32 partial outputs. More, and the
    combine kernel's one program per query row is faster (H200, GLM-4's 16 query heads per key
    head at 32 splits: 12.5 us a call fused against about 6 in two kernels)."""
    return splits > 1 and max(2, next_pow2(group_rows)) * max(2, next_pow2(splits)) * next_pow2(D) <= 2 * COMBINE_ELEMENTS


def cost(q_shape, k_shape, itemsize: int, mask_bytes: float, kv_len_bytes: float, sms: int = SM_COUNT):
    """(flops, bytes, launches) of one call with the whole cache read (kv_len, a run-time value,
    can only lower it): q, K, V, the mask and kv_len read once, the output written, and with
    several splits the fp32 partial outputs written by the first kernel and read by the second."""
    B, H, T, D = (int(x) for x in q_shape)
    Hkv, L = int(k_shape[1]), int(k_shape[2])
    p = plan(q_shape, k_shape, sms)
    flops = 4 * B * H * T * L * D
    nbytes = (2 * B * H * T * D + 2 * B * Hkv * L * D) * itemsize + mask_bytes + kv_len_bytes
    nbytes += 2 * 4 * p["workspace"]
    return flops, nbytes, 1 if p["splits"] == 1 or p["fused"] else 2


# ---------------------------------------------------------------------------------- the kernels

def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def decode_split_kernel(Q, K, V, M, KVLEN, O, OP, ML, CNT, scale,
                            sqb, sqh, sqt, sqd, skb, skh, skn, svb, svh, svn,
                            smb, smh, smt, smn, sob, soh, sot, sod, klb,
                            H, HKV, GROUP, TQ, L, D, SPLITS,
                            HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_KVLEN: tl.constexpr,
                            SINGLE: tl.constexpr, FUSED: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, COMB_M: tl.constexpr,
                            BLOCK_S: tl.constexpr, COMB_D: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        split = tl.program_id(0)
        bk = tl.program_id(1)
        b = (bk // HKV).to(tl.int64)
        hk = (bk % HKV).to(tl.int64)
        r = tl.arange(0, BLOCK_M)
        row_ok = r < GROUP * TQ
        h = hk * GROUP + r // TQ          # the query head of each row
        t = r % TQ                          # its query position
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        q = tl.load(Q + b * sqb + h[:, None] * sqh + t[:, None] * sqt + rd[None, :] * sqd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        n = L
        if HAS_KVLEN:
            n = tl.minimum(tl.maximum(tl.load(KVLEN + b * klb).to(tl.int32), 0), L)
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, n)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kbase = K + b * skb + hk * skh
        vbase = V + b * svb + hk * svh
        for j0 in range(start, end, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            col_ok = cols < end
            kv_ok = col_ok[:, None] & d_ok[None, :]
            # K, V and the mask are loaded before any of them is used: the three reads are in flight
            # together (a split is one or two key blocks, so their latency is most of its time)
            k = tl.load(kbase + cols[:, None].to(tl.int64) * skn + rd[None, :], mask=kv_ok, other=0.0)
            v = tl.load(vbase + cols[:, None].to(tl.int64) * svn + rd[None, :], mask=kv_ok, other=0.0)
            keep = row_ok[:, None] & col_ok[None, :]
            if HAS_MASK:
                mk = tl.load(M + b * smb + h[:, None] * smh + t[:, None] * smt + cols[None, :].to(tl.int64) * smn,
                             mask=keep, other=0)
            s = tl.dot(q, tl.trans(k)) * scale
            if HAS_MASK:
                if MASK_BOOL:
                    keep = keep & (mk != 0)
                else:
                    s = s + mk.to(tl.float32)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            p = tl.where(keep, p, 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SINGLE:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + b * sob + h[:, None] * soh + t[:, None] * sot + rd[None, :] * sod,
                     o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            row = (b * H + h) * TQ + t    # the query row's index in the workspace
            part = row * SPLITS + split
            tl.store(OP + part[:, None] * D + rd[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(ML + part * 2, m_i, mask=row_ok)
            tl.store(ML + part * 2 + 1, l_i, mask=row_ok)
            if FUSED:
                # the last split of this (batch row, key/value head) to finish combines all of them:
                # every thread's stores are made visible at GPU scope before the count goes up
                if FENCE:   # (the interpreter runs programs one after another and has no PTX)
                    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 0;", "=r,r", [bk.to(tl.int32)],
                                              dtype=tl.int32, is_pure=False, pack=1)
                tl.debug_barrier()
                done = tl.atomic_add(CNT + bk, 1, sem="acq_rel", scope="gpu")
                if done == SPLITS - 1:
                    cr = tl.arange(0, COMB_M)
                    cs = tl.arange(0, BLOCK_S)
                    c_ok = (cr < GROUP * TQ)[:, None] & (cs < SPLITS)[None, :]
                    ch = hk * GROUP + cr // TQ
                    ct = cr % TQ
                    crow = (b * H + ch) * TQ + ct
                    cpart = crow[:, None] * SPLITS + cs[None, :]
                    m = tl.load(ML + cpart * 2, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
                    lsum = tl.load(ML + cpart * 2 + 1, mask=c_ok, other=0.0, cache_modifier=".cg")
                    mx = tl.max(m, 1)
                    mx = tl.where(mx == float("-inf"), 0.0, mx)
                    w = tl.exp(m - mx[:, None])
                    den = tl.sum(w * lsum, 1)
                    den = tl.where(den > 0, den, 1.0)
                    for d0 in tl.static_range(0, BLOCK_D, COMB_D):
                        cd = d0 + tl.arange(0, COMB_D)
                        cd_ok = cd < D
                        a = tl.load(OP + cpart[:, :, None] * D + cd[None, None, :],
                                    mask=c_ok[:, :, None] & cd_ok[None, None, :], other=0.0, cache_modifier=".cg")
                        o = tl.sum(a * w[:, :, None], 1) / den[:, None]
                        tl.store(O + b * sob + ch[:, None] * soh + ct[:, None] * sot + cd[None, :] * sod,
                                 o.to(O.dtype.element_ty), mask=(cr < GROUP * TQ)[:, None] & cd_ok[None, :])
                    tl.store(CNT + bk, 0)   # ready for the next call (a replayed CUDA graph reuses it)

    @triton.jit
    def decode_combine_kernel(OP, ML, O, sob, soh, sot, sod, H, TQ, D, SPLITS,
                              BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        t = row % TQ
        bh = row // TQ
        h = bh % H
        b = bh // H
        rs = tl.arange(0, BLOCK_S)
        rd = tl.arange(0, BLOCK_D)
        s_ok = rs < SPLITS
        d_ok = rd < D
        part = row * SPLITS + rs
        m = tl.load(ML + part * 2, mask=s_ok, other=float("-inf"))
        lsum = tl.load(ML + part * 2 + 1, mask=s_ok, other=0.0)
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp(m - mx)                  # a split that saw no key: exp(-inf) = 0
        den = tl.sum(w * lsum, 0)
        acc = tl.load(OP + part[:, None] * D + rd[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
        tl.store(O + b * sob + h * soh + t * sot + rd * sod, o.to(O.dtype.element_ty), mask=d_ok)

    return decode_split_kernel, decode_combine_kernel


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            kv_len: torch.Tensor | None, scale: float, splits: int | None = None,
                            num_warps: int = 4, num_stages: int | None = None,
                            fused_combine: bool = True) -> torch.Tensor:
    """The launch (``splits``: the number of key splits; default from :func:`plan` with this
    device's SM count; ``num_warps``/``num_stages`` of the first kernel, for tuning). With several
    splits and ``fused_combine`` the last split of each key/value head to finish combines them
    (one kernel); else a second kernel does. K and V need a unit stride along the head dim (else
    they are copied)."""
    import triton

    why = kernel_problem(tuple(q.shape), tuple(k.shape), q.dtype)
    if why is not None:
        raise ValueError(f"graphopt::decode_attention: {why}")
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if k.stride(3) != 1:
        k = k.contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    out = output_layout(q)
    if out.numel() == 0:
        return out
    cuda = q.device.type == "cuda"
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if cuda else SM_COUNT
    p = plan(q.shape, k.shape, sms)
    s = int(splits) if splits is not None else p["splits"]
    if not 1 <= s <= MAX_SPLITS:
        raise ValueError(f"graphopt::decode_attention: splits {s} outside 1..{MAX_SPLITS}")
    ms = mask.expand(B, H, T, L).stride() if mask is not None else (0, 0, 0, 0)
    if kv_len is not None:
        kv_len = kv_len.reshape(-1)
        klb = 0 if kv_len.numel() == 1 else kv_len.stride(0)
    else:
        klb = 0
    split_k, combine = _kernel()
    group_rows = H // Hkv * T
    comb_m, block_s = max(2, next_pow2(group_rows)), max(2, next_pow2(s))
    fused = fused_combine and combine_fused(group_rows, s, D)
    if s == 1:
        op = ml = out  # unused
    else:
        op = torch.empty((B * H * T * s * D,), dtype=torch.float32, device=q.device)
        ml = torch.empty((B * H * T * s * 2,), dtype=torch.float32, device=q.device)
    cnt = split_counters(q.device, B * Hkv) if fused else out
    comb_d = max(2, min(p["BLOCK_D"], next_pow2(max(1, COMBINE_ELEMENTS // (comb_m * block_s)) + 1) // 2))
    with torch.cuda.device(q.device) if cuda else contextlib.nullcontext():
        split_k[(s, B * Hkv)](
            q, k, v, mask if mask is not None else q, kv_len if kv_len is not None else q, out, op, ml, cnt,
            float(scale),
            *q.stride(), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *ms, *out.stride(), klb,
            H, Hkv, H // Hkv, T, L, D, s,
            HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.bool,
            HAS_KVLEN=kv_len is not None, SINGLE=s == 1, FUSED=fused,
            BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_D=p["BLOCK_D"], COMB_M=comb_m, BLOCK_S=block_s,
            COMB_D=comb_d, FENCE=fence(), num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}), **pdl_launch(q.device))
        if s > 1 and not fused:
            combine[(B * H * T,)](op, ml, out, *out.stride(), H, T, D, s,
                                  BLOCK_S=max(2, next_pow2(s)), BLOCK_D=p["BLOCK_D"], num_warps=4,
                                  **pdl_launch(q.device))
    return out


def cuda_impl(q, k, v, mask, kv_len, scale):
    """The CUDA registration: the Triton kernels where they apply, else the reference."""
    if kernel_problem(tuple(q.shape), tuple(k.shape), q.dtype) is not None:  # fp32, wide groups: correct, slower
        return reference(q, k, v, mask, kv_len, scale)
    return decode_attention_triton(q, k, v, mask, kv_len, scale)


def check(q, k, v, mask, kv_len) -> str | None:
    """The wrapper's argument check on real tensors (None: fine)."""
    why = argument_problem(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
                           None if mask is None else tuple(mask.shape), None if mask is None else mask.dtype,
                           None if kv_len is None else tuple(kv_len.shape), None if kv_len is None else kv_len.dtype)
    if why is None and kv_len is not None and kv_len.device != q.device:
        why = f"kv_len is on {kv_len.device}, q on {q.device}"
    if why is None and mask is not None and mask.device != q.device:
        why = f"mask is on {mask.device}, q on {q.device}"
    return why
