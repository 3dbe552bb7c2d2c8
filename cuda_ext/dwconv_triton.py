"""``graphopt::dwconv2d`` in one Triton kernel: a depthwise convolution (one filter per channel) with
its bias, activation and residual add, reading its input and residual through their strides.

A program computes a [BLOCK_P, BLOCK_C] tile of the output: BLOCK_P output pixels (in the order
n, y, x) by BLOCK_C channels. For each of the KH x KW taps it loads the input pixels the tap reads,
BLOCK_C channels each (adjacent in memory where the channels are innermost: one vector load per
pixel), and the tap's BLOCK_C weights (one vector load where the filter is stored tap-major, as
lower_depthwise_conv stores it: [C, 1, kh, kw] with the channels innermost), and accumulates in
fp32; the taps of neighbouring pixels overlap, so after the first tap most loads hit the cache.
Then + bias, the activation, + residual, one rounding at the store. Adjacent programs take the
channel blocks of the same pixels, so they read the same input rows. Kernel size, stride, padding,
dilation and the filter's channel stride are compile-time constants; the image sizes, the channel
count and the filter's tap stride are runtime arguments that Triton does not specialize, so one
compiled kernel serves every image and channel count of a network with the same kernel size,
stride, activation and alignment (a densely connected network's every depthwise convolution has a
channel count of its own). The channel count is passed as C // CA and the tap stride as
SWT // WA, CA and WA compile-time powers of two dividing them (up to one 16-byte access), and the
strides of the input, residual and output (all but the channel strides) carry the largest power of
two up to 8 dividing all of them as an alignment hint, so a channel-innermost tensor whose rows are
16-byte aligned is read and written in 16-byte vectors (a channel slice of a wider tensor included:
CoaT's value heads, read where the qkv projection left them).
"""
from __future__ import annotations

import contextlib
import math

import torch

from .col2im_triton import _span
from .norm_triton import cached_kernel, row_vec

_kernels: dict = {}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 2048  # output elements a program computes
ACT_CODES = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "sigmoid": 5, "tanh": 6, "hardswish": 7}
LEAKY_CODE = 8
# dwconv_kernel's runtime sizes: never specialized (Triton would compile a variant per size divisible by 16, or of 1)
RUNTIME_SIZES = ["CV", "H", "W", "OH", "OW", "NCB", "SWTV"]


def _kernel():
    return cached_kernel(_kernels, _build)


