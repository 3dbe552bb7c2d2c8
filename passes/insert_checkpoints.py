"""insert_checkpoints: fit a training step into a memory budget by recomputing activations.

Training graphs only, and only when a ``memory_budget`` is set (``graphopt.optimize(...,
training=True, memory_budget=0.4)``: a fraction of the baseline step's activation memory — saved
tensors, outputs and the backward's working set — or bytes). The planning and both rewrites
(``checkpoint_backend``: "auto" | "aot" | "sac") are :mod:`graphopt.checkpoint`'s; this pass
hands them the run's options and, for the AOT backend's forward and backward graphs, pointwise
fusion by ``fuse_elementwise`` when that pass is scheduled and the plan is for a GPU.
"""

from __future__ import annotations

import torch.fx as fx

from graphopt import checkpoint
from graphopt.pipeline import Pass, PassContext, PassResult, register


def training_fuser(ctx: PassContext):
    """fuse_elementwise for the AOT backend's forward and backward graphs, or None.

    The pass also fuses the training graph itself (fused_pointwise is differentiable, and
    AOTAutograd traces through it); the AOT graphs run without autograd (AOTAutograd already
    split forward from backward), so the pointwise chains the joint graphs make (the derivatives
    of ops no group took, the recomputed ones) can run as generated kernels too. Done when fuse_elementwise is one of
    this run's passes and the plan is for a GPU; the cost model decides each group as it does
    for inference."""
    if "fuse_elementwise" not in ctx.scheduled or not ctx.fused_kernels:
        return None
    from .fuse_elementwise import FuseElementwise

    def fuse(g: fx.GraphModule) -> int:
        sub = PassContext(cost=ctx.cost, training=True, verify=False)
        r = FuseElementwise().run(g, sub)
        g.graph.lint()
        g.recompile()
        return len(r.rewrites)

    return fuse


@register
class InsertCheckpoints(Pass):
    name = "insert_checkpoints"
    family = "checkpoint"
    description = ("training under a memory budget: recompute the activations cheapest per byte "
                   "(an AOTAutograd graph rewrite, or torch.utils.checkpoint with a selective policy) "
                   "until the step fits")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        budget = checkpoint.option(ctx, "memory_budget")
        if not ctx.training:
            res.notes.append("inference graph: autograd saves nothing, so there is nothing to checkpoint")
            return res
        if budget is None:
            res.notes.append("no memory_budget set: activations are kept as autograd saves them")
            return res
        cp = checkpoint.plan_checkpoints(gm, ctx, budget, checkpoint.option(ctx, "checkpoint_backend"))
        checkpoint.apply_plan(gm, ctx, cp, res, fuser=training_fuser(ctx))
        return res
