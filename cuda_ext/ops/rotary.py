"""graphopt::rotary: rotary embedding of q and k, Llama's rotate_half (``interleaved=False``) or GLM's
pairwise form (``True``), partial rotary (the first R <= D dims of each head rotate, the rest pass
through).

Outputs follow :func:`layout`: a q/k whose heads are closer in memory than its positions (a
projection viewed as heads and transposed, or a slice of a merged QKV projection) gets its output
in that [B, S, H, D] order, so attention over it writes its output in that order and the heads
merge back without a copy. CUDA kernel: ``csrc/rotary.cu`` (reads q/k through their strides).
cos/sin are read in q's dtype, or in float32 when they are float32 and q is half or bfloat16
(fuse_rotary hands a model's float32 rotation between casts of its activations over that way).
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import fused_cost
from graphopt.errors import KernelArgumentError

from ..common import check_floating, compute_dtype
from ..registry import define_op

SCHEMA = "rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)"


def layout(x: torch.Tensor) -> torch.Tensor:
    """An empty output for rotary(x): dense in [B, S, H, D] order when x's heads are closer in memory
    than its positions (a projection viewed as heads and transposed, the usual spelling, or a slice
    of a merged QKV projection), so attention over it writes its output in that order and the heads
    merge back without a copy; else contiguous [B, H, S, D].
    The CUDA op (csrc/rotary.cu rotary_out) and the fake op follow the same rule."""
    if x.dim() == 4 and x.stride(3) == 1 and x.stride(1) < x.stride(2):
        return x.new_empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3])).transpose(1, 2)
    return x.new_empty(x.shape)


def _table(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        if t.shape[1] != 1:
            raise ValueError(f"graphopt::rotary: 4-D cos/sin must be [B, 1, S, R], got {tuple(t.shape)}")
        t = t.squeeze(1)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"graphopt::rotary: cos/sin must be [B or 1, S, R], got {tuple(t.shape)}")
    if t.dtype == torch.float32 and like.dtype in (torch.float16, torch.bfloat16):
        return t  # float32 tables beside half q stay float32 (see the module's docstring)
    return t.to(like.dtype)  # else the activation dtype, as the model casts them


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R = cos.size(-1) dims of every head; dims R..D pass through.
    q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B or 1, S, R] (or [B or 1, 1, S, R])."""
    c, s = _table(cos, q), _table(sin, q)
    R = c.shape[-1]
    if R % 2 or R > q.shape[-1]:
        raise ValueError(f"graphopt::rotary: rotary dim {R} must be even and <= head dim {q.shape[-1]}")
    ct = compute_dtype(q.dtype)
    cf, sf = c.to(ct).unsqueeze(1), s.to(ct).unsqueeze(1)  # [B, 1, S, R]

    def one(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(ct)
        xr, xp = xf[..., :R], xf[..., R:]
        out = torch.cat((xr * cf + _rotate(xr, interleaved) * sf, xp), dim=-1)
        return layout(x).copy_(out)

    return one(q), one(k)


def fake(q, k, cos, sin, interleaved):
    return layout(q), layout(k)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` (any strides) with
    cos/sin ``[B or 1, S, R]`` (``[B or 1, 1, S, R]`` is accepted too), R even and <= D: the
    first R dims of each head rotate, the rest pass through. ``interleaved=False`` is Llama's
    rotate_half, ``True`` GLM's pairwise form. Returns ``(q_out, k_out)`` laid out as
    :func:`layout` says."""
    check_floating("rotary", q=q, k=k)
    if q.dim() != 4 or k.dim() != 4:
        raise KernelArgumentError(f"graphopt::rotary: q and k must be [B, H, S, D], got {tuple(q.shape)} and "
                                  f"{tuple(k.shape)}")
    if q.dtype != k.dtype or (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise KernelArgumentError(f"graphopt::rotary: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} "
                                  "differ in batch, positions, head dim or dtype")
    if tuple(cos.shape) != tuple(sin.shape):
        raise KernelArgumentError(f"graphopt::rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} shapes differ")
    c = cos.squeeze(1) if cos.dim() == 4 and cos.shape[1] == 1 else cos
    if c.dim() != 3 or c.shape[0] not in (1, q.shape[0]) or c.shape[1] != q.shape[2] or c.shape[2] % 2 \
            or c.shape[2] > q.shape[3]:
        raise KernelArgumentError(f"graphopt::rotary: cos/sin must be [1 or {q.shape[0]}, {q.shape[2]}, R] (or "
                                  f"[B, 1, S, R]) with R even and <= {q.shape[3]}, got {tuple(cos.shape)}")
    return torch.ops.graphopt.rotary(q, k, cos, sin, interleaved)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 8, 8), torch.randn(2, 8, 8), False)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=rotary, cost=fused_cost,
               kernel="csrc/rotary.cu", example=example)
