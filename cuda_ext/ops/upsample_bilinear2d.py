"""graphopt::upsample_bilinear2d: ``F.interpolate(x, size, mode="bilinear", align_corners=...)`` (up or
down) of a 4-D image read through its strides, the output channels_last or contiguous as
``channels_last`` says.

``scale_h`` / ``scale_w``: the scale factors the model gave (they set the source positions as in
aten; <= 0: none given, the ratio of the sizes is used). fp32 arithmetic, one rounding at the store.
CUDA kernel: ``upsample_triton.py`` (fp32, fp16, bf16; fp64 runs the reference).
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype, empty_in_layout
from ..registry import define_op

SCHEMA = ("upsample_bilinear2d(Tensor x, int[2] output_size, bool align_corners, float scale_h, float scale_w, "
          "bool channels_last) -> Tensor")


def _empty(x: torch.Tensor, output_size, channels_last: bool) -> torch.Tensor:
    return empty_in_layout(x, (*x.shape[:2], *output_size), channels_last)


def _scales(scale_h: float, scale_w: float):
    return (scale_h, scale_w) if scale_h > 0 and scale_w > 0 else None


def reference(x, output_size, align_corners: bool, scale_h: float, scale_w: float, channels_last: bool):
    """aten's upsample_bilinear2d in fp32 (fp64 for fp64), rounded once to x's dtype, in the layout
    ``channels_last`` names."""
    y = torch.ops.aten.upsample_bilinear2d.default(x.to(compute_dtype(x.dtype)), list(output_size),
                                                   bool(align_corners), *(_scales(scale_h, scale_w) or (None, None)))
    return _empty(x, output_size, channels_last).copy_(y)


def fake(x, output_size, align_corners, scale_h, scale_w, channels_last):
    torch._check(x.dim() == 4, lambda: "graphopt::upsample_bilinear2d: x must be [N, C, H, W]")
    return _empty(x, output_size, channels_last)


def cuda(x, output_size, align_corners, scale_h, scale_w, channels_last):
    from ..upsample_triton import DTYPES, upsample_bilinear2d_triton

    if x.dtype not in DTYPES:
        return reference(x, output_size, align_corners, scale_h, scale_w, channels_last)
    return upsample_bilinear2d_triton(x, _empty(x, output_size, channels_last), bool(align_corners),
                                      _scales(scale_h, scale_w))


def cost(call, profile):
    """One memory-bound kernel: the input read once (its four-neighbour reads of an upsampling hit the
    cache) and the output written once, 8 FLOPs an output element."""
    return fused_cost(call, flops_per_element=8)


def problem(x: torch.Tensor, output_size) -> str | None:
    if x.dim() != 4:
        return f"x must be [N, C, H, W], got {x.dim()} dims"
    if len(output_size) != 2 or not all(isinstance(v, int) and v >= 1 for v in output_size):
        return f"output_size must be two integers >= 1, got {output_size!r}"
    if min(x.shape[2:]) < 1:
        return f"an empty image {tuple(x.shape[2:])}"
    return None


def upsample_bilinear2d(x: torch.Tensor, output_size, align_corners: bool = False, scale_factor=None,
                        channels_last: bool = True) -> torch.Tensor:
    """Bilinear resampling of ``x`` [N, C, H, W] (any strides) to ``output_size``; ``scale_factor``
    (one float or an (h, w) pair) as given to F.interpolate, or None."""
    check_floating("upsample_bilinear2d", x=x)
    size = [int(v) for v in output_size] if isinstance(output_size, (tuple, list)) else [int(output_size)] * 2
    why = problem(x, size)
    if why is not None:
        raise KernelArgumentError(f"graphopt::upsample_bilinear2d: {why}")
    sh, sw = (scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)) \
        if scale_factor is not None else (0.0, 0.0)
    return torch.ops.graphopt.upsample_bilinear2d(x, size, bool(align_corners), float(sh), float(sw),
                                                  bool(channels_last))


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 6, 4, 5).contiguous(memory_format=torch.channels_last), [8, 10], False, 2.0, 2.0, True)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=upsample_bilinear2d, cost=cost,
               kernel="upsample_triton.py", cuda=cuda, example=example)
