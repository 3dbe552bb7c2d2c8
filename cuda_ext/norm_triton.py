"""CUDA implementation of ``graphopt::layer_norm`` in Triton: many rows per program.

aten's LayerNorm kernel (and graphopt's ``add_layer_norm``) give each row its own thread block,
which is the right shape for transformer hidden sizes (768-4096) but leaves small rows bound by
block scheduling: ConvNeXt-T's 96-768-wide rows ran at about a tenth of the copy bandwidth on
the H200 (benchmarks/results/profile_convnext_tiny_bs64.md). Here one program normalizes
``ROWS`` rows at once as a [ROWS, BLOCK_H] tile (fp32 statistics, two-pass over registers, one
rounding at the store), so a program always moves ~8K elements whatever the row width.

The same kernel is the norm half of ``graphopt::linear_add_layer_norm``: it first sums the fp32
partial products of a projection split along K (plus its bias and the residual), rounds h once
and normalizes it. The file also holds the sandwich norm (``rms_norm_add_rms_norm``).
"""
from __future__ import annotations

import contextlib
import os

import torch

_kernels: dict = {}
MAX_HIDDEN = 8192
_capability: dict = {}


def pdl(device: torch.device) -> bool:
    """Whether graphopt's Triton kernels on ``device`` use programmatic dependent launch: a Hopper
    or newer GPU, not the Triton interpreter, and ``GRAPHOPT_PDL`` not "0". Such a kernel is
    launched while the kernel before it still runs; each of its programs first waits
    (``griddepcontrol.wait``) until that kernel has finished and its writes are visible, and only
    then lets the next kernel launch, so nothing a kernel reads or writes can race with the
    kernels before it. What overlaps is the launch and the programs' start."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" \
            or os.environ.get("GRAPHOPT_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capability:
        _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[index][0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of a kernel that takes ``PDL: tl.constexpr`` (see :func:`pdl`)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


_counters: dict = {}
_counters_kept: list = []


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters for ``device``, kept for the process, for
    kernels whose last program of a group to finish combines the group's partial results (the
    decode attention's key splits): that program puts its counter back to zero, so calls (and
    CUDA-graph replays) share the buffer. Calls on one device run in stream order (a PDL kernel
    touches counters only after its wait for the one before); a call on a second stream concurrently
    with another would share counters, which graphopt's graphs never do. A buffer outgrown stays
    allocated: a CUDA graph captured with it keeps its address. Under a fake tensor mode (graphopt's
    kernel precompilation runs a dispatch on fake tensors) the buffer is a fake one, never kept."""
    from torch._subclasses.fake_tensor import is_fake

    key = (device.type, device.index)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        fresh = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
        if is_fake(fresh):
            return fresh
        if buf is not None:
            _counters_kept.append(buf)
        buf = _counters[key] = fresh
    return buf


