"""graphopt::conv_bias_relu: ``relu(conv2d(x, w) + bias + z)`` as one cuDNN fused convolution (aten's
``cudnn_convolution_relu`` / ``cudnn_convolution_add_relu``); z is an optional residual of the
output's shape. The output is channels_last when x or w is (:func:`layout`), the one op whose
output is not always contiguous. CUDA: ``csrc/conv_bias_relu.cpp``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from graphopt.cost.model import conv_flops_bytes, conv_input_copy_bytes, conv_rate
from graphopt.cost.opclass import conv_tags, dtype_of
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from ..common import compute_dtype
from ..registry import define_op

SCHEMA = ("conv_bias_relu(Tensor x, Tensor w, Tensor? bias, Tensor? z, int[2] stride, int[2] padding, "
          "int[2] dilation, int groups) -> Tensor")


def layout(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    """The layout cuDNN gives a convolution's output: channels_last when x or w is in it."""
    cl = torch.channels_last
    return cl if any(t.dim() == 4 and t.is_contiguous(memory_format=cl) and not t.is_contiguous()
                     for t in (x, w)) else torch.contiguous_format


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor | None,
              stride: list, padding: list, dilation: list, groups: int) -> torch.Tensor:
    """relu(conv2d(x, w) + bias + z), in x's dtype and the layout cuDNN would give it."""
    ct = compute_dtype(x.dtype)
    y = F.conv2d(x.to(ct), w.to(ct), None if bias is None else bias.to(ct), stride, padding, dilation, groups)
    if z is not None:
        y = y + z.to(ct)
    return torch.relu(y).to(x.dtype).contiguous(memory_format=layout(x, w))


def fake(x, w, bias, z, stride, padding, dilation, groups):
    torch._check(x.dim() == 4 and w.dim() == 4, lambda: "graphopt::conv_bias_relu: 2-D convolutions only")
    shape = [x.shape[0], w.shape[0]]
    for i in range(2):
        k = dilation[i] * (w.shape[2 + i] - 1) + 1
        shape.append((x.shape[2 + i] + 2 * padding[i] - k) // stride[i] + 1)
    return x.new_empty(shape).contiguous(memory_format=layout(x, w))


def cost(call, profile):
    """A convolution at the profile's conv fit, which measures this fused form (bias and ReLU in
    cuDNN: no bias kernel after it, no unfused slowdown), and the copy cuDNN's call makes of an
    input dense in no memory format."""
    flops, nbytes = conv_flops_bytes(call.inputs, call.outputs)
    return OpCost(flops, nbytes, kind="matmul", efficiency="conv", rate=conv_rate(profile, call.node),
                  copy_bytes=conv_input_copy_bytes(call.info("x")))


def op_class(call):
    """A convolution's class (dense / grouped / depthwise, layout, output pixels)."""
    x = call.info("x")
    return conv_tags(dtype_of(x), x, call.info("w"), call.outputs[0] if call.outputs else None)


def conv_bias_relu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, stride: Sequence[int] = (1, 1), padding: Sequence[int] = (0, 0),
                   dilation: Sequence[int] = (1, 1), groups: int = 1) -> torch.Tensor:
    """``relu(conv2d(x, w) + bias + z)`` as one cuDNN fused convolution on CUDA (z: an optional
    residual of the output's shape). The output is channels_last when x or w is."""
    if x.dim() != 4 or w.dim() != 4:
        raise KernelArgumentError(f"graphopt::conv_bias_relu: 2-D convolutions only (4-D x and w), got "
                                  f"{tuple(x.shape)} and {tuple(w.shape)}")
    return torch.ops.graphopt.conv_bias_relu(x, w, bias, z, list(stride), list(padding), list(dilation), groups)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 4, 9, 9).contiguous(memory_format=torch.channels_last), torch.randn(8, 4, 3, 3),
            None, None, [1, 1], [1, 1], [1, 1], 1)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=conv_bias_relu, cost=cost,
               kernel="csrc/conv_bias_relu.cpp", op_class=op_class, example=example)
