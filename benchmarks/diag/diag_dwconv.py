# Answered: Is graphopt::dwconv2d (lower_depthwise_conv) faster than aten's cuDNN depthwise convolution with its input copy and bias_act epilogue, and than Inductor's, on the depthwise shapes of CoaT, ConvNeXt, EfficientNet, MobileNet and ConvMixer (whose model ran 2.4x slower with the pass, 12-07), and is it priced right? (results/diag_dwconv_<date>.md)
"""Depthwise convolutions as models write them, each way of running them, and the cost model's price.

    python benchmarks/diag/diag_dwconv.py --out DIR [--no-compile] [--nodes]

Each case is a small module over a channels_last input: the convolution (its input a dense tensor, or
a channel slice or token view as CoaT reads it), its bias, activation and residual. Timed replayed
from a CUDA graph (µs per call, median), bf16: eager, graphopt after ``fuse_bias_act`` and
``lower_depthwise_conv`` alone (the graph the passes make), torch.compile (default mode), and the
cost model's prediction of the eager and rewritten graphs on this device's profile; each result
checked against float64. ``--nodes``: each node's kernel time beside its price, in both graphs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_col2im import run_cases  # noqa: E402


class Dw(nn.Module):
    """act(depthwise conv(x) + bias) (+ x where ``residual``)."""

    def __init__(self, c, k, stride=1, act=None, residual=False):
        super().__init__()
        self.conv = nn.Conv2d(c, c, k, stride, k // 2, groups=c)
        self.act, self.residual = act or nn.Identity(), residual

    def forward(self, x):
        y = self.act(self.conv(x))
        return y + x if self.residual else y


class TokenPosEnc(nn.Module):
    """CoaT's convolutional position encoding: the tokens after the class token seen as an image
    (a strided view), convolved depthwise 3x3, + the image."""

    def __init__(self, c, size):
        super().__init__()
        self.size, self.conv = size, nn.Conv2d(c, c, 3, 1, 1, groups=c)

    def forward(self, x):  # [B, 1 + H*W, C]
        B, _, C = x.shape
        feat = x[:, 1:].transpose(1, 2).view(B, C, *self.size)
        return self.conv(feat) + feat


class ValueConv(nn.Module):
    """CoaT's relative position encoding over the value channels of qkv laid out [B, H, W, 3C], one
    depthwise 7x7 (merge_split_convs' merged 3/5/7 filters)."""

    def __init__(self, c, k=7):
        super().__init__()
        self.c, self.conv = c, nn.Conv2d(c, c, k, 1, k // 2, groups=c)

    def forward(self, qkv):
        return self.conv(qkv.permute(0, 3, 1, 2)[:, 2 * self.c:])


def _cl(*shape):
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


CASES = [
    ("CoaT-Tiny cpe 3x3, tokens 28x28x152", lambda: (TokenPosEnc(152, (28, 28)), (torch.randn(64, 785, 152),))),
    ("CoaT-Tiny crpe 7x7, value slice 28x28x152", lambda: (ValueConv(152), (torch.randn(64, 28, 28, 456),))),
    ("CoaT-Tiny crpe 7x7, value slice 56x56x152", lambda: (ValueConv(152), (torch.randn(64, 56, 56, 456),))),
    ("ConvNeXt-T 7x7, 56x56x96", lambda: (Dw(96, 7), (_cl(64, 96, 56, 56),))),
    ("ConvNeXt-T 7x7, 14x14x384", lambda: (Dw(384, 7), (_cl(64, 384, 14, 14),))),
    ("ConvMixer-768/32 7x7 + ReLU, 32x32x768", lambda: (Dw(768, 7, 1, nn.ReLU()), (_cl(64, 768, 32, 32),))),
    ("EfficientNet-B0 3x3/2 + SiLU, 112x112x96", lambda: (Dw(96, 3, 2, nn.SiLU()), (_cl(64, 96, 112, 112),))),
    ("EfficientNet-B0 5x5 + SiLU, 28x28x240", lambda: (Dw(240, 5, 1, nn.SiLU()), (_cl(64, 240, 28, 28),))),
    ("MobileNetV3 3x3 + Hardswish, 14x14x480", lambda: (Dw(480, 3, 1, nn.Hardswish()), (_cl(64, 480, 14, 14),))),
    ("MobileNetV2 3x3 + ReLU, 112x112x32", lambda: (Dw(32, 3, 1, nn.ReLU()), (_cl(64, 32, 112, 112),))),
    ("EfficientNet 3x3 + residual, 56x56x24", lambda: (Dw(24, 3, 1, None, True), (_cl(64, 24, 56, 56),))),
]


def main(argv=None) -> int:
    return run_cases(__doc__, argv, CASES, ("fuse_bias_act", "lower_depthwise_conv"), "diag_dwconv",
                     "# Depthwise convolutions: aten (cuDNN), graphopt::dwconv2d, torch.compile")


if __name__ == "__main__":
    sys.exit(main())
