"""graphopt::short_attention: ``scaled_dot_product_attention(q, k, v, mask, is_causal=..., scale=...)``
in inference for at most 256 keys and a head dim of at most 128: grouped queries when q's heads are a
multiple of k's, an additive float or bool mask broadcast through its strides, the top-left causal
triangle; **a fully masked row gives zeros, as SDPA does**. The output is [B, H, S, D] laid out
[B, S, H, D] (:func:`layout`: the head merge after it is a view).

CUDA kernel: ``attention_triton.py``, one Triton program per query tile holding every key (bf16 and
fp16; other dtypes and sizes run the reference). Priced by the profile's fit of it
(``op_efficiency["short_attention"]``: flops of the padded tiles / (peak * scale) + fixed_s), or
at SDPA's attention efficiency where the profile has none.
"""
from __future__ import annotations

import math

import torch

from graphopt.cost.opclass import dtype_of, sdpa_tags
from graphopt.cost.ops import OpCost
from graphopt.cost.profiles import register_legacy_field
from graphopt.errors import KernelArgumentError

from ..attention_triton import blocks, mask_problem, padded_flops, shape_problem
from ..common import check_floating, compute_dtype
from ..registry import define_op

SCHEMA = "short_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal) -> Tensor"


def layout(q: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, S, D] output laid out [B, S, H, D] in memory (the view the kernel returns)."""
    B, H, S, D = q.shape
    return q.new_empty((B, S, H, D)).transpose(1, 2)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              is_causal: bool) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale)`` in
    inference, as the one-tile kernel computes it: scores in fp32 (fp64 for fp64 inputs), a bool
    mask keeps True positions, a float mask is added, ``is_causal`` keeps key j for query i when
    j <= i; the unnormalized probabilities are rounded to v's dtype before the product with v;
    query heads h read key/value head h // (Hq / Hk). A row with every key masked out gives zeros,
    as SDPA does. Output [B, H, Sq, D] laid out [B, Sq, H, D]."""
    ct = compute_dtype(q.dtype)
    H, Hk = q.shape[1], k.shape[1]
    if H != Hk:
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = (q.to(ct) @ k.to(ct).transpose(-1, -2)) * scale
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        keep = keep.tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.to(ct)
    s = s.masked_fill(~keep, -math.inf)
    mx = s.amax(dim=-1, keepdim=True)
    mx = torch.where(mx == -math.inf, torch.zeros((), dtype=ct, device=q.device), mx)
    p = torch.exp(s - mx).masked_fill(~keep, 0.0)
    den = p.sum(-1, keepdim=True)
    o = (p.to(v.dtype).to(ct) @ v.to(ct)) / torch.where(den > 0, den, torch.ones((), dtype=ct, device=q.device))
    return layout(q).copy_(o)


def fake(q, k, v, mask, scale, is_causal):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "graphopt::short_attention: q, k and v must be [batch, heads, sequence, head_dim]")
    return layout(q)


def cuda(q, k, v, mask, scale, is_causal):
    from ..attention_triton import attention_triton, supported

    if supported(tuple(q.shape), tuple(k.shape), q.dtype) is not None:  # fp32, long or odd shapes: correct, slower
        return reference(q, k, v, mask, scale, is_causal)
    return attention_triton(q, k, v, mask, scale, is_causal)


def cost(call, profile):
    """Both products over the kernel's whole padded tiles, causal or not (the unpadded work for
    symbolic sizes); at least the waves of its programs (``wave_s`` each: one program per query
    tile of a head, ``64 // warps`` resident per SM) where the profile measured that."""
    q, k = call.info("q"), call.info("k")
    measured = profile.efficiency("short_attention", "scale") is not None
    wave = profile.efficiency("short_attention", "wave_s")
    floor = None
    try:
        B, H, sq, d = (int(x) for x in q.shape)
        sk = int(k.shape[-2])
    except TypeError:
        flops = 4 * math.prod(q.shape) * k.shape[-2]
    else:
        sms = profile.sm_count or 132
        flops = padded_flops(B, H, sq, sk, d, sms)
        if wave:
            bm, _, warps = blocks(B, H, sq, sk, d, sms)
            floor = -(-(B * H * -(-sq // bm)) // (sms * (64 // warps))) * wave
    return OpCost(flops, call.in_bytes + call.out_bytes, kind="matmul",
                  efficiency="short_attention" if measured else "attention", device_floor_s=floor)


def op_class(call):
    """The class of the attention it replaces (by mask and causality)."""
    return sdpa_tags(dtype_of(call.info("q")), call.arg("mask"), call.arg("is_causal") is True)


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` in inference for short key sequences (at most 256 keys,
    head dim up to 128): q [B, H, Sq, D], k and v [B, Hk, Sk, D] with H a multiple of Hk (grouped
    queries), an additive float or boolean mask broadcastable to [B, H, Sq, Sk]; ``scale``
    defaults to 1/sqrt(D). On CUDA one Triton program per query tile holds every key (bf16/fp16);
    the output is [B, H, Sq, D] laid out [B, Sq, H, D]."""
    check_floating("short_attention", q=q, k=k, v=v)
    why = shape_problem(tuple(q.shape), tuple(k.shape))
    if why is None and (k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]):
        why = f"k and v must both be [{q.shape[0]}, Hk, Sk, {q.shape[3]}], got {tuple(k.shape)} and {tuple(v.shape)}"
    if why is None and mask is not None:
        why = mask_problem(mask.shape, mask.dtype, (*q.shape[:3], k.shape[2]))
    if why is not None:
        raise KernelArgumentError(f"graphopt::short_attention: {why}")
    D = q.shape[3]
    return torch.ops.graphopt.short_attention(q, k, v, mask, D ** -0.5 if scale is None else float(scale),
                                              bool(is_causal))


# profiles written before op_efficiency held this op's fit as fields
register_legacy_field("short_attention_scale", "short_attention", "scale", None)
register_legacy_field("short_attention_fixed_s", "short_attention", "fixed_s", 0.0)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16), torch.rand(2, 1, 1,
            8) > 0.1, 0.125, False)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=short_attention, cost=cost,
               kernel="attention_triton.py", cuda=cuda, op_class=op_class, example=example)