def build_pixel_tile():
    """The jitted helper both tile kernels (this one, upsample_triton's) start with: the [BLOCK_P output pixels x
    BLOCK_C channels] tile this program computes (:func:`tiles`: channel blocks innermost) as its pixel and channel
    indices, their masks, and each pixel's (n, oy, ox)."""
    import triton

    global tl  # Triton's interpreter looks triton.language up in a jitted function's module, here also for
    import triton.language as tl  # a kernel of another module that calls the helper

    @triton.jit
    def pixel_tile(P, C, OH, OW, NCB, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
        # C, OH, OW, NCB: compile-time constants where the caller's are (a call specializes on them), else runtime
        pid = tl.program_id(0)
        if WIDE:
            pid = pid.to(tl.int64)
        p = (pid // NCB) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = (pid % NCB) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = p // OW
        return p, c, p < P, c < C, t // OH, t % OH, p % OW

    return pixel_tile


def _build():
    import triton
    import triton.language as tl

    global pixel_tile  # a jitted helper is looked up in the kernels' module globals
    pixel_tile = build_pixel_tile()

    @triton.jit(do_not_specialize=RUNTIME_SIZES)
    def dwconv_kernel(X, Wt, B, R, OUT, P, slope, CV, H, W, OH, OW, NCB, SWTV,
                      sxn, sxc, sxh, sxw, srn, src, srh, srw, son, soc, soh, sow,
                      SWC: tl.constexpr, CA: tl.constexpr, WA: tl.constexpr,
                      KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                      PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                      HAS_B: tl.constexpr, HAS_R: tl.constexpr, ACT: tl.constexpr,
                      XA: tl.constexpr, RA: tl.constexpr, OA: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
        C = CV * CA  # multiples of the compile-time CA and WA: the channel and tap offsets keep their alignment
        SWT = SWTV * WA
        p, c, pm, cm, n, oy, ox = pixel_tile(P, C, OH, OW, NCB, BLOCK_P, BLOCK_C, WIDE)
        acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        for ki in tl.static_range(KH):
            iy = oy * SH - PH + ki * DH
            oky = pm & (iy >= 0) & (iy < H)
            for kj in tl.static_range(KW):
                ix = ox * SW - PW + kj * DW
                ok = oky & (ix >= 0) & (ix < W)
                off = tl.multiple_of(n * sxn + iy * sxh + ix * sxw, XA)
                v = tl.load(X + off[:, None] + c[None, :] * sxc, mask=ok[:, None] & cm[None, :], other=0.0)
                wv = tl.load(Wt + c * SWC + (ki * KW + kj) * SWT, mask=cm, other=0.0)
                acc += v.to(tl.float32) * wv.to(tl.float32)[None, :]
        if HAS_B:
            acc += tl.load(B + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            acc = tl.where(acc < 0, 0.0, acc)
        elif ACT == 2:
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif ACT == 3:  # tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|): no overflow
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            e = tl.exp(-2.0 * tl.abs(u))
            acc = 0.5 * acc * (1.0 + tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e))
        elif ACT == 4:
            acc = acc / (1.0 + tl.exp(-acc))
        elif ACT == 5:
            acc = 1.0 / (1.0 + tl.exp(-acc))
        elif ACT == 6:
            e = tl.exp(-2.0 * tl.abs(acc))
            acc = tl.where(acc < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        elif ACT == 7:
            acc = acc * tl.minimum(tl.maximum(acc + 3.0, 0.0), 6.0) / 6.0
        elif ACT == 8:
            acc = tl.where(acc < 0, acc * slope, acc)
        m = pm[:, None] & cm[None, :]
        if HAS_R:
            roff = tl.multiple_of(n * srn + oy * srh + ox * srw, RA)
            acc += tl.load(R + roff[:, None] + c[None, :] * src, mask=m, other=0.0).to(tl.float32)
        ooff = tl.multiple_of(n * son + oy * soh + ox * sow, OA)
        tl.store(OUT + ooff[:, None] + c[None, :] * soc, acc.to(OUT.dtype.element_ty), mask=m)

    return dwconv_kernel


def block_c(C: int) -> int:
    """The channel block: the power of two from 16 to 128 that wastes the fewest lanes on C's last
    block (the larger on a tie)."""
    return min((128, 64, 32, 16), key=lambda b: (-(-C // b) * b, -b))


def alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 8 dividing every stride of ``t`` but the channels' (dim 1)."""
    g = 0
    for d, s in enumerate(t.stride()):
        if d != 1 and t.shape[d] > 1:
            g = math.gcd(g, s)
    g = g or 8
    a = 1
    while a < 8 and g % (2 * a) == 0:
        a *= 2
    return a


def tiles(C: int, P: int, *tensors: torch.Tensor) -> tuple[int, int, int, tuple, bool]:
    """(BLOCK_C, BLOCK_P, channel blocks, grid, 64-bit offsets) of a kernel computing [pixels x channels]
    tiles of P output pixels by C channels, one program a tile, reading and writing ``tensors``."""
    import triton

    bc = block_c(C)
    bp = max(1, TILE // bc)
    ncb = triton.cdiv(C, bc)
    grid = (ncb * triton.cdiv(P, bp),)
    wide = max(*(_span(t) for t in tensors), P + bp, grid[0] * bp) >= 2 ** 31
    return bc, bp, ncb, grid, wide


def act_code(act: str) -> tuple[int, float]:
    """(the kernel's activation code, the leaky slope) of one of bias_act's activation names."""
    from .ops.bias_act import leaky_slope

    if act in ACT_CODES:
        return ACT_CODES[act], 0.0
    slope = leaky_slope(act)
    if slope is None:
        raise ValueError(f"graphopt::dwconv2d: unknown activation {act!r}")
    return LEAKY_CODE, slope


def dwconv2d_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                    out: torch.Tensor, stride, padding, dilation, act: str) -> torch.Tensor:
    """``out`` [N, C, OH, OW] (empty, laid out as it will be returned) gets the depthwise convolution of
    x [N, C, H, W] with w [C, 1, KH, KW], + bias, the activation, + residual; arguments as
    ``ops/dwconv2d.py`` checks them."""
    N, C, H, W = x.shape
    _, _, OH, OW = out.shape
    KH, KW = w.shape[2:]
    P = N * OH * OW
    if P == 0 or C == 0:
        return out
    code, slope = act_code(act)
    wc = w.reshape(C, KH * KW)  # a view where it can be: tap-major weights (lower_depthwise_conv's) keep swc = 1
    b = bias.contiguous() if bias is not None else wc
    r = residual.expand(out.shape) if residual is not None else out
    bc, bp, ncb, grid, wide = tiles(C, P, x, out, r)
    k = _kernel()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        ca, wa = row_vec(C, x.element_size()), row_vec(wc.stride(1), wc.element_size())
        k[grid](x, wc, b, r, out, P, float(slope), C // ca, H, W, OH, OW, ncb, wc.stride(1) // wa,
                *x.stride(), *r.stride(), *out.stride(), SWC=wc.stride(0), CA=ca, WA=wa, KH=KH, KW=KW,
                SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1],
                HAS_B=bias is not None, HAS_R=residual is not None, ACT=code, XA=alignment(x), RA=alignment(r),
                OA=alignment(out), BLOCK_P=bp, BLOCK_C=bc, WIDE=wide, num_warps=4)
    return out
