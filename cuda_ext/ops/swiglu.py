"""graphopt::swiglu: ``silu(gate) * up`` from a merged gate/up projection (``gate, up =
gate_up.chunk(2, -1)``), shape ``[..., H]``. CUDA kernel: ``csrc/swiglu.cu``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype, fresh
from ..registry import define_op

SCHEMA = "swiglu(Tensor gate_up) -> Tensor"


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up where gate, up = gate_up.chunk(2, -1)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"graphopt::swiglu: last dim must be even, got {tuple(gate_up.shape)}")
    ct = compute_dtype(gate_up.dtype)
    g, u = gate_up.to(ct).chunk(2, dim=-1)
    return fresh((F.silu(g) * u).to(gate_up.dtype), gate_up)


def fake(gate_up):
    torch._check(gate_up.shape[-1] % 2 == 0, lambda: "graphopt::swiglu: last dim must be even")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``; shape ``[..., H]``."""
    check_floating("swiglu", gate_up=gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise KernelArgumentError(f"graphopt::swiglu: last dim must be even (gate and up halves), got "
                                  f"shape {tuple(gate_up.shape)}")
    return torch.ops.graphopt.swiglu(gate_up)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 64),)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=swiglu, cost=fused_cost,
               kernel="csrc/swiglu.cu", example=example)
