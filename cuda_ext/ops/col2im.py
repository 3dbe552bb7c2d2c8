"""graphopt::col2im: ``F.fold`` (aten's ``col2im``) of windows given as a 7-D view
[N, C1, C2, kh, kw, lh, lw] (channel c = c1*C2 + c2, window (ly, lx) of the lh x lw grid), into
[N, C1*C2, H, W], contiguous or channels_last (``channels_last``).

The 7-D view lets the fold read a permuted tensor where it is (``lower_col2im`` hands it the
tensor aten would have copied into a contiguous [N, C*kh*kw, L] first) and write the layout its
readers want. CUDA kernel: ``col2im_triton.py`` (fp32, fp16, bf16; fp64 runs the reference),
each output element summing its taps in fp32. Differentiable: the gradient is ``F.unfold`` of
the output's gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype, empty_in_layout
from ..registry import define_op

SCHEMA = ("col2im(Tensor x, int[2] output_size, int[2] kernel_size, int[2] dilation, int[2] padding, "
          "int[2] stride, bool channels_last) -> Tensor")


def windows(size: int, kernel: int, dilation: int, padding: int, stride: int) -> int:
    """How many windows fit along a dim of ``size`` (fold's and unfold's L along it)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _empty(x: torch.Tensor, output_size, channels_last: bool) -> torch.Tensor:
    N, C1, C2 = x.shape[:3]
    return empty_in_layout(x, (N, C1 * C2, *output_size), channels_last)


def reference(x: torch.Tensor, output_size, kernel_size, dilation, padding, stride, channels_last: bool) -> torch.Tensor:
    """``F.fold`` of x flattened to [N, C1*C2*kh*kw, lh*lw], computed in fp32 (fp64 for fp64),
    rounded once to x's dtype, in the layout ``channels_last`` names."""
    N = x.shape[0]
    cols = x.reshape(N, -1, x.shape[5] * x.shape[6]).to(compute_dtype(x.dtype))
    y = F.fold(cols, list(output_size), list(kernel_size), dilation=list(dilation), padding=list(padding),
               stride=list(stride))
    return _empty(x, output_size, channels_last).copy_(y)


def fake(x, output_size, kernel_size, dilation, padding, stride, channels_last):
    torch._check(x.dim() == 7, lambda: "graphopt::col2im: x must be [N, C1, C2, kh, kw, lh, lw]")
    return _empty(x, output_size, channels_last)


def cuda(x, output_size, kernel_size, dilation, padding, stride, channels_last):
    from ..col2im_triton import DTYPES, col2im_triton

    if x.dtype not in DTYPES:
        return reference(x, output_size, kernel_size, dilation, padding, stride, channels_last)
    return col2im_triton(x, _empty(x, output_size, channels_last), kernel_size, dilation, padding, stride,
                         channels_last)


def cost(call, profile):
    """One memory-bound kernel: each window element lands on one output element (or in the
    padding), so the input is read once and the output written once; a FLOP a tap an output
    element visits (``col2im_triton.taps``)."""
    from ..col2im_triton import taps

    k, d, s = call.arg("kernel_size"), call.arg("dilation"), call.arg("stride")
    return fused_cost(call, flops_per_element=taps(k[0], d[0], s[0])[0] * taps(k[1], d[1], s[1])[0])


def problem(x: torch.Tensor, output_size, kernel_size, dilation, padding, stride) -> str | None:
    """Why the op does not take these arguments (None: it does)."""
    pairs = {"output_size": output_size, "kernel_size": kernel_size, "dilation": dilation, "padding": padding,
             "stride": stride}
    for name, v in pairs.items():
        if len(v) != 2 or not all(isinstance(i, int) for i in v):
            return f"{name} must be two integers, got {v!r}"
    if min(*kernel_size, *dilation, *stride) < 1 or min(padding) < 0:
        return f"kernel, dilation and stride must be >= 1 and padding >= 0, got {kernel_size}, {dilation}, " \
               f"{stride}, {padding}"
    if x.dim() != 7:
        return f"x must be [N, C1, C2, kh, kw, lh, lw], got {x.dim()} dims"
    want = tuple(kernel_size) + tuple(windows(*a) for a in zip(output_size, kernel_size, dilation, padding, stride))
    if tuple(x.shape[3:]) != want:
        return f"x's last four dims must be (kh, kw, lh, lw) = {want} for output {tuple(output_size)}, " \
               f"got {tuple(x.shape[3:])}"
    return None


def col2im(x: torch.Tensor, output_size, kernel_size, dilation=(1, 1), padding=(0, 0), stride=(1, 1),
           channels_last: bool = False) -> torch.Tensor:
    """``F.fold`` of ``x`` [N, C1, C2, kh, kw, lh, lw] (any strides: a view of a permuted tensor is
    read in place) into [N, C1*C2, *output_size], channels_last if asked; sums in fp32."""
    check_floating("col2im", x=x)
    args = [[int(i) for i in v] if isinstance(v, (tuple, list)) else [int(v)] * 2
            for v in (output_size, kernel_size, dilation, padding, stride)]
    why = problem(x, *args)
    if why is not None:
        raise KernelArgumentError(f"graphopt::col2im: {why}")
    return torch.ops.graphopt.col2im(x, *args, bool(channels_last))


def setup_context(ctx, inputs, output):
    x, output_size, kernel_size, dilation, padding, stride, _ = inputs
    ctx.shape = x.shape
    ctx.args = (kernel_size, dilation, padding, stride)


def backward(ctx, g):
    kernel_size, dilation, padding, stride = ctx.args
    dx = F.unfold(g, list(kernel_size), dilation=list(dilation), padding=list(padding), stride=list(stride))
    return dx.view(ctx.shape), None, None, None, None, None, None


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    x = torch.randn(2, 5, 3, 2, 3, 3, 3)  # [N, 15 channels as 5 x 3, 2x3 windows, 3x3 of them]
    return (x, [5, 6], [2, 3], [1, 1], [1, 1], [2, 2], False)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=col2im, cost=cost, kernel="col2im_triton.py",
               cuda=cuda, autograd=(backward, setup_context), example=example)