def fence() -> bool:
    """Whether a kernel's GPU-scope fence (inline PTX) is emitted: not under Triton's interpreter,
    which runs programs one after another and has no PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def cached_kernel(kernels: dict, build):
    """``build()`` (which defines a ``@triton.jit`` function) once per TRITON_INTERPRET setting:
    the interpreter must be chosen before a kernel is defined, and the tests switch it."""
    key = os.environ.get("TRITON_INTERPRET", "0")
    if key not in kernels:
        kernels[key] = build()
    return kernels[key]


def _kernel():
    return cached_kernel(_kernels, _build)


def row_vec(H: int, itemsize: int) -> int:
    """The largest power of two dividing the row width ``H``, up to one 16-byte access of ``itemsize``-byte
    elements: ln_rows_kernel's compile-time VEC (the width is passed as H // VEC)."""
    v = 1
    while H % (2 * v) == 0 and 2 * v * itemsize <= 16:
        v *= 2
    return v


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def ln_rows_kernel(P, PS, BIAS, X, W, B, OUT, HOUT, R, HV, eps, S: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_X: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_H: tl.constexpr,
                       VEC: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        # OUT = layer_norm(h) over rows of H, h = the S fp32 partial products at P (PS apart) + BIAS + X,
        # rounded to OUT's dtype once (stored to HOUT with STORE_H). A plain LayerNorm is S = 0 with X its
        # input (rounding X to its own dtype changes nothing). The row width is H = HV * VEC, VEC a
        # compile-time power of two (row_vec): a row then starts as aligned as VEC elements make it, and the
        # accesses vectorize to that alignment, while widths with the same VEC and block share the kernel.
        H = HV * VEC
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        mask = (rows < R)[:, None] & cmask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(S):  # the S partial products of K's slices, fp32
            acc += tl.load(P + s * PS + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_X:
            acc += tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        h = acc.to(OUT.dtype.element_ty)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        mean = tl.sum(hf, axis=1) / H
        d = tl.where(mask, hf - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1) / H
        y = d * (1.0 / tl.sqrt(var + eps))[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=1.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if STORE_H:
            tl.store(HOUT + offs, h, mask=mask)
        tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=mask)

    return ln_rows_kernel


_sandwich_kernels: dict = {}


def _build_sandwich():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def rms_add_rms_kernel(Y, RES, WY, W, OUT, HOUT, R, H, eps_y, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                           PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
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
                                   num_warps=warps, **pdl_launch(y.device))
    return out, h


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
    """layer_norm over the last dim of x (made contiguous explicitly), fp32 statistics."""
    return _rows(x, None, weight, bias, eps, "layer_norm", store_h=False)[0]


def rows_cost(cost, width, itemsize, profile):
    """``cost`` (one pass over the bytes) of the many-rows kernel over rows ``width`` wide, slowed where
    a row's bytes are not a multiple of 16: the kernel compiles the width in, so its loads and stores
    are 128-bit where every row starts 16-byte aligned and narrower where not
    (benchmarks/diag/diag_ln_rows_ptx.py), priced at the profile's measured
    ``op_efficiency["ln_rows_unaligned"]["memory_scale"]`` of the copy rate."""
    import dataclasses

    scale = profile.efficiency("ln_rows_unaligned", "memory_scale")
    try:
        aligned = int(width) * itemsize % 16 == 0
    except TypeError:  # a symbolic width
        return cost
    if aligned or scale is None or profile.kind != "cuda":
        return cost
    return dataclasses.replace(cost, slowdown=cost.slowdown / scale)


def add_layer_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (one rounding to x's dtype), ``(layer_norm(h), h)`` over the last dim:
    the many-rows kernel with x as its one fp32-summed operand and the residual as its second
    (inputs made contiguous explicitly; a residual that broadcasts is expanded)."""
    return _rows(x, residual, weight, bias, eps, "add_layer_norm_rows", store_h=True)


def _rows(x, residual, weight, bias, eps: float, op: str, store_h: bool):
    """The many-rows kernel over x's last dim: (out, h) with h stored where ``store_h`` (a plain
    LayerNorm reads x as its one operand and stores no h: S = 0, X = x)."""
    import triton

    H = x.shape[-1] if x.dim() else 1
    if H > MAX_HIDDEN:
        raise ValueError(f"graphopt::{op}: hidden size {H} > {MAX_HIDDEN} (use add_layer_norm)")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    h = torch.empty_like(xc) if store_h else out
    R = xc.numel() // H if H else 0
    if R == 0 or H == 0:
        return out, h
    res = residual.to(x.dtype).expand(x.shape).contiguous() if residual is not None else None
    w = weight.to(x.device).contiguous() if weight is not None else None
    b = bias.to(x.device).contiguous() if bias is not None else None
    bh = next_pow2(H)
    rows = max(1, min(128, 8192 // bh))
    warps = 4 if bh * rows <= 4096 else 8
    # with store_h, x is the summed operand (S = 1) and the residual the second; else x is X
    S, X = (1, res) if store_h else (0, xc)
    k = _kernel()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        v = row_vec(H, x.element_size())
        k[(triton.cdiv(R, rows),)](xc, 0, xc, X if X is not None else xc, w if w is not None else xc,
                                   b if b is not None else xc, out, h, R, H // v, float(eps), S=S, HAS_BIAS=False,
                                   HAS_X=X is not None, HAS_W=w is not None, HAS_B=b is not None, STORE_H=store_h,
                                   VEC=v, ROWS=rows, BLOCK_H=bh, num_warps=warps)
    return out, h


SPLIT_K_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def split_k_supported(x: torch.Tensor, weight: torch.Tensor, splits: int) -> str | None:
    """None when :func:`linear_add_layer_norm_triton` takes these operands, else why not."""
    if x.dtype not in SPLIT_K_DTYPES or weight.dtype != x.dtype:
        return f"dtypes {x.dtype}/{weight.dtype} (float16, bfloat16 or float32, the same for x and weight)"
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return f"shapes {tuple(x.shape)} and {tuple(weight.shape)} (x [..., K], weight [N, K])"
    if splits < 1 or x.shape[-1] % splits:
        return f"{splits} slices do not divide K={x.shape[-1]}"
    if weight.shape[0] > MAX_HIDDEN:
        return f"rows wider than {MAX_HIDDEN}"
    return None


def linear_add_layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 residual: torch.Tensor | None, ln_weight: torch.Tensor | None,
                                 ln_bias: torch.Tensor | None, eps: float, splits: int):
    """``graphopt::linear_add_layer_norm`` (see reference.linear_add_layer_norm) as two kernels:
    one batched GEMM over ``splits`` slices of K writing fp32 partial products ([S, M, N]: S times
    the output tiles of a small-M projection, where cuBLAS would otherwise add its own split-K
    reduction kernel), then one Triton kernel that sums them with the bias and the residual,
    rounds h once and normalizes it."""
    import triton

    why = split_k_supported(x, weight, splits)
    if why is not None:
        raise ValueError(f"graphopt::linear_add_layer_norm: unsupported {why}")
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != K):
        x2 = x2.contiguous()
    M = x2.shape[0]
    w = weight.contiguous()
    xs = x2.view(M, splits, K // splits).transpose(0, 1)  # [S, M, K/S]: strided views, no copy
    ws = w.view(N, splits, K // splits).permute(1, 2, 0)  # [S, K/S, N]
    if x.dtype == torch.float32 or x.device.type != "cuda":  # bmm's out_dtype is CUDA-only (the interpreter's tests)
        parts = torch.bmm(xs.float(), ws.float())
    else:
        parts = torch.bmm(xs, ws, out_dtype=torch.float32)
    shape = (*x.shape[:-1], N)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(out)
    if M == 0 or N == 0:
        return out, h
    res = residual.to(x.dtype).expand(shape).contiguous() if residual is not None else None
    vec = [t.to(x.device).contiguous() if t is not None else None for t in (bias, ln_weight, ln_bias)]
    bh = next_pow2(N)
    rows = max(1, min(64, 2048 // bh))
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 1
    while rows > 1 and triton.cdiv(M, rows) < sms:  # a small M (the case this op is for): a program per SM or more
        rows //= 2
    warps = 8 if bh * rows >= 4096 else 4
    k = _kernel()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        b, lw, lb = (t if t is not None else parts for t in vec)  # an absent operand: any pointer, never read
        v = row_vec(N, x.element_size())
        k[(triton.cdiv(M, rows),)](parts, M * N, b, res if res is not None else parts, lw, lb, out, h, M, N // v,
                                   float(eps), S=splits, HAS_BIAS=vec[0] is not None, HAS_X=res is not None,
                                   HAS_W=vec[1] is not None, HAS_B=vec[2] is not None, STORE_H=True, VEC=v, ROWS=rows,
                                   BLOCK_H=bh, num_warps=warps)
    return out, h


_bwd_kernels: dict = {}


def _build_backward():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_bwd_kernel(G, H, W, EXTRA, DH, WB, R, N, eps, iters, HAS_W: tl.constexpr, HAS_EXTRA: tl.constexpr,
                        WEIGHT_GRADS: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        # dh = the gradient of layer_norm(h) * W (RMS: W * rms_norm(h)) (+ EXTRA) over rows of H for the
        # output gradient G; the program's rows' sums of G * xhat (RMS: xhat rounded to h's dtype, as the
        # model multiplies it) and of G go to WB[pid, 0, :] and WB[pid, 1, :] (fp32), summed over programs
        # afterwards. Statistics recomputed from h in fp32; ``iters`` tiles of ROWS rows a program.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)  # summed over the rows once, after the loop
        db = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for i in range(iters):
            rows = (pid.to(tl.int64) * iters + i) * ROWS + tl.arange(0, ROWS)
            mask = (rows < R)[:, None] & cmask[None, :]
            offs = rows[:, None] * N + cols[None, :]
            h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            if RMS:
                d = h
            else:
                mean = tl.sum(h, axis=1) / N
                d = tl.where(mask, h - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
            xhat = d * rstd[:, None]
            if HAS_W:
                gw = g * w
            else:
                gw = g
            c1 = tl.sum(xhat * gw, axis=1) / N
            dx = gw - xhat * c1[:, None]
            if not RMS:
                dx -= (tl.sum(gw, axis=1) / N)[:, None]
            dx = dx * rstd[:, None]
            if HAS_EXTRA:
                dx += tl.load(EXTRA + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DH + offs, dx.to(DH.dtype.element_ty), mask=mask)
            if WEIGHT_GRADS:
                if RMS:
                    dw += g * xhat.to(DH.dtype.element_ty).to(tl.float32)
                else:
                    dw += g * xhat
                db += g
        if WEIGHT_GRADS:
            tl.store(WB + pid * 2 * N + cols, tl.sum(dw, axis=0), mask=cmask)
            tl.store(WB + pid * 2 * N + N + cols, tl.sum(db, axis=0), mask=cmask)

    return norm_bwd_kernel


def norm_backward_plan(R: int, N: int, sms: int) -> tuple[int, int, int, int]:
    """(rows a tile, tiles a program, programs, warps) of the norm backward over R rows N wide:
    tiles of about 4K elements, at most four programs an SM (each writes one partial row of the
    weight gradients, which are then summed)."""
    import triton

    bh = next_pow2(N)
    rows = max(1, min(32, 4096 // bh))
    tiles = triton.cdiv(R, rows)
    programs = max(1, min(tiles, 4 * sms))
    iters = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, iters)
    warps = 4 if bh * rows <= 2048 else (8 if bh * rows <= 8192 else 16)
    return rows, iters, programs, warps


def norm_backward_triton(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None, extra: torch.Tensor | None,
                         eps: float, weight_grads: bool, rms: bool = False):
    """(dh, wb) of ``layer_norm(h) * weight + bias`` (``rms``: ``weight * rms_norm(h)``, the normalized
    value rounded to h's dtype before the weight) over the last dim (rows up to MAX_HIDDEN wide) for
    the output gradient g: dh in h's dtype (plus ``extra``, a gradient h also gets), wb = [sum of
    g * xhat, sum of g] over the rows in fp32 ([2, N]; empty without ``weight_grads``). One pass over
    g and h; each program keeps its rows' weight-gradient sums in registers."""
    import triton

    N = h.shape[-1] if h.dim() else 1
    if N > MAX_HIDDEN:
        raise ValueError(f"graphopt::fused_norm_backward: hidden size {N} > {MAX_HIDDEN}")
    hc, gc = h.contiguous(), g.to(h.dtype).contiguous()
    ec = extra.to(h.dtype).expand(h.shape).contiguous() if extra is not None else None
    dh = torch.empty_like(hc)
    R = hc.numel() // N if N else 0
    if R == 0 or N == 0:
        wb = torch.zeros((2, N) if weight_grads else (0,), dtype=torch.float32, device=h.device)
        if ec is not None:
            dh.copy_(ec)
        return dh, wb
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.device.type == "cuda" else 2
    rows, iters, programs, warps = norm_backward_plan(R, N, sms)
    parts = torch.empty((programs, 2, N) if weight_grads else (1,), dtype=torch.float32, device=h.device)
    w = weight.to(h.device).contiguous() if weight is not None else None
    k = cached_kernel(_bwd_kernels, _build_backward)
    with torch.cuda.device(h.device) if h.device.type == "cuda" else contextlib.nullcontext():
        k[(programs,)](gc, hc, w if w is not None else hc, ec if ec is not None else hc, dh, parts, R, N, float(eps),
                       iters, HAS_W=w is not None, HAS_EXTRA=ec is not None, WEIGHT_GRADS=weight_grads, RMS=bool(rms),
                       ROWS=rows, BLOCK_H=next_pow2(N), num_warps=warps)
    wb = parts.sum(0) if weight_grads else torch.empty(0, dtype=torch.float32, device=h.device)
    return dh, wb
