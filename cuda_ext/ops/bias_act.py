"""graphopt::bias_act: ``act(x + bias) + residual`` in one pass, the epilogue of a GEMM or a
convolution.

``bias`` is 1-D along ``x.size(bias_dim)`` (-1 for linear outputs, 1 for NCHW convolutions),
``act`` one of none, relu, gelu, gelu_tanh, silu, sigmoid, tanh, hardswish, or ``leaky_relu:<slope>``
(the negative slope as Python's ``repr`` writes the float), ``residual`` broadcasts
to x; fp32 math, one rounding. A channels_last x with its bias along the channels gives a
channels_last result (:func:`out_format`), so the epilogue keeps a conv net's NHWC layout. CUDA kernel: ``csrc/bias_act.cu``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_at_least_1d, check_floating, check_residual, compute_dtype, fresh
from ..registry import define_op

SCHEMA = "bias_act(Tensor x, Tensor? bias, str act, Tensor? residual, int bias_dim=-1) -> Tensor"
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "hardswish")
LEAKY = "leaky_relu:"


def leaky_act(slope: float) -> str:
    """bias_act's name of leaky_relu with ``slope``: ``leaky_relu:<repr of the float>``."""
    return f"{LEAKY}{float(slope)!r}"


def leaky_slope(act: str) -> float | None:
    """The negative slope of ``leaky_relu:<slope>``; None for another name or a slope that is no float."""
    if not act.startswith(LEAKY):
        return None
    try:
        return float(act[len(LEAKY):])
    except ValueError:
        return None


def known(act: str) -> bool:
    return act in ACTIVATIONS or leaky_slope(act) is not None


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "none":
        return x
    if act == "relu":
        return torch.relu(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "silu":
        return F.silu(x)
    if act == "sigmoid":
        return torch.sigmoid(x)
    if act == "tanh":
        return torch.tanh(x)
    if act == "hardswish":
        return F.hardswish(x)
    slope = leaky_slope(act)
    if slope is not None:
        return F.leaky_relu(x, slope)
    raise ValueError(f"graphopt::bias_act: unknown activation {act!r} (one of {', '.join(ACTIVATIONS)})")


def out_format(x: torch.Tensor, bias: torch.Tensor | None, bias_dim: int) -> torch.memory_format:
    """The output's layout: channels_last (3d) where ``x`` is dense in it and not also contiguous
    and the bias, if any, runs along dim 1 (the kernel then walks memory with the channels
    innermost); else contiguous. The CUDA kernel follows the same rule."""
    if x.is_contiguous() or (bias is not None and bias_dim % x.dim() != 1):
        return torch.contiguous_format
    for dim, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if x.dim() == dim and x.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def reference(x: torch.Tensor, bias: torch.Tensor | None, act: str, residual: torch.Tensor | None,
              bias_dim: int = -1) -> torch.Tensor:
    """y = act(x + bias) + residual; bias is 1-D along ``x.size(bias_dim)``; laid out as
    :func:`out_format` says."""
    ct = compute_dtype(x.dtype)
    y = x.to(ct)
    if bias is not None:
        d = bias_dim % x.dim()
        if bias.dim() != 1 or bias.numel() != x.shape[d]:
            raise ValueError(f"graphopt::bias_act: bias must be 1-D of length {x.shape[d]}, got {tuple(bias.shape)}")
        shape = [1] * x.dim()
        shape[d] = -1
        y = y + bias.to(ct).view(shape)
    y = activation(y, act)
    if residual is not None:
        y = y + residual.to(ct)
    return fresh(y.to(x.dtype), x, bias, residual).contiguous(memory_format=out_format(x, bias, bias_dim))


def fake(x, bias, act, residual, bias_dim=-1):
    return x.new_empty(x.shape).contiguous(memory_format=out_format(x, bias, bias_dim))


def bias_act(x: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none",
             residual: torch.Tensor | None = None, bias_dim: int = -1) -> torch.Tensor:
    """``act(x + bias) + residual`` in one pass. ``bias`` is 1-D along ``x.size(bias_dim)``
    (-1 for linear outputs, 1 for NCHW convolutions); ``act`` is one of none, relu, gelu,
    gelu_tanh, silu, sigmoid, tanh, hardswish or ``leaky_relu:<slope>``; ``residual`` has x's shape.
    fp32 math."""
    if not known(act):
        raise KernelArgumentError(f"graphopt::bias_act: unknown activation {act!r} ({', '.join(ACTIVATIONS)}, "
                                  f"{LEAKY}<slope>)")
    check_floating("bias_act", x=x)
    if bias is not None:
        check_at_least_1d("bias_act", "x", x)
        if not -x.dim() <= bias_dim < x.dim():
            raise KernelArgumentError(f"graphopt::bias_act: bias_dim {bias_dim} out of range for {x.dim()}-D x")
        if bias.dim() != 1 or bias.shape[0] != x.shape[bias_dim]:
            raise KernelArgumentError(f"graphopt::bias_act: bias must be 1-D of length {x.shape[bias_dim]} "
                                      f"(x.size({bias_dim})), got shape {tuple(bias.shape)}")
    check_residual("bias_act", x, residual)
    return torch.ops.graphopt.bias_act(x, bias, act, residual, bias_dim)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(32), "gelu_tanh", torch.randn(24, 32), -1)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=bias_act, cost=fused_cost,
               kernel="csrc/bias_act.cu", example=example)
