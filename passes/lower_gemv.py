"""lower_gemv: a projection of at most 16 rows (a decode step's tokens) -> ``graphopt::gemv``, the
split-K Triton GEMV (cuda_ext/gemv_triton.py), where the profile's measurements say it is faster
than cuBLAS.

Legality: ``aten.linear(x, W, b)`` in an inference graph with x ``[..., K]`` of at most
``MAX_M`` rows (static), W ``[N, K]``, b ``[N]`` or none, all fp16/bf16 of one dtype on one device.

Profitability: the op priced by the cost model at the profile's ``op_efficiency["gemv"]``
against the linear at ``op_efficiency["small_m_linear"]`` (cuBLAS at the same M), both fitted by
``benchmarks/diag/diag_decode_gemm.py`` on the device. Without a ``gemv`` entry the op prices
itself as cuBLAS plus its partial sums, so nothing is lowered on a guess. On a CPU profile every
candidate is refused (NO_FUSED_KERNELS).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register


aten = torch.ops.aten


def _few_rows(n: fx.Node) -> bool:
    """The linear's x has at most MAX_M rows (static): the projections this pass is about."""
    from graphopt.cuda_ext.gemv_triton import MAX_M

    xi = ir.info(n.args[0]) if isinstance(n.args[0], fx.Node) else None
    try:
        return xi is not None and 0 < int(math.prod(xi.shape[:-1])) <= MAX_M
    except TypeError:
        return False


@register
class LowerGemv(Pass):
    name = "lower_gemv"
    family = "lower"
    description = "linear of <= 16 rows (decode) -> graphopt::gemv (split-K Triton GEMV), where measured faster"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        linears = [(n, n.name) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is aten.linear.default and _few_rows(n)]
        res.consider(ctx, linears, lambda n, label: self._candidate(gm, ctx, n))
        return res

    def _candidate(self, gm, ctx, n):
        from graphopt.cuda_ext.gemv_triton import DTYPES

        x, w = n.args[0], n.args[1]
        b = get_arg(n, 2, "bias")
        infos = [ir.info(a) if isinstance(a, fx.Node) else None for a in (x, w)]
        if any(i is None for i in infos) or (b is not None and not isinstance(b, fx.Node)):
            return "an operand is not a tensor with metadata", None
        xi, wi = infos
        if len(wi.shape) != 2:
            return f"the weight is {len(wi.shape)}-D", None
        M = int(math.prod(xi.shape[:-1]))  # static and <= MAX_M (_few_rows)
        dtypes = {xi.dtype, wi.dtype} | ({ir.info(b).dtype} if b is not None else set())
        if len(dtypes) != 1 or xi.dtype not in DTYPES:
            return f"dtypes {sorted(map(str, dtypes))}: fp16 or bf16, one dtype", None
        new = ctx.price(torch.ops.graphopt.gemv.default, x, w, b, val=n.meta["val"])
        old = ctx.node_time([n])
        N, K = wi.shape
        if new >= old:
            return (f"predicted {new * 1e6:.1f} us against cuBLAS's {old * 1e6:.1f} us (op_efficiency 'gemv' "
                    "measured by benchmarks/diag/diag_decode_gemm.py prices it; unmeasured it is priced as cuBLAS "
                    "plus its partial sums)"), None
        return "", Candidate(f"linear {M}x{N}x{K} -> gemv", [n], old - new, lambda: self._apply(n, x, w, b),
                             label=f"{n.name} ({M}x{N}x{K})")

    @staticmethod
    def _apply(n, x, w, b):
        g = n.graph
        with g.inserting_before(n):
            new = g.call_function(torch.ops.graphopt.gemv.default, (x, w, b))
        new.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(new)
        g.erase_node(n)
        return new
