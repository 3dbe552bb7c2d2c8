"""eliminate_dead_code: remove pure nodes whose results nobody reads."""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register


def _enters_or_leaves_a_transform(node: fx.Node) -> bool:
    """functorch's ``_vmap_increment_nesting`` / ``_vmap_decrement_nesting`` (and the other transforms'),
    which torch.export records where a forward calls torch.vmap (transformers' mask functions): nothing
    reads their results, but the batch-dim ops between them need the level they push."""
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and name.endswith(("_increment_nesting", "_decrement_nesting")) \
        and "functorch" in (getattr(node.target, "__module__", "") or "")


def _removable(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method", "call_module", "get_attr") or node.users:
        return False
    if _enters_or_leaves_a_transform(node):
        return False
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = ir.op_name(node)
        if node.target._schema.is_mutable or "_assert" in name or "print" in name:
            return False
        if ir.is_random(node):
            # dropping an unused random op changes the RNG stream of later random ops
            return False
    return not node.is_impure()


@register
class EliminateDeadCode(Pass):
    name = "eliminate_dead_code"
    family = "cleanup"
    description = "remove pure nodes whose results are never used"
    removes_work_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        while True:
            dead = [n for n in gm.graph.nodes if _removable(n)]
            if not dead:
                break
            applied = len(res.rewrites)
            for node in reversed(dead):
                gain = ctx.node_time([node])

                def apply(node=node):
                    gm.graph.erase_node(node)
                    return True

                res.apply_ranked(ctx, [Candidate("dead node", [node], gain, apply, label=f"{node.name} ({node.target})")],
                                 allow_zero_gain=True)
            if len(res.rewrites) == applied:  # none removed this round (a rewrite limit): the rest stay
                break
        return res
