"""lower_split_k: a small-M, long-K projection feeding a residual LayerNorm -> one batched GEMM over
slices of K whose partial sums the norm adds (``graphopt::linear_add_layer_norm``).

At batch 1 a transformer's FFN down projection (BERT-base: 128 x 768 x 3072) has too few output
tiles to fill the GPU, so cuBLASLt splits K: its GEMM kernel writes fp32 partial products and a
second kernel (``splitKreduce_kernel``) adds them, before the residual add + LayerNorm kernel reads
the result. Here the projection becomes ``bmm`` over S slices of K with fp32 output (S chosen so the
slices' tiles come closest to one per SM, :func:`graphopt.cost.model.split_k_slices`), and the norm
kernel sums the S partials with the bias and the residual before it normalizes: one kernel fewer
per layer, and h is rounded once instead of twice (``benchmarks/diag/diag_splitk.py``).

Matches ``graphopt.add_layer_norm(linear(x, W, b), residual, w, b, eps)`` (fuse_layer_norm's
output) where the norm is the linear's only reader, W is 2-D, the dtypes are fp32/bf16/fp16 and
the shapes are concrete. Only where the cost model expects cuBLASLt to split K
(:func:`graphopt.cost.model.cublas_split_k`): elsewhere (more output tiles than half the SMs, K under 4 N)
there is no reduction kernel to remove and the partials would only add bytes, and the report says
so. The rest is priced: cuBLASLt's reduction kernel and the norm's reads against the partials the
norm reads instead. On a CPU profile every candidate is refused (NO_FUSED_KERNELS).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.cuda_ext.norm_triton import MAX_HIDDEN, SPLIT_K_DTYPES
from graphopt.cuda_ext.ops.linear_add_layer_norm import seconds as linear_norm_seconds
from graphopt.matcher import Any, Op, find, get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import projection_mnk

aten = torch.ops.aten

# the projection may have other readers here: the candidate then says why it is refused
PATTERN = Op(torch.ops.graphopt.add_layer_norm.default,
             Op(aten.linear.default, Any("x"), Any("w"), name="lin", single_use=False),
             Any("residual"), Any("lnw"), Any("lnb"), Any("eps"), name="aln")


@register
class LowerSplitK(Pass):
    name = "lower_split_k"
    family = "lower"
    description = ("small-M, long-K linear -> residual LayerNorm: batched GEMM over K slices, partial sums added "
                   "by the norm (linear_add_layer_norm; cost-gated)")
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        matches = [(m, f"linear {m['lin'].name} -> add_layer_norm {m['aln'].name}") for m in find(gm, PATTERN)]
        res.consider(ctx, matches, lambda m, label: self._candidate(ctx, m, label))
        return res

    def _candidate(self, ctx, m, label: str):
        n, lin, x, w = m["aln"], m["lin"], m["x"], m["w"]
        if len(lin.users) != 1 or any(a is lin for a in n.args[1:]):
            return "the projection's output is also read elsewhere (the norm would have to write it)", None
        b = get_arg(lin, 2, "bias")
        why, mnk = projection_mnk(x, w, lin, SPLIT_K_DTYPES, "the slices are chosen for one size")
        if why:
            return why, None
        M, N, K, _ = mnk
        if N > MAX_HIDDEN:
            return f"rows wider than {MAX_HIDDEN} (the norm kernel's limit)", None
        if not ctx.cost.cublas_split_k(M, N, K):
            return (f"cuBLASLt runs this {M} x {N} x {K} projection without split-K (enough output tiles, or K "
                    f"under 4 N): no reduction kernel to remove, the partials would only add bytes"), None
        splits = ctx.cost.split_k_slices(M, N, K)
        if splits == 1:
            return (f"no split of K={K} into 2-8 slices at least 256 deep and 16-byte aligned brings its "
                    f"{M} x {N} output closer to one tile per SM"), None
        residual, lnw, lnb, eps = m["residual"], m["lnw"], m["lnb"], m["eps"]
        new = ctx.price(torch.ops.graphopt.linear_add_layer_norm.default, x, w, b, residual, lnw, lnb, eps, splits,
                        val=n.meta.get("val"))
        gain = ctx.node_time([lin, n]) - new
        return "", Candidate(f"linear -> residual layer_norm: {splits} K slices, partials summed by the norm",
                             [lin, n], gain, lambda: self._apply(ctx, n, lin, x, w, b, residual, lnw, lnb, eps, splits),
                             label=label)

    @staticmethod
    def _apply(ctx, n, lin, x, w, b, residual, lnw, lnb, eps, splits):
        g = n.graph
        with g.inserting_before(n):
            new = g.call_function(torch.ops.graphopt.linear_add_layer_norm.default,
                                  (x, w, b, residual, lnw, lnb, eps, splits))
        new.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(new)
        g.erase_node(n)
        g.erase_node(lin)
        return new
