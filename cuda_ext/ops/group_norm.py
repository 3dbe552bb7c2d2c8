"""graphopt::group_norm: ``act(group_norm(x, groups, weight, bias, eps))`` with fp32 statistics and
one rounding to x's dtype; x NCHW-contiguous or channels_last (the output keeps its layout);
``act`` one of none, relu, silu, gelu.

CUDA kernel: ``group_norm_triton.py``, each (sample, group) row's statistics split across
programs (aten gives a row one thread block: few long rows leave the GPU idle), then one pass
applying the normalization, the per-channel affine and the activation.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype, fresh
from ..registry import define_op

SCHEMA = "group_norm(Tensor x, int groups, Tensor? weight, Tensor? bias, float eps, str act) -> Tensor"
ACTIVATIONS = ("none", "relu", "silu", "gelu")


def _layout(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _activation(y: torch.Tensor, act: str) -> torch.Tensor:
    return {"none": lambda t: t, "relu": torch.relu, "silu": F.silu, "gelu": F.gelu}[act](y)


def reference(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
              act: str) -> torch.Tensor:
    """act(group_norm(x)), statistics in fp32 (fp64 stays fp64), one rounding, x's layout out."""
    ct = compute_dtype(x.dtype)
    y = F.group_norm(x.to(ct), groups, None if weight is None else weight.to(ct),
                     None if bias is None else bias.to(ct), eps)
    return fresh(_activation(y, act).to(x.dtype), x).contiguous(memory_format=_layout(x))


def fake(x, groups, weight, bias, eps, act):
    return x.new_empty(x.shape).contiguous(memory_format=_layout(x))


def cuda(x, groups, weight, bias, eps, act):
    from ..group_norm_triton import group_norm_triton

    return group_norm_triton(x, groups, weight, bias, eps, act)


def cost(call, profile):
    """Two reads of x (statistics, then the normalization) and one write, 8 FLOPs an element, at the
    copy-rate fraction the profile measured for the kernels (``op_efficiency["group_norm_kernel"]``)."""
    c = fused_cost(call, flops_per_element=8)
    return dataclasses.replace(c, bytes=c.bytes + call.info("x").nbytes, launches=2, efficiency="group_norm_kernel")


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, act: str = "none") -> torch.Tensor:
    """``act(F.group_norm(x, groups, weight, bias, eps))`` in two passes over x, its statistics split
    across the GPU; x is [N, C, ...] with C divisible by ``groups``."""
    check_floating("group_norm", x=x)
    if act not in ACTIVATIONS:
        raise KernelArgumentError(f"graphopt::group_norm: unknown activation {act!r} ({', '.join(ACTIVATIONS)})")
    if x.dim() < 2 or groups < 1 or x.shape[1] % groups:
        raise KernelArgumentError(f"graphopt::group_norm: x must be [N, C, ...] with C divisible by groups; got "
                                  f"{tuple(x.shape)} and {groups} groups")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != x.shape[1]):
            raise KernelArgumentError(f"graphopt::group_norm: {name} must be 1-D of length {x.shape[1]}, got "
                                      f"{tuple(t.shape)}")
    return torch.ops.graphopt.group_norm(x, groups, weight, bias, eps, act)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 8, 5, 5), 2, torch.randn(8), torch.randn(8), 1e-5, "silu")


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=group_norm, cost=cost, kernel="group_norm_triton.py",
               cuda=cuda, example=example)
