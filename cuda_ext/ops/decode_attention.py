"""graphopt::decode_attention: attention of a few query positions (a decode step, or up to
``MAX_TQ`` speculative tokens) over a key/value cache, split along the keys.

``scaled_dot_product_attention(q, k, v, mask, scale=scale)`` in inference: q [B, Hq, Tq, D] over
k, v [B, Hkv, L, D] with Hq a multiple of Hkv (grouped queries), a bool (True = attend) or additive
mask broadcastable to [B, Hq, Tq, L], and an optional ``kv_len`` (int32/int64, 1 or B values on q's
device): keys at or past kv_len[b] are not read, so inside a replayed CUDA graph the work follows
the real past length. A row with every key excluded gives zeros, as SDPA does. The output is
[B, Hq, Tq, D] laid out [B, Tq, Hq, D] (the head merge after it is a view).

CUDA kernel: ``decode_attention_triton.py``, flash-decoding in two Triton kernels (one program per
batch row, K/V head and split reads each K/V block once for its query group; a second combines the
splits by log-sum-exp; one launch when there is one split). bf16/fp16; other dtypes and shapes run
the reference. Priced as one pass over q, the whole cache (kv_len is a run-time value), the mask,
the output and the split partials, memory-bound.
"""
from __future__ import annotations

import math

import torch

from graphopt.cost.opclass import dtype_of, sdpa_tags
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from .. import decode_attention_triton as dat
from ..registry import define_op

SCHEMA = "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? kv_len, float scale) -> Tensor"


def cost(call, profile):
    q, k = call.info("q"), call.info("k")
    extra = sum(i.nbytes for i in (call.info("mask"), call.info("kv_len")) if i is not None)
    try:
        flops, nbytes, launches = dat.cost(q.shape, k.shape, q.dtype.itemsize, extra, 0, profile.sm_count or 132)
    except TypeError:  # symbolic sizes: one pass over q, the cache and the output
        return OpCost(4 * math.prod(q.shape) * k.shape[-2], call.in_bytes + call.out_bytes, launches=2, kind="matmul")
    # memory-bound at the plain roofline; the combine kernel adds its own fixed time
    return OpCost(flops, nbytes, launches=launches, kind="matmul", efficiency="memory",
                  extra_s=(launches - 1) * profile.kernel_fixed_s)


def op_class(call):
    """The class of the attention it replaces (by mask; a decode step's queries see every key)."""
    return sdpa_tags(dtype_of(call.info("q")), call.arg("mask"), False)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     kv_len: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of a few query positions q [B, Hq, Tq, D] over a key/value cache k, v
    [B, Hkv, L, D] (Hq a multiple of Hkv), with an optional bool or additive mask and an optional
    ``kv_len`` bounding the keys read; ``scale`` defaults to 1/sqrt(D)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise KernelArgumentError("graphopt::decode_attention: q, k and v must be tensors")
    why = dat.check(q, k, v, mask, kv_len)
    if why is not None:
        raise KernelArgumentError(f"graphopt::decode_attention: {why}")
    return torch.ops.graphopt.decode_attention(q, k, v, mask, kv_len,
                                               q.shape[3] ** -0.5 if scale is None else float(scale))


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16), torch.rand(2, 1, 1,
            8) > 0.1, None, 0.125)


OP = define_op(SCHEMA, reference=dat.reference, fake=dat.fake, wrapper=decode_attention, cost=cost,
               kernel="decode_attention_triton.py", cuda=dat.cuda_impl, op_class=op_class, example=example)
