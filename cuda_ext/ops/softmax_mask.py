"""graphopt::softmax_mask: ``softmax(scores * scale + mask, -1)`` with fp32 math; a bool mask keeps
True positions, a float mask is added, the mask broadcasts to scores. **A fully masked row gives
zeros, not NaN.** CUDA kernel: ``csrc/softmax.cu``.
"""
from __future__ import annotations

import math

import torch

from graphopt.cost.ops import fused_cost

from ..common import check_at_least_1d, check_floating, compute_dtype, fresh
from ..registry import define_op

SCHEMA = "softmax_mask(Tensor scores, float scale, Tensor? mask) -> Tensor"


def reference(scores: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(scores * scale + mask, -1) in fp32 (fp64 for fp64 scores). A bool mask keeps
    True positions; a float mask is added. Rows with every position masked give zeros."""
    ct = compute_dtype(scores.dtype)
    s = scores.to(ct) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, -math.inf)
        else:
            s = s + mask.to(ct)
    mx = s.amax(dim=-1, keepdim=True)
    p = torch.softmax(s, dim=-1)
    p = torch.where(mx == -math.inf, torch.zeros((), dtype=ct, device=p.device), p)
    return fresh(p.to(scores.dtype), scores)


def fake(scores, scale, mask):
    return scores.new_empty(scores.shape)


def softmax_mask(scores: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scores * scale + mask, -1)`` with fp32 math. ``mask`` broadcasts to scores;
    bool masks keep True positions, float masks are added. A row whose every position is
    masked (all False, or all -inf) comes out as zeros, not NaN."""
    check_floating("softmax_mask", scores=scores)
    check_at_least_1d("softmax_mask", "scores", scores)
    return torch.ops.graphopt.softmax_mask(scores, scale, mask)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 2, 8, 8), 0.125, torch.rand(2, 1, 1, 8) > 0.1)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=softmax_mask, cost=fused_cost,
               kernel="csrc/softmax.cu", example=example)
