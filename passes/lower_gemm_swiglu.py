"""lower_gemm_swiglu: a SwiGLU MLP's merged gate/up projection and its activation -> one Triton GEMM
whose epilogue applies the activation (``graphopt::gemm_swiglu``).

After merge_sibling_linears and fuse_swiglu a SwiGLU MLP (GLM-4, Llama) runs ``gate_up = linear(x,
W)`` (cuBLAS), then ``graphopt.swiglu(gate_up)``, a memory-bound kernel that reads the [M, 2n]
product and writes the [M, n] activation. Here a persistent TMA GEMM (``cuda_ext/gemm_triton.py``)
computes the product tile by tile into fp32 accumulators and its epilogue stores ``silu(gate) * up``:
the [M, 2n] product is never written or read and the projection is not rounded before the
activation. Two weight layouts (``graphopt::gemm_swiglu``'s ``block``):

* interleaved (``block = 128``): W's gate and up rows reordered once into blocks of the tile's width,
  so one tile load holds matching gate and up rows; the faster kernel, but a copy of W beside the
  model's, so it is counted against the weight-copy budget (``weight_copies``);
* halves (``block = 0``): W = cat([Wg, Wu]) as the model holds it, gate and up rows loaded through
  two TMA descriptors into two accumulators; no copy, a slower kernel, priced at its own measured
  rate (the profile's ``op_efficiency["gemm_swiglu_halves"]``).

The interleaved candidate falls back to the halves one when the budget refuses the copy;
``benchmarks/diag/diag_swiglu_layout.py`` times both and cuBLAS.

Matches ``graphopt.swiglu(linear(x, W))`` where the projection has no bias and no other reader, x
and W are fp16 or bf16, K and n are multiples of 8 (TMA's 16-byte rows) and the shapes are
concrete. Priced against the GEMM + swiglu pair with the cost model's GEMM rate times the
persistent kernel's idle last round (:func:`graphopt.cuda_ext.ops.gemm_swiglu.persistent_rounds_factor`), so
few-row projections, where that round costs more than the swiglu kernel it removes, stay on cuBLAS.
Refused on CPU profiles (NO_FUSED_KERNELS) and on GPUs before sm_90 (no TMA), each with the reason
in the report.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_ext.gemm_triton import HALVES, SWIGLU_BLOCK, SWIGLU_DTYPES
from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up
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
        if not isinstance(w, fx.Node):
            return "the weight is not a tensor of the graph", None
        why, mnk = projection_mnk(x, w, lin, SWIGLU_DTYPES, "the kernel's tile rounds are priced for one size")
        if why:
            return why, None
        M, rows, K, dtype = mnk
        n = rows // 2
        if K % 8 or n % 8 or not M:
            return f"K={K} and n={n} must be non-zero multiples of 8 (TMA loads and stores 16-byte rows)", None
        before = ctx.node_time([lin, sw])
        # the interleaved layout (a reordered copy of the weight, the faster kernel) where the weight-copy
        # budget allows it; else the halves layout over the weight as it is, priced at its own measured rate
        padded = 2 * (-(-n // SWIGLU_BLOCK) * SWIGLU_BLOCK)

        def fused_time(rows_, block):
            r = ctx.replacement()
            w_like = r.tensor((rows_, K), dtype, ir.info(w).device)
            r.call(torch.ops.graphopt.gemm_swiglu.default, x, w_like, n, block, val=sw.meta.get("val"))
            return r.time()

        halves = Candidate(f"linear -> swiglu: one {M} x {K} x {rows} GEMM with the activation in its epilogue "
                           "(the weight as it is)", [lin, sw], before - fused_time(rows, HALVES),
                           lambda: self._apply(gm, sw, lin, x, w, n, HALVES), label=label)
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):  # not a constant: its rows cannot be reordered
            return "", halves
        inter_t = fused_time(padded, SWIGLU_BLOCK)
        return "", Candidate(f"linear -> swiglu: one {M} x {K} x {padded} GEMM with the activation in its epilogue",
                             [lin, sw], before - inter_t, lambda: self._apply(gm, sw, lin, x, w, n, SWIGLU_BLOCK),
                             label=label, constant_bytes=padded * K * dtype.itemsize, fallback=halves)

    @staticmethod
    def _apply(gm, sw, lin, x, w, n, block):
        g = sw.graph
        w_in = w
        if block != HALVES:
            with torch.no_grad():
                wi = interleave_gate_up(ir.get_attr_value(gm, w.target).detach(), block)
            name = ir.register_constant(gm, f"{lin.name}_gate_up_interleaved", wi)
            with g.inserting_before(sw):
                w_in = g.get_attr(name)
            set_meta(gm, [w_in])
        with g.inserting_before(sw):
            new = g.call_function(torch.ops.graphopt.gemm_swiglu.default, (x, w_in, n, block))
        new.meta["val"] = sw.meta.get("val")
        sw.replace_all_uses_with(new)
        g.erase_node(sw)
        g.erase_node(lin)
        if w_in is not w and isinstance(w, fx.Node) and not w.users:
            g.erase_node(w)
        return new
