"""lower_bias_grad: in a training graph, a linear layer whose bias takes a gradient -> the same
product as ``graphopt::biased_linear``, whose backward sums the output gradient over its rows as a
product with a ones vector (cuBLAS's matrix-vector product) instead of aten's reduction.

Matches ``linear(x, W, b)`` and ``addmm(b, x, W)`` (beta = alpha = 1: GPT-2's ``Conv1D``) with a
1-D bias that requires grad and x, W, b of one floating dtype. The forward is unchanged (the same
cuBLAS GEMM with the bias in its epilogue); the backward's two GEMMs are the products aten's addmm
backward runs. What the cost model prices is the bias gradient: aten's sum of the output gradient
over its leading dims against ``ones[1, R] @ g[R, N]``, a one-row matmul, each at the rate the profile
measured.
Training graphs only (in inference there is no backward to change), and only where the step will be
replayed from CUDA graphs (graphopt.runtime.training_graphs): run eagerly, the op's autograd in Python
costs more host time a call than the reduction saves (BERT-base's step became host-bound), so a graph
with checkpointed regions, a buffer written in place or dynamic shapes, or ``cuda_graphs=False``, keeps
aten's linear. On a CPU profile every candidate is refused (NO_FUSED_KERNELS).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Alt, Any, Const, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register
from graphopt.replay import training_replay_refusal

from ._fusion_meta import requires_grad

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _node(v) -> bool:
    return isinstance(v, fx.Node)


PATTERN = Alt(
    Op(aten.linear.default, Any("x"), Any("w"), Any("b", pred=_node), name="lin", single_use=False),
    Op(aten.addmm.default, Any("b", pred=_node), Any("x"), Any("w"),
       kwargs={"beta": Const(value=1), "alpha": Const(value=1)}, name="lin", single_use=False),
)


@register
class LowerBiasGrad(Pass):
    name = "lower_bias_grad"
    family = "lower"
    description = "training: linear/addmm whose bias takes a gradient -> biased_linear (bias gradient as ones @ grad; cost-gated)"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        if not ctx.training:
            return res
        eager = training_replay_refusal(gm, cuda_graphs=ctx.options.cuda_graphs, dynamic=bool(ctx.options.dynamic))
        grad = requires_grad(gm)
        # a bias that takes no gradient has nothing in its backward to change
        matches = [((m["lin"], m["x"], m["w"], m["b"], m["lin"].target is aten.addmm.default),
                    f"{ir.op_name(m['lin'])} {m['lin'].name}")
                   for m in find(gm, PATTERN) if grad.get(m["b"], False)]
        if eager is not None and matches:
            res.reject_all([label for _, label in matches],
                           f"the step runs eagerly ({eager}): biased_linear's autograd in Python costs more host "
                           "time a call than the faster reduction saves")
            return res
        res.consider(ctx, matches, lambda m, label: self._candidate(ctx, m, label))
        return res

    def _candidate(self, ctx: PassContext, m, label: str):
        n, x, w, b, weight_t = m
        infos = [ir.info(a) if isinstance(a, fx.Node) else None for a in (x, w, b)]
        out = ir.info(n)
        if any(i is None for i in infos) or out is None:
            return "an operand without a known shape", None
        xi, wi, bi = infos
        if not (xi.dtype == wi.dtype == bi.dtype and xi.dtype in FLOATS):
            return f"operands of mixed or non-float dtypes ({xi.dtype}, {wi.dtype}, {bi.dtype})", None
        if len(wi.shape) != 2 or len(bi.shape) != 1 or len(xi.shape) < 1 or (weight_t and len(xi.shape) != 2):
            return "not a 2-D weight with a 1-D bias", None
        lead = list(range(len(out.shape) - 1))
        if not lead:
            return "a 1-D output: its bias gradient is the output gradient itself", None
        eager = ctx.replacement()
        eager.call(aten.sum.dim_IntList, n, lead)
        ours = ctx.replacement()
        width = out.shape[-1]
        rows = out.numel // width
        ones = ours.tensor((1, rows), out.dtype, out.device)
        ours.call(aten.mm.default, ones, ours.call(aten.view.default, n, [rows, width]))
        gain = eager.time() - ours.time()
        return "", Candidate("linear bias gradient -> ones @ grad", [n], gain,
                             lambda: self._apply(n, x, w, b, weight_t), label=label)

    @staticmethod
    def _apply(n, x, w, b, weight_t):
        g = n.graph
        with g.inserting_before(n):
            new = g.call_function(torch.ops.graphopt.biased_linear.default, (x, w, b, weight_t))
        new.meta.update({k: v for k, v in n.meta.items() if k in ("val", "tensor_meta", "stack_trace", "nn_module_stack")})
        n.replace_all_uses_with(new)
        g.erase_node(n)
        return new
