"""lower_gemm_swiglu: a SwiGLU MLP's merged gate/up projection and its activation -> one Triton GEMM
whose epilogue applies the activation (``graphopt::gemm_swiglu``).

After merge_sibling_linears and fuse_swiglu a SwiGLU MLP (GLM-4, Llama) runs ``gate_up = linear(x,
W)`` (cuBLAS), then ``graphopt.swiglu(gate_up)``, a memory-bound kernel that reads the [M, 2n]
product and writes the [M, n] activation: at GLM-4-9B bs8 (8192 x 4096 x 27392) 0.164 ms a layer at
the copy rate, after a 2.77 ms GEMM. Here W's gate and up rows are interleaved once, at
optimization time, in blocks of the GEMM's output tile width, so each [128, 256] tile of a
persistent TMA GEMM (``cuda_ext/gemm_triton.py``) holds matching gate and up columns and stores
``silu(gate) * up`` from its fp32 accumulator: the [M, 2n] product is never written or read, and
the projection is not rounded before the activation. On the H200, run back to back for 3 s
(``benchmarks/results/diag_swiglu_gemm_2026-11-30_185919.md``), the MLP took 4.085 ms against
4.289 (cuBLAS GEMM + swiglu + cuBLAS down projection); the fused GEMM ran at 807 TFLOP/s in a burst
where cuBLAS's gate/up GEMM alone ran at 800.

The reordered weight is a copy (merge_sibling_linears' concatenations are too): 224 MB a layer at
GLM-4-9B, alive beside the original model's weight for as long as the caller keeps that model
(run_models' GLM bs8 peak: 8.28 GB, 7.41 before).

Matches ``graphopt.swiglu(linear(x, W))`` where the projection has no bias and no other reader, W
is a constant 2-D weight (a parameter or buffer: its rows are reordered here), x and W are fp16 or
bf16, K and n are multiples of 8 (TMA's 16-byte rows) and the shapes are concrete. Priced against
the GEMM + swiglu pair with the cost model's GEMM rate times the persistent kernel's idle last round
(:func:`graphopt.cost.model.persistent_rounds_factor`: 1.002 at GLM-4 bs8, 1.079 at bs1, where the
swiglu kernel it removes is small), so few-row projections stay on cuBLAS. Refused on CPU profiles
(NO_FUSED_KERNELS) and on GPUs before sm_90 (no TMA), each with the reason in the report.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_ext.gemm_triton import SWIGLU_BLOCK, SWIGLU_DTYPES
from graphopt.cuda_ext.reference import interleave_gate_up
from graphopt.matcher import Any, Op, find, get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import projection_mnk, set_meta

aten = torch.ops.aten

# the projection may have other readers here: the candidate then says why it is refused
PATTERN = Op(torch.ops.graphopt.swiglu.default,
             Op(aten.linear.default, Any("x"), Any("w"), name="lin", single_use=False), name="sw")


@register
class LowerGemmSwiglu(Pass):
    name = "lower_gemm_swiglu"
    family = "lower"
    requires = ("fuse_swiglu",)
    description = ("merged gate/up linear -> swiglu: one Triton GEMM whose epilogue applies the activation "
                   "(gemm_swiglu; sm_90+, cost-gated)")
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        matches = [(m, f"linear {m['lin'].name} -> swiglu {m['sw'].name}") for m in find(gm, PATTERN)]
        res.consider(ctx, matches, lambda m, label: self._candidate(gm, ctx, m, label))
        return res

    def _candidate(self, gm, ctx, m, label: str):
        sw, lin, x, w = m["sw"], m["lin"], m["x"], m["w"]
        cc = ctx.cost.compute_capability
        if cc < (9, 0):
            got = f"sm_{cc[0]}{cc[1] if len(cc) > 1 else 0}" if cc else "an unknown compute capability"
            return f"the Triton GEMM loads through TMA (sm_90 or newer); {ctx.cost.device_name} has {got}", None
        if len(lin.users) != 1:
            return "the projection's output is also read elsewhere (the fused GEMM does not write it)", None
        if get_arg(lin, 2, "bias") is not None:
            return "the projection has a bias (the fused GEMM adds none)", None
        if not isinstance(w, fx.Node) or w.op != "get_attr":
            return "the weight is not a constant of the graph (its rows are reordered at optimization time)", None
        why, mnk = projection_mnk(x, w, lin, SWIGLU_DTYPES, "the kernel's tile rounds are priced for one size")
        if why:
            return why, None
        M, rows, K, dtype = mnk
        n = rows // 2
        if K % 8 or n % 8 or not M:
            return f"K={K} and n={n} must be non-zero multiples of 8 (TMA loads and stores 16-byte rows)", None
        padded = 2 * (-(-n // SWIGLU_BLOCK) * SWIGLU_BLOCK)  # the interleaved weight's rows
        r = ctx.replacement()
        w_like = r.tensor((padded, K), dtype, ir.info(w).device)  # the interleaved weight
        r.call(torch.ops.graphopt.gemm_swiglu.default, x, w_like, n, SWIGLU_BLOCK, val=sw.meta.get("val"))
        gain = ctx.node_time([lin, sw]) - r.time()
        return "", Candidate(f"linear -> swiglu: one {M} x {K} x {padded} GEMM with the activation in its epilogue",
                             [lin, sw], gain, lambda: self._apply(gm, sw, lin, x, w, n), label=label)

    @staticmethod
    def _apply(gm, sw, lin, x, w, n):
        g = sw.graph
        with torch.no_grad():
            wi = interleave_gate_up(ir.get_attr_value(gm, w.target).detach(), SWIGLU_BLOCK)
        name = ir.register_constant(gm, f"{lin.name}_gate_up_interleaved", wi)
        with g.inserting_before(sw):
            w_node = g.get_attr(name)
            new = g.call_function(torch.ops.graphopt.gemm_swiglu.default, (x, w_node, n, SWIGLU_BLOCK))
        set_meta(gm, [w_node])
        new.meta["val"] = sw.meta.get("val")
        sw.replace_all_uses_with(new)
        g.erase_node(sw)
        g.erase_node(lin)
        if not w.users:
            g.erase_node(w)
        return new
