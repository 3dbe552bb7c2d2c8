"""graphopt::max_pool2d_nhwc: ``max_pool2d(x, kernel, stride, padding)`` over a channels_last input
(square window, dilation 1, floor mode, padding left out of the window, NaN propagates as in
aten), channels_last out.

CUDA kernel: ``csrc/pool.cu``, one thread per output pixel and 16-byte vector of channels (scalar
when C or the pointers do not allow it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..registry import define_op

SCHEMA = "max_pool2d_nhwc(Tensor x, int kernel, int stride, int padding) -> Tensor"


def reference(x: torch.Tensor, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """max_pool2d(x, kernel, stride, padding) (square, dilation 1, floor; padding left out of the
    window, a NaN in it gives NaN), channels_last out."""
    if x.dim() != 4:
        raise ValueError(f"graphopt::max_pool2d_nhwc: x must be [N, C, H, W], got {tuple(x.shape)}")
    if not (kernel >= 1 and stride >= 1 and 0 <= 2 * padding <= kernel):
        raise ValueError(f"graphopt::max_pool2d_nhwc: needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel / 2, "
                         f"got {kernel}, {stride}, {padding}")
    return F.max_pool2d(x, kernel, stride, padding).contiguous(memory_format=torch.channels_last)


def fake(x, kernel, stride, padding):
    torch._check(x.dim() == 4, lambda: "graphopt::max_pool2d_nhwc: x must be [N, C, H, W]")
    ho = (x.shape[2] + 2 * padding - kernel) // stride + 1
    wo = (x.shape[3] + 2 * padding - kernel) // stride + 1
    return x.new_empty((x.shape[0], x.shape[1], ho, wo)).contiguous(memory_format=torch.channels_last)


def max_pool2d_nhwc(x: torch.Tensor, kernel: int, stride: int, padding: int = 0) -> torch.Tensor:
    """max_pool2d over a channels_last tensor (square window, dilation 1), channels_last out."""
    if x.dim() != 4 or not (kernel >= 1 and stride >= 1 and 0 <= 2 * padding <= kernel):
        raise KernelArgumentError(f"graphopt::max_pool2d_nhwc: needs a 4-D x, kernel >= 1, stride >= 1 and "
                                  f"0 <= padding <= kernel / 2; got {tuple(x.shape)}, {kernel}, {stride}, {padding}")
    return torch.ops.graphopt.max_pool2d_nhwc(x, kernel, stride, padding)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 8, 9, 9).contiguous(memory_format=torch.channels_last), 3, 2, 1)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=max_pool2d_nhwc, cost=fused_cost,
               kernel="csrc/pool.cu", example=example)
