"""Python wrappers of the graphopt ops: thin calls of ``torch.ops.graphopt.*``, with defaults
and docstrings. Any of them can be called directly or appear in an FX graph / TorchScript."""
from __future__ import annotations

from typing import Sequence

import torch

from .pointwise import Program


def bias_act(x: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none",
             residual: torch.Tensor | None = None, bias_dim: int = -1) -> torch.Tensor:
    """``act(x + bias) + residual`` in one pass. ``bias`` is 1-D along ``x.size(bias_dim)``
    (-1 for linear outputs, 1 for NCHW convolutions); ``act`` is one of none, relu, gelu,
    gelu_tanh, silu, sigmoid, tanh, hardswish; ``residual`` has x's shape. fp32 math."""
    return torch.ops.graphopt.bias_act(x, bias, act, residual, bias_dim)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``layer_norm`` over the last dim (up to 8192 wide) with fp32 statistics; on CUDA a Triton
    kernel that normalizes many rows per program (fast for narrow rows, where one block per row
    is scheduling-bound)."""
    return torch.ops.graphopt.layer_norm(x, weight, bias, eps)


def conv_bias_relu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, stride: Sequence[int] = (1, 1), padding: Sequence[int] = (0, 0),
                   dilation: Sequence[int] = (1, 1), groups: int = 1) -> torch.Tensor:
    """``relu(conv2d(x, w) + bias + z)`` as one cuDNN fused convolution on CUDA (z: an optional
    residual of the output's shape). The output is channels_last when x or w is."""
    return torch.ops.graphopt.conv_bias_relu(x, w, bias, z, list(stride), list(padding), list(dilation), groups)


def max_pool2d_nhwc(x: torch.Tensor, kernel: int, stride: int, padding: int = 0) -> torch.Tensor:
    """max_pool2d over a channels_last tensor (square window, dilation 1), channels_last out."""
    if x.dim() != 4 or not (kernel >= 1 and stride >= 1 and 0 <= 2 * padding <= kernel):
        raise ValueError(f"graphopt::max_pool2d_nhwc: needs a 4-D x, kernel >= 1, stride >= 1 and "
                         f"0 <= padding <= kernel / 2; got {tuple(x.shape)}, {kernel}, {stride}, {padding}")
    return torch.ops.graphopt.max_pool2d_nhwc(x, kernel, stride, padding)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or a copy of x); returns ``(rmsnorm(h) * weight, h)``. Numerics of
    Hugging Face's LlamaRMSNorm: fp32 statistics over h, ``weight * normed.to(x.dtype)``."""
    return torch.ops.graphopt.add_rms_norm(x, residual, weight, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or a copy of x); returns ``(layer_norm(h) * weight + bias, h)``
    over the last dim, fp32 statistics."""
    return torch.ops.graphopt.add_layer_norm(x, residual, weight, bias, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``; shape ``[..., H]``."""
    return torch.ops.graphopt.swiglu(gate_up)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` (any strides) with
    cos/sin ``[B or 1, S, R]`` (``[B or 1, 1, S, R]`` is accepted too), R even and <= D: the
    first R dims of each head rotate, the rest pass through. ``interleaved=False`` is Llama's
    rotate_half, ``True`` GLM's pairwise form. Returns contiguous ``(q_out, k_out)``."""
    return torch.ops.graphopt.rotary(q, k, cos, sin, interleaved)


def softmax_mask(scores: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scores * scale + mask, -1)`` with fp32 math. ``mask`` broadcasts to scores;
    bool masks keep True positions, float masks are added. A row whose every position is
    masked (all False, or all -inf) comes out as zeros, not NaN."""
    return torch.ops.graphopt.softmax_mask(scores, scale, mask)


def fused_pointwise(program: str | Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a pointwise program (text or :class:`~graphopt.cuda_ext.pointwise.Program`) on
    broadcasting, possibly strided inputs; returns its outputs (contiguous, broadcast shape)."""
    src = program.source if isinstance(program, Program) else program
    return torch.ops.graphopt.fused_pointwise(src, list(inputs))
