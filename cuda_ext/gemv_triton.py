"""``graphopt::gemv`` in Triton: ``x @ W.T (+ b)`` for a few rows of x (a decode step's tokens),
split along K so that a projection with few output columns still gives every SM work.

A decode step reads every weight once for 1-32 tokens: the GEMMs are weight streams. Each
program here owns ``BLOCK_N`` output columns and one of ``splits`` slices of K; it streams its
``[BLOCK_N, K / splits]`` block of W through shared memory (``num_stages`` loads in flight, the
loads Triton pipelines because they feed ``tl.dot``) and multiplies it with x padded to 16 rows
(tensor cores; the padding costs no bandwidth). With one split it adds the bias and stores y;
with several it stores fp32 partial sums ``[splits, M, N]`` and a second kernel adds them (and the
bias) and rounds once. The swiglu form (``graphopt::gemv_swiglu``) streams a gate and an up
weight in the same programs, half the rows from each, and applies ``silu(gate) * up`` where the
result is rounded (in the reduce kernel when K is split). :func:`plan` picks the blocks and the
split count from the shape and the SM count; the diagnostic ``benchmarks/diag/diag_decode_gemm.py``
times it against cuBLAS.
"""
from __future__ import annotations

import contextlib

import torch

from .norm_triton import cached_kernel, next_pow2, pdl_launch

_kernels: dict = {}
DTYPES = (torch.float16, torch.bfloat16)
MAX_M = 16        # rows of x one call takes (x is padded to 16 rows for tl.dot)
SM_COUNT = 132    # the H200's, for planning without a device
NORM_ONE_BLOCK = 1 << 15  # partial sums (splits x row) gemv_add_rms_norm's second kernel holds at once


