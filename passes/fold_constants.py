"""fold_constants: evaluate subgraphs that read only parameters, buffers and literals once, at
optimization time, and store the result as a buffer.

Never folds random or uninitialised-memory ops, never in training mode across a trainable
parameter (its gradient would be lost), never on meta (a constant there holds no values), and
refuses to store a large constant that is much bigger than what it is computed from (an
``expand`` turned into memory).

Also removes ``cat`` of an empty constant and one other operand (Hugging Face's KV cache appending
the new keys and values to an empty past), where the result is exactly that operand.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.errors import GraphoptError
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

# uninitialised memory and assertions (random ops are ir.is_random's)
_NEVER = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_assert_tensor_metadata"}
LARGE_BYTES = 4 << 20
aten = torch.ops.aten


# regions export wraps in a higher-order op that are still plain functions of their inputs (Hugging
# Face's rotary table under transformers 5.17 runs under autocast(enabled=False))
_PURE_HOPS = {"wrap_with_set_grad_enabled", "wrap_with_autocast"}


def _pure_region(node: fx.Node) -> bool:
    if getattr(node.target, "_name", None) not in _PURE_HOPS:
        return False
    subs = [a for a in node.all_input_nodes if a.op == "get_attr"
            and isinstance(getattr(node.graph.owning_module, a.target, None), fx.GraphModule)]
    if len(subs) != 1:
        return False
    body = getattr(node.graph.owning_module, subs[0].target)
    if any(getattr(p, "requires_grad", False) for p in body.parameters()):
        return False  # a trainable parameter read inside: its gradient would be lost
    for n in body.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            if ir.op_name(n) in _NEVER or n.target._schema.is_mutable or ir.is_random(n):
                return False
        elif n.op not in ("placeholder", "output", "get_attr") and not (
                n.op == "call_function" and n.target is operator.getitem):
            return False
    return True


def _is_const_node(node: fx.Node, const: set) -> bool:
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args[0] in const
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return _pure_region(node) and all(a in const for a in node.all_input_nodes)
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if ir.op_name(node) in _NEVER or node.target._schema.is_mutable:
        return False
    if ir.is_random(node):
        return False
    return all(a in const for a in node.all_input_nodes)


@register
class FoldConstants(Pass):
    name = "fold_constants"
    family = "cleanup"
    description = "compute parameter-only subgraphs once and store them as constants"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        const: set = set()
        for n in gm.graph.nodes:
            if _is_const_node(n, const):
                const.add(n)
        # fold at the frontier: constant call nodes read by something that is not constant
        roots = [n for n in gm.graph.nodes if n in const and n.op == "call_function"
                 and any(u not in const for u in n.users)]
        value = _evaluator(gm)

        candidates = []
        for root in roots:
            if not isinstance(root.meta.get("val"), torch.Tensor):
                continue
            sub = _subgraph(root, const)
            sources = [n for n in sub if n.op == "get_attr"]
            if ctx.training:
                trainable = [s.target for s in sources if getattr(ir.get_attr_value(gm, s.target), "requires_grad", False)]
                if trainable:
                    res.reject(f"{root.name}", f"reads trainable parameter {trainable[0]} in a training graph")
                    continue
            out_info = ir.info(root)
            if out_info is not None and out_info.device.type == "meta":
                # shapes only: a folded constant would hold no values, and later passes that read
                # constants (the cache positions an arange makes) could prove nothing from it
                res.reject(root.name, "on meta: a constant there holds no values; kept as the ops that make it")
                continue
            src_bytes = sum(ir.concrete(ir.info(s).nbytes) for s in sources if ir.info(s) is not None)
            out_bytes = ir.concrete(out_info.nbytes, ctx.hints)
            if out_bytes > LARGE_BYTES and out_bytes > 2 * src_bytes:
                res.reject(root.name, f"would store a {out_bytes / 2**20:.1f} MiB constant computed from "
                                      f"{src_bytes / 2**20:.1f} MiB")
                continue
            # the gain: the ops that no longer run (only those feeding nothing but constants)
            work = [n for n in sub if n.op == "call_function" and all(u in const for u in n.users) or n is root]
            gain = ctx.node_time(work)

            def apply(root=root, sub=sub):
                with torch.no_grad():
                    v = value(root)
                name = ir.register_constant(gm, root.name, v.detach().clone() if v._base is not None else v.detach())
                with gm.graph.inserting_before(root):
                    new = gm.graph.get_attr(name)
                ir.replace_with(root, new)
                ir.erase_dead(gm, [root] + [n for n in sub if n.op == "call_function"])
                return new

            candidates.append(Candidate("constant subgraph", [root], gain, apply,
                                        label=f"{root.name} ({len(sub)} nodes from {len(sources)} constants)",
                                        constant_bytes=out_bytes))
        res.apply_ranked(ctx, candidates)
        res.apply_ranked(ctx, self._empty_cats(gm, ctx, res))
        # constants that are now unused
        for n in list(gm.graph.nodes):
            if n.op == "get_attr" and not n.users:
                gm.graph.erase_node(n)
        return res


    @staticmethod
    def _empty_cats(gm, ctx, res) -> list:
        """``cat([empty constant, x])`` -> ``x``: Hugging Face's KV cache concatenates each new key and
        value to an empty past (a copy per layer). Only where the cat is an exact identity: every
        other operand is a constant with no elements, ``x`` has the result's shape and dtype (no type
        promotion), ``x`` is computed in the graph (the output never aliases an input or a
        parameter), and no reader is a ``view`` that needs the cat's contiguous result unless ``x``
        has the same strides."""
        out = []
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target is not aten.cat.default:
                continue
            parts = n.args[0]
            empty = [p for p in parts if isinstance(p, fx.Node) and p.op == "get_attr"
                     and isinstance(ir.get_attr_value(gm, p.target), torch.Tensor)
                     and ir.get_attr_value(gm, p.target).numel() == 0]
            rest = [p for p in parts if p not in empty]
            if not empty or len(rest) != 1 or not isinstance(rest[0], fx.Node):
                continue
            x, ni, xi = rest[0], ir.info(n), ir.info(rest[0])
            if ni is None or xi is None or tuple(xi.shape) != tuple(ni.shape) or xi.dtype != ni.dtype:
                res.reject(n.name, "cat with an empty constant changes the shape or dtype of its other operand")
                continue
            if x.op != "call_function":
                res.reject(n.name, f"cat of an empty constant and {x.op} {x.name}: kept (the result would alias it)")
                continue
            if xi.stride != ni.stride and any(u.op == "call_function" and u.target in (aten.view.default,
                                                                                       aten._unsafe_view.default)
                                             for u in n.users):
                res.reject(n.name, "cat with an empty constant is read by a view that needs its contiguous copy")
                continue

            def apply(n=n, x=x):
                ir.replace_with(n, x)
                ir.erase_dead(gm, [n])
                return x

            out.append(Candidate("cat with an empty constant", [n], ctx.node_time([n]), apply,
                                 label=f"{n.name} -> {x.name}"))
        return out


def constant_value(gm: fx.GraphModule, node, max_nodes: int = 256, max_bytes: int = 256 << 20):
    """The value of ``node`` when everything it depends on is a parameter, buffer or literal (no
    placeholder, random op or uninitialised memory), computed now; None otherwise, or when the
    subgraph has more than ``max_nodes`` nodes or an output over ``max_bytes``. For passes that must
    prove a property of a value (a causal mask built in the graph) without storing it as a buffer."""
    if not isinstance(node, fx.Node):
        return None
    const: set = set()
    order: list = []
    stack = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if n in const:
            continue
        if expanded:
            if not _is_const_node(n, const):
                return None
            const.add(n)
            order.append(n)
            continue
        if len(order) + len(stack) > max_nodes:
            return None
        stack.append((n, True))
        stack.extend((a, False) for a in n.all_input_nodes if a not in const)
    for n in order:
        ti = ir.info(n) if n.op == "call_function" else None
        try:
            if ti is not None and ir.concrete(ti.nbytes, {}) > max_bytes:
                return None
        except GraphoptError:
            return None
    with torch.no_grad():
        v = _evaluator(gm)(node)
    return v if isinstance(v, torch.Tensor) else None


def _evaluator(gm: fx.GraphModule):
    """``value(node)``: a constant node's value, computed from its inputs' (each node once)."""
    env: dict = {}

    def value(node):
        if node in env:
            return env[node]
        if node.op == "get_attr":
            v = ir.get_attr_value(gm, node.target)
        else:
            v = node.target(*torch.fx.node.map_arg(node.args, value), **torch.fx.node.map_arg(node.kwargs, value))
        env[node] = v
        return v

    return value


def _subgraph(root: fx.Node, const: set) -> list:
    seen, stack = [], [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.append(n)
        stack.extend(a for a in n.all_input_nodes if a in const)
    return seen
