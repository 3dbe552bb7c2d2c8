"""merge_increments: in-place increments of small integer inputs (a static KV cache's position
counters, ``cumulative_length.add_(T)`` once per layer), each its counter's last access -> one
``_foreach_add_`` at the end of the graph.

A decode step of an L-layer decoder with a StaticCache advances L counters, one ``add_`` kernel
each, spread through the graph. Each counter is read before its add (the layer's cache positions)
and never after it, so its add may run anywhere later: all of them move to the end, one
multi-tensor kernel per (increment, dtype, device).

Legality: ``add_(x, c)`` (``add_.Tensor`` or ``add_.Scalar``, alpha 1) with c an integer literal,
x an integer tensor of at most ``MAX_ELEMENTS`` elements that is (a view of) a graph input, the
add's result unread, and no node after the add reading or writing that input (the output node
aside: it returns the final state either way). Groups of at least two. Only on CUDA profiles: on a
CPU the foreach op is the same loop of adds.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register


aten = torch.ops.aten
ADDS_ = (aten.add_.Tensor, aten.add_.Scalar)
MAX_ELEMENTS = 64


@register
class MergeIncrements(Pass):
    name = "merge_increments"
    family = "fusion"
    description = "in-place integer increments of small inputs (KV-cache positions), each their last access -> one _foreach_add_"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        memo: dict = {}
        last: dict = {}  # input root -> position of its last access (read or write), the output aside
        for n in nodes:
            if n.op == "output":
                continue
            for a in n.all_input_nodes:
                last[ir.alias_root(a, memo)] = order[n]
        groups: dict = {}
        for n in nodes:
            if n.op != "call_function" or n.target not in ADDS_:
                continue
            why, key = self._legal(n, order, last, memo)
            if why:
                res.reject(n.name, why)
                continue
            groups.setdefault(key, []).append(n)
        if not ctx.fused_kernels:  # a CPU profile
            if any(len(g) > 1 for g in groups.values()):
                res.reject_all([n.name for g in groups.values() for n in g],
                               "on a CPU the foreach op is the same loop of adds: nothing to save")
            return res
        candidates = []
        out = next(n for n in reversed(nodes) if n.op == "output")
        for (c, dtype, device), adds in groups.items():
            if len(adds) < 2:
                res.reject(adds[0].name, "the only increment of its kind: nothing to merge")
                continue
            xs = [a.args[0] for a in adds]
            new = ctx.price(aten._foreach_add_.Scalar, xs, c)
            gain = ctx.node_time(adds) - new
            candidates.append(Candidate("increments -> _foreach_add_", adds, gain,
                                        lambda adds=adds, xs=xs, c=c: self._apply(gm, out, adds, xs, c),
                                        label=f"{len(adds)} x add_({c}) ({adds[0].name}, ...)"))
        res.apply_ranked(ctx, candidates)
        return res

    @staticmethod
    def _legal(n, order, last, memo):
        x = n.args[0]
        c = n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
        if n.kwargs.get("alpha", 1) != 1:
            return "alpha is not 1", None
        if not isinstance(c, int) or isinstance(c, bool):
            return "the increment is not an integer literal", None
        xi = ir.info(x) if isinstance(x, fx.Node) else None
        if xi is None or xi.dtype.is_floating_point or xi.dtype.is_complex or xi.dtype == torch.bool:
            return "not an integer tensor", None
        if not isinstance(xi.numel, int) or xi.numel > MAX_ELEMENTS:
            return f"more than {MAX_ELEMENTS} elements", None
        root = ir.alias_root(x, memo)
        if root.op != "placeholder":
            return "not (a view of) a graph input", None
        if n.users and any(u.op != "output" for u in n.users):
            return "its result is read", None
        if last.get(root, -1) > order[n]:
            return "the input is used after it", None
        return "", (c, xi.dtype, xi.device)

    @staticmethod
    def _apply(gm, out, adds, xs, c):
        g = gm.graph
        with g.inserting_before(out):
            merged = g.call_function(aten._foreach_add_.Scalar, (list(xs), c))
        merged.meta["val"] = None
        for a in adds:
            a.replace_all_uses_with(a.args[0])  # the output's reference: the tensor itself, written at the end
            g.erase_node(a)
        return merged
