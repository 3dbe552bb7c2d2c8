"""``graphopt::upsample_bilinear2d`` in one Triton kernel: bilinear resampling (up or down) of an image
read through its strides, written in the layout asked for.

aten's CUDA kernel for a channels-innermost input (``upsample_bilinear2d_nhwc_out_frame``) wants it
dense channels_last, so a token view (CoaT's tokens after the class token, seen as an image) is
copied first, and it moves its bytes far below the copy rate. Here a program computes a
[BLOCK_P, BLOCK_C] tile of the output: BLOCK_P output pixels (n, y, x) by BLOCK_C channels; each
pixel's source position and weights are computed once (aten's rule, ``area_pixel_compute_source_index``,
in fp32: ``scale * dst`` with align_corners, else ``max(scale * (dst + 0.5) - 0.5, 0)``, the scale
``1 / scale_factor`` where a factor was given and ``in / out`` otherwise), and its four neighbours
are loaded BLOCK_C channels at a time (a vector load where the channels are innermost). fp32
arithmetic, one rounding at the store. The alignment hint, channel blocks and runtime sizes are dwconv_triton's
(the channel count passed as C // CA; one compiled kernel serves every image and channel count).
"""
from __future__ import annotations

import contextlib

import torch

from .dwconv_triton import alignment, build_pixel_tile, tiles
from .norm_triton import cached_kernel, row_vec

_kernels: dict = {}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# upsample_kernel's runtime sizes: never specialized (one compiled kernel for every image and channel count)
RUNTIME_SIZES = ["CV", "H", "W", "OH", "OW", "NCB"]


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    global pixel_tile  # a jitted helper is looked up in the kernels' module globals
    pixel_tile = build_pixel_tile()

    @triton.jit(do_not_specialize=RUNTIME_SIZES)
    def upsample_kernel(X, OUT, P, rh, rw, CV, H, W, OH, OW, NCB, sxn, sxc, sxh, sxw, son, soc, soh, sow,
                        CA: tl.constexpr, ALIGN_CORNERS: tl.constexpr, XA: tl.constexpr, OA: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
        C = CV * CA  # a multiple of the compile-time CA: the channel offsets keep their alignment
        p, c, pm, cm, n, oy, ox = pixel_tile(P, C, OH, OW, NCB, BLOCK_P, BLOCK_C, WIDE)
        if ALIGN_CORNERS:
            sy = rh * oy.to(tl.float32)
            sx = rw * ox.to(tl.float32)
        else:
            sy = tl.maximum(rh * (oy.to(tl.float32) + 0.5) - 0.5, 0.0)
            sx = tl.maximum(rw * (ox.to(tl.float32) + 0.5) - 0.5, 0.0)
        y0 = tl.minimum(sy.to(tl.int32), H - 1)  # (within the image for any scale a caller passes)
        x0 = tl.minimum(sx.to(tl.int32), W - 1)
        ly = sy - y0.to(tl.float32)
        lx = sx - x0.to(tl.float32)
        y1 = tl.where(y0 < H - 1, y0 + 1, y0)
        x1 = tl.where(x0 < W - 1, x0 + 1, x0)
        m = pm[:, None] & cm[None, :]
        cc = c[None, :] * sxc
        base = n * sxn
        v00 = tl.load(X + tl.multiple_of(base + y0 * sxh + x0 * sxw, XA)[:, None] + cc, mask=m, other=0.0)
        v01 = tl.load(X + tl.multiple_of(base + y0 * sxh + x1 * sxw, XA)[:, None] + cc, mask=m, other=0.0)
        v10 = tl.load(X + tl.multiple_of(base + y1 * sxh + x0 * sxw, XA)[:, None] + cc, mask=m, other=0.0)
        v11 = tl.load(X + tl.multiple_of(base + y1 * sxh + x1 * sxw, XA)[:, None] + cc, mask=m, other=0.0)
        wy1 = ly[:, None]
        wx1 = lx[:, None]
        top = (1.0 - wx1) * v00.to(tl.float32) + wx1 * v01.to(tl.float32)
        bot = (1.0 - wx1) * v10.to(tl.float32) + wx1 * v11.to(tl.float32)
        y = (1.0 - wy1) * top + wy1 * bot
        ooff = tl.multiple_of(n * son + oy * soh + ox * sow, OA)
        tl.store(OUT + ooff[:, None] + c[None, :] * soc, y.to(OUT.dtype.element_ty), mask=m)

    return upsample_kernel


def source_scale(size_in: int, size_out: int, align_corners: bool, factor: float | None) -> float:
    """aten's ``area_pixel_compute_scale``: (in - 1) / (out - 1) with align_corners (0 for one output
    pixel), else 1 / factor where a positive factor was given, else in / out."""
    if align_corners:
        return (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    if factor is not None and factor > 0:
        return 1.0 / factor
    return size_in / size_out


def upsample_bilinear2d_triton(x: torch.Tensor, out: torch.Tensor, align_corners: bool, scales) -> torch.Tensor:
    """``out`` [N, C, OH, OW] (empty, laid out as it will be returned) gets the bilinear resampling of
    x [N, C, H, W]; ``scales``: the (h, w) factors given, or None."""
    N, C, H, W = x.shape
    OH, OW = out.shape[2:]
    P = N * OH * OW
    if P == 0 or C == 0:
        return out
    fh, fw = scales if scales is not None else (None, None)
    rh = source_scale(H, OH, align_corners, fh)
    rw = source_scale(W, OW, align_corners, fw)
    bc, bp, ncb, grid, wide = tiles(C, P, x, out)
    k = _kernel()
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        ca = row_vec(C, x.element_size())
        k[grid](x, out, P, float(rh), float(rw), C // ca, H, W, OH, OW, ncb, *x.stride(), *out.stride(), CA=ca,
                ALIGN_CORNERS=bool(align_corners), XA=alignment(x), OA=alignment(out), BLOCK_P=bp, BLOCK_C=bc,
                WIDE=wide, num_warps=4)
    return out