def plan(M: int, N: int, K: int, sms: int = SM_COUNT, block_n: int | None = None, block_k: int | None = None,
         splits: int | None = None, stages: int | None = None) -> dict:
    """The launch of one call: BLOCK_N, BLOCK_K, the K splits (each a whole number of BLOCK_K
    blocks), num_stages and num_warps. Default: 64 output columns per program; where those alone
    give every SM two programs or more (a wide projection: a merged gate/up), no split and 256-deep
    K blocks; else 128-deep K blocks and enough splits for about two programs per SM (at most 32,
    each slice at least four K blocks deep). Three stages in flight. The fastest choices per
    decode projection on the H200 (benchmarks/diag/diag_gemv_waves.py)."""
    bn = block_n or 64
    tiles = -(-N // bn)
    wide = tiles >= 2 * sms
    bk = block_k or (256 if wide and splits in (None, 1) else 128)
    blocks = -(-K // bk)
    if splits is None:
        splits = 1 if wide else max(1, min(-(-2 * sms // tiles), blocks // 4, 32))
    splits = max(1, min(int(splits), blocks))
    per = -(-blocks // splits) * bk  # K per split, whole blocks
    splits = -(-K // per)
    return {"BLOCK_N": bn, "BLOCK_K": bk, "splits": splits, "k_per_split": per,
            "num_stages": stages or 3, "num_warps": 4, "programs": tiles * splits}


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def gemv_split_kernel(X, W, WU, BIAS, Y, P, M, N, K, K_PER, sxm, sxk, swn, swk, sun, suk, sym, syn,
                          HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
        # SWIGLU: BLOCK_N rows of W (the gate's) and the same rows of WU (the up's) per program, two
        # accumulators; unsplit it stores silu(g) * u, split both partial sums ([splits, M, 2N]: the
        # gate's N columns, then the up's)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        k_start = pid_k * K_PER
        k_end = tl.minimum(k_start + K_PER, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < k_end
            x = tl.load(X + rm[:, None] * sxm + rk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + rn[:, None].to(tl.int64) * swn + rk[None, :] * swk, mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
            if SWIGLU:
                wu = tl.load(WU + rn[:, None].to(tl.int64) * sun + rk[None, :] * suk,
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_u += tl.dot(x, tl.trans(wu))
        out_ok = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            width = 2 * N if SWIGLU else N
            row = (pid_k * M + rm[:, None]).to(tl.int64) * width
            tl.store(P + row + rn[None, :], acc, mask=out_ok)
            if SWIGLU:
                tl.store(P + row + N + rn[None, :], acc_u, mask=out_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_u
            tl.store(Y + rm[:, None] * sym + rn[None, :] * syn, acc.to(Y.dtype.element_ty), mask=out_ok)

    @triton.jit
    def gemv_reduce_kernel(P, BIAS, Y, M, N, SPLITS, sym, syn, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_S)
        n_ok = rn < N
        ok = (rs < SPLITS)[:, None] & n_ok[None, :]
        row = (rs[:, None] * M + m).to(tl.int64) * (2 * N if SWIGLU else N)
        acc = tl.sum(tl.load(P + row + rn[None, :], mask=ok, other=0.0), 0)
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)
        if SWIGLU:
            u = tl.sum(tl.load(P + row + N + rn[None, :], mask=ok, other=0.0), 0)
            acc = acc / (1.0 + tl.exp(-acc)) * u
        tl.store(Y + m * sym + rn * syn, acc.to(Y.dtype.element_ty), mask=n_ok)

    @triton.jit
    def gemv_norm_kernel(P, BIAS, R, NW, PW, OUT, H, M, N, SPLITS, eps, pre_eps, srm, srn, som, son, shm, shn,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PRE: tl.constexpr, ONE_BLOCK: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        # one program per row of y: the partial sums added (and the bias), rounded as the linear's
        # output; with PRE, y RMS-normalized times PW first (a sandwich norm's first norm); h = y +
        # residual rounded and stored; then the row's RMSNorm of h times the weight NW.
        # ONE_BLOCK (the row fits one block): one pass, every load issued at once, h kept in registers;
        # else a second pass reads back the h the first stored (with PRE, a pass before it normalizes
        # the y the first stored in h's place).
        m = tl.program_id(0)
        rs = tl.arange(0, BLOCK_S)
        s_ok = rs < SPLITS
        if ONE_BLOCK:  # the norm weights' loads in flight with the partial sums'
            w = tl.load(NW + tl.arange(0, BLOCK_N), mask=tl.arange(0, BLOCK_N) < N, other=0.0).to(tl.float32)
            if PRE:
                pw = tl.load(PW + tl.arange(0, BLOCK_N), mask=tl.arange(0, BLOCK_N) < N, other=0.0).to(tl.float32)
        ss = tl.zeros([BLOCK_N], dtype=tl.float32)
        hf = tl.zeros([BLOCK_N], dtype=tl.float32)
        ssy = tl.zeros([BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            part = tl.load(P + ((rs[:, None] * M + m).to(tl.int64) * N + rn[None, :]),
                           mask=s_ok[:, None] & n_ok[None, :], other=0.0)
            y = tl.sum(part, 0)
            if HAS_BIAS:
                y += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)
            y = y.to(H.dtype.element_ty).to(tl.float32)
            if PRE and ONE_BLOCK:  # the whole row is here: its first norm now
                rstd_y = tl.rsqrt(tl.sum(tl.where(n_ok, y * y, 0.0), 0) / N + pre_eps)
                y = (pw * (y * rstd_y).to(H.dtype.element_ty).to(tl.float32)).to(H.dtype.element_ty).to(tl.float32)
            if PRE and not ONE_BLOCK:  # stored in h's place until the row's statistics are known
                tl.store(H + m * shm + rn * shn, y.to(H.dtype.element_ty), mask=n_ok)
                ssy += tl.where(n_ok, y * y, 0.0)
            else:
                if HAS_RES:
                    y += tl.load(R + m * srm + rn * srn, mask=n_ok, other=0.0).to(tl.float32)
                h = y.to(H.dtype.element_ty)
                tl.store(H + m * shm + rn * shn, h, mask=n_ok)
                hf = tl.where(n_ok, h.to(tl.float32), 0.0)
                ss += hf * hf
        if PRE and not ONE_BLOCK:
            rstd_y = tl.rsqrt(tl.sum(ssy, 0) / N + pre_eps)
            tl.debug_barrier()  # the y this program stored, read back by other threads of it
            for n0 in range(0, N, BLOCK_N):
                rn = n0 + tl.arange(0, BLOCK_N)
                n_ok = rn < N
                y = tl.load(H + m * shm + rn * shn, mask=n_ok, other=0.0).to(tl.float32)
                pwb = tl.load(PW + rn, mask=n_ok, other=0.0).to(tl.float32)
                y = (pwb * (y * rstd_y).to(H.dtype.element_ty).to(tl.float32)).to(H.dtype.element_ty).to(tl.float32)
                if HAS_RES:
                    y += tl.load(R + m * srm + rn * srn, mask=n_ok, other=0.0).to(tl.float32)
                h = y.to(H.dtype.element_ty)
                tl.debug_barrier()  # every thread has read its y before h overwrites it
                tl.store(H + m * shm + rn * shn, h, mask=n_ok)
                hf = tl.where(n_ok, h.to(tl.float32), 0.0)
                ss += hf * hf
        rstd = tl.rsqrt(tl.sum(ss, 0) / N + eps)
        if ONE_BLOCK:  # h is still in registers
            rn = tl.arange(0, BLOCK_N)
            normed = (hf * rstd).to(OUT.dtype.element_ty).to(tl.float32)
            tl.store(OUT + m * som + rn * son, (w * normed).to(OUT.dtype.element_ty), mask=rn < N)
        else:
            tl.debug_barrier()  # the h this program stored, read back by other threads of it
            for n0 in range(0, N, BLOCK_N):
                rn = n0 + tl.arange(0, BLOCK_N)
                n_ok = rn < N
                hf = tl.load(H + m * shm + rn * shn, mask=n_ok, other=0.0).to(tl.float32)
                normed = (hf * rstd).to(OUT.dtype.element_ty).to(tl.float32)
                wb = tl.load(NW + rn, mask=n_ok, other=0.0).to(tl.float32)
                tl.store(OUT + m * som + rn * son, (wb * normed).to(OUT.dtype.element_ty), mask=n_ok)

    return gemv_split_kernel, gemv_reduce_kernel, gemv_norm_kernel


def _sms(x: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else SM_COUNT


def _stream(x, weight, up_weight, bias, y, p, partial) -> None:
    """The split kernel over ``weight`` (and ``up_weight``: the swiglu form) as ``p`` plans it, into
    ``y`` or, given ``partial``, into fp32 partial sums; the caller holds the device."""
    split = _kernel()[0]
    u = up_weight if up_weight is not None else weight
    N = weight.shape[0]
    split[(-(-N // p["BLOCK_N"]), p["splits"])](
        x, weight, u, bias if bias is not None else x, y, partial if partial is not None else y,
        x.shape[0], N, x.shape[1], p["k_per_split"], x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), u.stride(0), u.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, PARTIAL=partial is not None, SWIGLU=up_weight is not None, BLOCK_M=16,
        BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], STAGES=p["num_stages"], num_warps=p["num_warps"],
        **pdl_launch(x.device))


def _stream_and_reduce(x, weight, up_weight, bias, y, p) -> torch.Tensor:
    """:func:`_stream`, and with several splits the reduce kernel adding the partial sums (the bias,
    the activation) into ``y``."""
    s, (M, N) = p["splits"], y.shape
    width = 2 * N if up_weight is not None else N
    partial = torch.empty((s * M * width,), dtype=torch.float32, device=x.device) if s > 1 else None
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _stream(x, weight, up_weight, bias, y, p, partial)
        if s > 1:
            bn = 256
            _kernel()[1][(M, -(-N // bn))](
                partial, bias if bias is not None else x, y, M, N, s, y.stride(0), y.stride(1),
                HAS_BIAS=bias is not None, SWIGLU=up_weight is not None, BLOCK_S=max(2, next_pow2(s)), BLOCK_N=bn,
                num_warps=4, **pdl_launch(x.device))
    return y


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **config) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K].T (+ bias [N]); ``config``: :func:`plan`'s overrides
    (block_n, block_k, splits, stages)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    return _stream_and_reduce(x, weight, None, bias, y, plan(M, N, K, _sms(x), **config))


def gemv_add_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                             pre_weight: torch.Tensor | None = None, pre_eps: float = 0.0,
                             **config) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = x [M, K] @ weight [N, K].T (+ bias)``, with ``pre_weight`` ``y = rmsnorm(y) * pre_weight``,
    ``h = y + residual [M, N]`` and ``(rmsnorm(h) * norm_weight, h)``: the split kernel always
    writes fp32 partial sums, and the second kernel (one program per row) adds them, the bias and
    the residual and normalizes the row, so the norms cost no launch of their own. ``config``:
    :func:`plan`'s overrides."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out, h
    cuda = x.device.type == "cuda"
    p = plan(M, N, max(K, 1), _sms(x), **config)
    norm = _kernel()[2]
    s = p["splits"]
    partial = (torch.empty if K else torch.zeros)((s * M * N,), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else x
    r = residual if residual is not None else x
    with torch.cuda.device(x.device) if cuda else contextlib.nullcontext():
        if K:
            _stream(x, weight, None, None, out, p, partial)
        bs = max(2, next_pow2(s))
        one = bs * next_pow2(N) <= NORM_ONE_BLOCK  # the whole row's partial sums in one program's registers
        bn = next_pow2(N) if one else max(16, min(next_pow2(N), max(256, 16384 // bs)))
        norm[(M,)](partial, b, r, norm_weight, pre_weight if pre_weight is not None else norm_weight, out, h, M, N, s,
                   float(eps), float(pre_eps),
                   r.stride(0) if residual is not None else 0, r.stride(1) if residual is not None else 0,
                   out.stride(0), out.stride(1), h.stride(0), h.stride(1),
                   HAS_BIAS=bias is not None, HAS_RES=residual is not None, PRE=pre_weight is not None,
                   ONE_BLOCK=one, BLOCK_S=bs, BLOCK_N=bn,
                   num_warps=16 if one else 8, **pdl_launch(x.device))
    return out, h


def plan_swiglu(M: int, N: int, K: int, sms: int = SM_COUNT, **config) -> dict:
    """The launch of one :func:`gemv_swiglu_triton` call (N: the gate's and the up's columns each):
    :func:`plan` for the ``[2N, K]`` pair, each program holding half its ``BLOCK_N`` weight rows from
    the gate and half from the up weight, so a program streams as many weight bytes as a plain
    GEMV's and the grid is the same."""
    p = plan(M, 2 * N, K, sms, **config)  # block_n: gate and up rows together
    p["BLOCK_N"] //= 2
    p["programs"] = -(-N // p["BLOCK_N"]) * p["splits"]
    return p


def gemv_swiglu_triton(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, **config) -> torch.Tensor:
    """``silu(x [M, K] @ w_gate [N, K].T) * (x @ w_up [N, K].T)`` [M, N], the products in fp32 and
    rounded once after the activation; ``config``: :func:`plan`'s overrides (``block_n``: gate and
    up rows together)."""
    M, K = x.shape
    N = w_gate.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    return _stream_and_reduce(x, w_gate, w_up, None, y, plan_swiglu(M, N, K, _sms(x), **config))
