"""graphopt::dwconv2d: ``act(conv2d(x, w, groups=C) + bias) + residual``, a depthwise convolution
(w [C, 1, kh, kw]: one filter per channel) with its epilogue, in one kernel.

x and the residual are read through their strides (a channel slice of a wider channels_last tensor
is read where it is: aten's cuDNN call copies it into a dense tensor first); the output is
channels_last or contiguous as ``channels_last`` says. Sums in fp32, one rounding at the store
(aten rounds the convolution's output, then bias_act's). ``act`` is one of bias_act's activations.
CUDA kernel: ``dwconv_triton.py`` (fp32, fp16, bf16; fp64 runs the reference).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype, empty_in_layout
from ..registry import define_op
from .bias_act import ACTIVATIONS, LEAKY, activation, known
from .col2im import windows

SCHEMA = ("dwconv2d(Tensor x, Tensor w, Tensor? bias, Tensor? residual, int[2] stride, int[2] padding, "
          "int[2] dilation, str act, bool channels_last) -> Tensor")
# the taps' reads hit the cache (each input pixel is read by up to kh*kw outputs); their rate over the
# profile's copy rate where a profile has no op_efficiency["dwconv2d"]["cache_speedup"]: 5.4, the geometric
# mean over the four 7x7 cases of benchmarks/results/diag_dwconv_2026-12-07_073726_h100.md (4.0-6.8 on an
# H100, read as 8 x predicted / measured at the first guess of 8: an L1 bound of 128 bytes a clock an SM).
# The cache's rate is the SMs', not the memory's: on an H200 (faster memory, the same SMs) the ratio is
# lower (not measured).
CACHE_SPEEDUP = 5.4


def out_shape(x_shape, w_shape, stride, padding, dilation) -> tuple:
    N, C, H, W = x_shape
    kh, kw = w_shape[2:]
    return (N, C, windows(H, kh, dilation[0], padding[0], stride[0]), windows(W, kw, dilation[1], padding[1], stride[1]))


_empty = empty_in_layout


def reference(x, w, bias, residual, stride, padding, dilation, act: str, channels_last: bool) -> torch.Tensor:
    """conv2d(x, w, groups=C) in fp32 (fp64 for fp64), + bias, the activation, + residual, rounded once
    to x's dtype, in the layout ``channels_last`` names."""
    ct = compute_dtype(x.dtype)
    y = F.conv2d(x.to(ct), w.to(ct), None, list(stride), list(padding), list(dilation), groups=x.shape[1])
    if bias is not None:
        y = y + bias.to(ct).view(1, -1, 1, 1)
    y = activation(y, act)
    if residual is not None:
        y = y + residual.to(ct)
    return _empty(x, y.shape, channels_last).copy_(y)


def fake(x, w, bias, residual, stride, padding, dilation, act, channels_last):
    torch._check(x.dim() == 4 and w.dim() == 4, lambda: "graphopt::dwconv2d: x and w must be 4-D")
    return _empty(x, out_shape(x.shape, w.shape, stride, padding, dilation), channels_last)


def cuda(x, w, bias, residual, stride, padding, dilation, act, channels_last):
    from ..dwconv_triton import DTYPES, dwconv2d_triton

    if x.dtype not in DTYPES:
        return reference(x, w, bias, residual, stride, padding, dilation, act, channels_last)
    out = _empty(x, out_shape(x.shape, w.shape, stride, padding, dilation), channels_last)
    return dwconv2d_triton(x, w.to(x.dtype), bias, residual, out, stride, padding, dilation, act)


def cost(call, profile):
    """One kernel: x, the weights, bias and residual read once from memory and the output written once
    (the memory time), 2 FLOPs a tap an output element; and the taps' reads, kh*kw input tiles the
    size of the output, from the cache at ``CACHE_SPEEDUP`` times the copy rate (a floor on the
    device time: a 7x7 filter is bound by them, not by memory)."""
    out = call.outputs[0]
    w = call.info("w")
    taps = int(w.shape[2]) * int(w.shape[3]) if w is not None and len(w.shape) == 4 else 1
    floor = None
    if profile is not None and profile.kind == "cuda":
        floor = taps * out.nbytes / (profile.bandwidth * profile.efficiency("dwconv2d", "cache_speedup", CACHE_SPEEDUP))
    return OpCost(out.numel * 2 * taps, call.in_bytes + call.out_bytes, device_floor_s=floor)


def problem(x: torch.Tensor, w: torch.Tensor, bias, residual, stride, padding, dilation, act: str) -> str | None:
    """Why the op does not take these arguments (None: it does)."""
    for name, v in (("stride", stride), ("padding", padding), ("dilation", dilation)):
        if len(v) != 2 or not all(isinstance(i, int) for i in v):
            return f"{name} must be two integers, got {v!r}"
    if min(*stride, *dilation) < 1 or min(padding) < 0:
        return f"stride and dilation must be >= 1 and padding >= 0, got {stride}, {dilation}, {padding}"
    if x.dim() != 4 or w.dim() != 4:
        return f"x and w must be 4-D, got {x.dim()} and {w.dim()} dims"
    C = x.shape[1]
    if tuple(w.shape[:2]) != (C, 1):
        return f"w must be [C, 1, kh, kw] with C = {C} (one filter per channel), got {tuple(w.shape)}"
    if bias is not None and tuple(bias.shape) != (C,):
        return f"bias must be [{C}], got {tuple(bias.shape)}"
    if not known(act):
        return f"unknown activation {act!r} ({', '.join(ACTIVATIONS)}, {LEAKY}<slope>)"
    shape = out_shape(x.shape, w.shape, stride, padding, dilation)
    if min(shape[2:]) < 1:
        return f"the filter {tuple(w.shape[2:])} does not fit the padded input {tuple(x.shape[2:])}"
    if residual is not None:
        try:
            ok = tuple(torch.broadcast_shapes(tuple(residual.shape), shape)) == tuple(shape)
        except RuntimeError:
            ok = False
        if not ok:
            return f"residual shape {tuple(residual.shape)} does not broadcast to the output's {tuple(shape)}"
    return None


def dwconv2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
             act: str = "none", channels_last: bool = True) -> torch.Tensor:
    """``act(conv2d(x, w, bias, groups=C)) + residual`` for w [C, 1, kh, kw], x and the residual read
    through their strides, the output channels_last (or contiguous); sums in fp32."""
    check_floating("dwconv2d", x=x, w=w, bias=bias, residual=residual)
    args = [[int(i) for i in v] if isinstance(v, (tuple, list)) else [int(v)] * 2 for v in (stride, padding, dilation)]
    why = problem(x, w, bias, residual, *args, act)
    if why is not None:
        raise KernelArgumentError(f"graphopt::dwconv2d: {why}")
    return torch.ops.graphopt.dwconv2d(x, w, bias, residual, *args, act, bool(channels_last))


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    x = torch.randn(2, 6, 5, 7).contiguous(memory_format=torch.channels_last)
    return (x, torch.randn(6, 1, 3, 3), torch.randn(6), None, [1, 1], [1, 1], [1, 1], "silu", True)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=dwconv2d, cost=cost, kernel="dwconv_triton.py",
               cuda=cuda, example=example)
