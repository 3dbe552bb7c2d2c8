"""What the op modules share: reference numerics and the wrappers' argument checks.

The wrappers check what an op's C++ side would refuse and raise KernelArgumentError (a
GraphoptError and a ValueError) in one line: on the H200 image a C++ check failing inside the
extension ended the process instead of raising (see the README's Kernels section), so a bad call
must not reach it."""
from __future__ import annotations

import torch

from graphopt.errors import KernelArgumentError

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ---- reference numerics --------------------------------------------------------------------
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other floating type computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fresh(t: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """A contiguous result that shares no storage with any input (custom ops may not alias)."""
    t = t.contiguous()
    for i in inputs:
        if i is not None and t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr():
            return t.clone()
    return t


def empty_in_layout(like: torch.Tensor, shape, channels_last: bool) -> torch.Tensor:
    """An empty tensor of ``like``'s dtype and device, channels_last or contiguous as asked (an op
    whose ``channels_last`` argument names the layout it writes)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device, memory_format=fmt)


# ---- argument checks -----------------------------------------------------------------------
def check_floating(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in FLOATS:
            raise KernelArgumentError(f"graphopt::{op}: {name} is {t.dtype}; float32, float16 or bfloat16 only")


def check_at_least_1d(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() < 1:
        raise KernelArgumentError(f"graphopt::{op}: {name} needs at least one dim, got a 0-d tensor")


def check_residual(op: str, x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """A residual broadcasts to x's shape (the op expands it)."""
    if residual is None:
        return
    try:
        ok = tuple(torch.broadcast_shapes(tuple(residual.shape), tuple(x.shape))) == tuple(x.shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise KernelArgumentError(f"graphopt::{op}: residual shape {tuple(residual.shape)} does not broadcast to "
                                  f"x's {tuple(x.shape)}")


def check_projection(op: str, x: torch.Tensor, weight: torch.Tensor, rows: str) -> None:
    """x (at least 1-D) times an ``nn.Linear``-layout weight ``[rows, K]`` of x's floating dtype."""
    check_floating(op, x=x, weight=weight)
    check_at_least_1d(op, "x", x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise KernelArgumentError(f"graphopt::{op}: weight must be [{rows}, K] with K = x's last dim "
                                  f"({x.shape[-1]}), got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise KernelArgumentError(f"graphopt::{op}: weight is {weight.dtype}, x is {x.dtype}")


def check_norm_params(op: str, x: torch.Tensor, **params) -> None:
    check_at_least_1d(op, "x", x)
    for name, p in params.items():
        if p is not None and p.numel() != x.shape[-1]:
            raise KernelArgumentError(f"graphopt::{op}: {name} must have {x.shape[-1]} elements (x's last dim), "
                                      f"got shape {tuple(p.shape)}")
