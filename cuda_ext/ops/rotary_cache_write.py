"""graphopt::rotary_cache_write: rotary embedding of q and k (``graphopt::rotary``'s forms), and
the rotated k and v written into a K/V cache in place at the step's positions, in one kernel.

Replaces, in a decode (or prefill) step with a static cache, ``rotary(q, k, cos, sin)`` followed
by ``k_cache.index_copy_(2, idx, k_rot)`` and ``v_cache.index_copy_(2, idx, v)`` with
``idx = arange(T) + start`` (``fuse_cache_write``): ``pos`` is that 0-dim ``start``, or the
``[T]`` positions themselves. Returns q rotated, laid out as ``ops/rotary.layout`` says (the
heads merge back after attention without a copy); k_cache and v_cache are written, nothing else
is. A position outside the cache is not written. CUDA kernel: ``rotary_cache_write_triton.py``
(one program per head row of q, k or v); fp32, fp16 and bf16.
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from .. import rotary_cache_write_triton as rcw
from ..common import check_floating
from ..registry import define_op
from . import rotary as rot

SCHEMA = ("rotary_cache_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor pos, bool interleaved) -> Tensor")


def positions(pos: torch.Tensor, T: int) -> torch.Tensor:
    """The T cache positions: ``pos + arange(T)`` for a 0-dim start, else ``pos``."""
    if pos.dim() == 0:
        return pos.to(torch.long) + torch.arange(T, device=pos.device)
    return pos.to(torch.long)


def reference(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved):
    """rotary(q, k, cos, sin) -> (q_out, k_rot); k_rot and v written at positions(pos, T) of the
    caches' third dim (those inside the cache); returns q_out."""
    q_out, k_rot = rot.reference(q, k, cos, sin, interleaved)
    idx = positions(pos, k.shape[2])
    keep = (idx >= 0) & (idx < k_cache.shape[2])
    if not bool(keep.all()):
        sel = keep.nonzero().flatten()
        idx, k_rot, v = idx[sel], k_rot.index_select(2, sel), v.index_select(2, sel)
    k_cache.index_copy_(2, idx, k_rot.to(k_cache.dtype))
    v_cache.index_copy_(2, idx, v.to(v_cache.dtype))
    return q_out


def fake(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved):
    return rot.layout(q)


def cuda_impl(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved):
    """The Triton kernel for fp32/fp16/bf16 and head dims up to rcw.MAX_HEAD_DIM, else the reference."""
    if q.dtype not in rcw.DTYPES or max(q.shape[3], v.shape[3]) > rcw.MAX_HEAD_DIM:
        return reference(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved)
    return rcw.rotary_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved, rot.layout(q))


def cost(call, profile):
    """q, k, v, cos, sin and pos read once; q's output and k's and v's rows in the caches written
    once (the caches themselves are not read)."""
    reads = sum(i.nbytes for i in (call.info(n) for n in ("q", "k", "v", "cos", "sin", "pos")) if i is not None)
    writes = sum(call.info(n).nbytes for n in ("q", "k", "v"))
    q, k = call.info("q"), call.info("k")
    return OpCost(3 * (q.numel + k.numel), reads + writes)


def problem(q, k, v, cos, sin, k_cache, v_cache, pos) -> str | None:
    """Why the op does not take these arguments (None: it does)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            return f"{name} must be [B, H, T or L, D], got {tuple(t.shape)}"
    B, _, T, D = q.shape
    if q.dtype != k.dtype or (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D):
        return f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} differ in batch, positions, head dim or dtype"
    if (v.shape[0], v.shape[1], v.shape[2]) != (B, k.shape[1], T):
        return f"v {tuple(v.shape)} must be [{B}, {k.shape[1]}, {T}, Dv]"
    if tuple(k_cache.shape[:2]) != (B, k.shape[1]) or k_cache.shape[3] != D:
        return f"k_cache {tuple(k_cache.shape)} must be [{B}, {k.shape[1]}, L, {D}]"
    if tuple(v_cache.shape[:2]) != (B, k.shape[1]) or v_cache.shape[3] != v.shape[3] \
            or v_cache.shape[2] != k_cache.shape[2]:
        return f"v_cache {tuple(v_cache.shape)} must be [{B}, {k.shape[1]}, {k_cache.shape[2]}, {v.shape[3]}]"
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        return f"the caches ({k_cache.dtype}, {v_cache.dtype}) must have k's and v's dtypes ({k.dtype}, {v.dtype})"
    if tuple(cos.shape) != tuple(sin.shape):
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} shapes differ"
    c = rcw.table(cos) if cos.dim() == 4 and cos.shape[1] == 1 else cos
    if c.dim() != 3 or c.shape[0] not in (1, B) or c.shape[1] != T or c.shape[2] % 2 or c.shape[2] > D:
        return (f"cos/sin must be [1 or {B}, {T}, R] (or [B, 1, T, R]) with R even and <= {D}, got "
                f"{tuple(cos.shape)}")
    if pos.dtype not in (torch.int32, torch.int64) or not (pos.dim() == 0 or tuple(pos.shape) == (T,)):
        return f"pos must be an int32/int64 start (0-dim) or {T} positions, got {tuple(pos.shape)} {pos.dtype}"
    devices = {t.device for t in (q, k, v, cos, sin, k_cache, v_cache, pos)}
    if len(devices) > 1:
        return f"the tensors are on several devices ({', '.join(sorted(map(str, devices)))})"
    return None


def shared_memory(q, k, v, k_cache, v_cache) -> str | None:
    """Which cache shares memory with an input it is written from, or with the other cache (real
    tensors: the wrapper's check; the pass proves it from the graph)."""
    if k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr():
        return "k_cache and v_cache share memory"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        for src in (q, k, v):
            if cache.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                return f"{name} shares memory with an input it is written from"
    return None


def rotary_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                       interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of q [B, Hq, T, D] and k [B, Hkv, T, D] (``rotary``'s cos/sin and forms);
    the rotated k and v [B, Hkv, T, Dv] written into k_cache [B, Hkv, L, D] and v_cache
    [B, Hkv, L, Dv] in place at positions ``pos + t`` (``pos`` 0-dim) or ``pos[t]`` (``pos`` [T]).
    Returns the rotated q."""
    check_floating("rotary_cache_write", q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    why = problem(q, k, v, cos, sin, k_cache, v_cache, pos) or shared_memory(q, k, v, k_cache, v_cache)
    if why is not None:
        raise KernelArgumentError(f"graphopt::rotary_cache_write: {why}")
    return torch.ops.graphopt.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, pos, bool(interleaved))


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 4, 1, 16), torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), torch.randn(2, 1, 8),
            torch.randn(2, 1, 8), torch.zeros(2, 2, 12, 16), torch.zeros(2, 2, 12, 16), torch.tensor(3), False)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=rotary_cache_write, cost=cost,
               kernel="rotary_cache_write_triton.py", cuda=cuda_impl, example=example)
