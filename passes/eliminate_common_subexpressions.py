"""eliminate_common_subexpressions: a node that computes what an earlier node already computed (the
same op on the same arguments, and nothing written into those arguments' memory in between) reads
the earlier node's value instead.

A decoder that recomputes a value in every layer from the same inputs computes it once: GLM-4's
partial rotary embedding slices and repeats cos and sin inside each layer, two copy kernels a layer
in a decode step. Only pure ops take part (no in-place or out= op, no random op, nothing with side
effects), and only values whose memory nothing in the graph writes: merging a value that is later
written in place would let the write reach the other value's readers. Arguments are compared by
node and by how many writes their memory has had so far, so a read of a cache before its in-place
update is not merged with a read after it."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register


class _Unhashable(Exception):
    pass


def _pure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable or ir.is_random(node):
        return False
    return not node.is_impure()


def _freeze(value, version: dict, root, canon: dict):
    """A hashable form of a node's arguments: a node as the first node computing its value, with
    the write count of its memory so far."""
    if isinstance(value, fx.Node):
        return ("node", canon.get(value, value), version.get(root(value), 0))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, version, root, canon) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _freeze(v, version, root, canon)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _freeze((value.start, value.stop, value.step), version, root, canon))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Unhashable  # symbolic sizes: equal only when proven, which this pass does not try
    if isinstance(value, float) and value != value:
        raise _Unhashable  # NaN never equals itself
    try:
        hash(value)
    except TypeError as e:
        raise _Unhashable from e
    return (type(value).__name__, value)


@register
class EliminateCommonSubexpressions(Pass):
    name = "eliminate_common_subexpressions"
    family = "cleanup"
    description = "compute once what several pure nodes compute from the same inputs"
    removes_work_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        memo: dict = {}

        def root(n: fx.Node) -> fx.Node:
            return ir.alias_root(n, memo)

        written = {root(w) for n in gm.graph.nodes for w in ir.written_args(n)}
        version: dict = {}     # memory root -> in-place writes into it so far (graph order)
        seen: dict = {}        # argument key -> the first node computing it
        canon: dict = {}       # a duplicate -> that first node
        pairs = []
        for n in gm.graph.nodes:
            if _pure(n) and root(n) not in written:
                try:
                    key = (n.target, _freeze(n.args, version, root, canon), _freeze(n.kwargs, version, root, canon))
                except _Unhashable:
                    key = None
                if key is not None:
                    first = seen.setdefault(key, n)
                    if first is not n:
                        canon[n] = first
                        pairs.append((first, n))
            for w in ir.written_args(n):
                r = root(w)
                version[r] = version.get(r, 0) + 1
        # a chain (a slice, then a repeat of it) matched link by link: each link's key names the
        # first computation of its arguments, so a duplicate left in place (a rewrite limit) still
        # computes the same value as the node its reader is merged with
        for first, dup in pairs:
            def apply(first=first, dup=dup):
                dup.replace_all_uses_with(first)
                gm.graph.erase_node(dup)
                return True

            res.apply_ranked(ctx, [Candidate("common subexpression", [dup], ctx.node_time([dup]), apply,
                                             label=f"{dup.name} computes what {first.name} computed ({ir.target_name(dup)})")],
                             allow_zero_gain=True)
        return res
