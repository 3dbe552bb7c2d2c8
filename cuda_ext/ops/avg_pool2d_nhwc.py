"""graphopt::avg_pool2d_nhwc: ``avg_pool2d(x, kernel, stride, padding, count_include_pad=...)`` over a
channels_last input (square window, dilation 1, floor mode, no divisor override), channels_last out.

The window's positions inside the image are summed in fp32 and divided by kernel*kernel
(``count_include_pad``) or by their number; one rounding at the store.

CUDA kernel: ``csrc/pool.cu`` (max_pool2d_nhwc's, summing instead of taking the max).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..registry import define_op

SCHEMA = "avg_pool2d_nhwc(Tensor x, int kernel, int stride, int padding, bool count_include_pad) -> Tensor"


def _valid(x, kernel, stride, padding) -> bool:
    return x.dim() == 4 and kernel >= 1 and stride >= 1 and 0 <= 2 * padding <= kernel


def reference(x: torch.Tensor, kernel: int, stride: int, padding: int, count_include_pad: bool) -> torch.Tensor:
    """avg_pool2d(x, kernel, stride, padding, count_include_pad=...) (square, dilation 1, floor),
    accumulated in fp32 (fp64 stays fp64), channels_last out."""
    if not _valid(x, kernel, stride, padding):
        raise ValueError(f"graphopt::avg_pool2d_nhwc: needs a 4-D x, kernel >= 1, stride >= 1 and 0 <= padding <= "
                         f"kernel / 2, got {tuple(x.shape)}, {kernel}, {stride}, {padding}")
    acc = x if x.dtype == torch.float64 else x.float()
    y = F.avg_pool2d(acc, kernel, stride, padding, count_include_pad=count_include_pad)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last)


def fake(x, kernel, stride, padding, count_include_pad):
    torch._check(x.dim() == 4, lambda: "graphopt::avg_pool2d_nhwc: x must be [N, C, H, W]")
    ho = (x.shape[2] + 2 * padding - kernel) // stride + 1
    wo = (x.shape[3] + 2 * padding - kernel) // stride + 1
    return x.new_empty((x.shape[0], x.shape[1], ho, wo)).contiguous(memory_format=torch.channels_last)


def avg_pool2d_nhwc(x: torch.Tensor, kernel: int, stride: int, padding: int = 0,
                    count_include_pad: bool = True) -> torch.Tensor:
    """avg_pool2d over a channels_last tensor (square window, dilation 1, floor), channels_last out."""
    if not _valid(x, kernel, stride, padding):
        raise KernelArgumentError(f"graphopt::avg_pool2d_nhwc: needs a 4-D x, kernel >= 1, stride >= 1 and "
                                  f"0 <= padding <= kernel / 2; got {tuple(x.shape)}, {kernel}, {stride}, {padding}")
    return torch.ops.graphopt.avg_pool2d_nhwc(x, kernel, stride, padding, count_include_pad)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last), 3, 1, 1, True)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=avg_pool2d_nhwc, cost=fused_cost,
               kernel="csrc/pool.cu", example=example)
