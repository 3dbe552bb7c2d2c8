"""Cutting a checkpoint region out of a graph: a contiguous run of nodes becomes one submodule
call (a ``CheckpointRegion``, an ``OuterCheckpoint``, or a module the caller makes: the AOT
backend's), with one ``getitem`` per value read after it."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import ir
from graphopt.pipeline import PassContext

from .runtime import CheckpointRegion, OuterCheckpoint, _mark

aten = torch.ops.aten

# ops that update their running-statistics arguments (positions) in place in training mode,
# though their schemas do not say so
_BN_OPS = {aten.batch_norm.default: (3, 4), aten.native_batch_norm.default: (3, 4),
           aten._native_batch_norm_legit.default: (3, 4), aten.instance_norm.default: (3, 4)}
_BN_TRAINING_ARG = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5,
                    aten._native_batch_norm_legit.default: 5, aten.instance_norm.default: 5}


def mutated_args(n: fx.Node) -> list:
    """Input nodes n updates in place (schema-declared writes, and BatchNorm running stats)."""
    out = []
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return out
    if t in _BN_OPS:
        train_pos = _BN_TRAINING_ARG[t]
        training = n.args[train_pos] if len(n.args) > train_pos else n.kwargs.get("training", False)
        if training:
            out.extend(n.args[i] for i in _BN_OPS[t] if i < len(n.args) and isinstance(n.args[i], fx.Node))
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i < len(n.args) and isinstance(n.args[i], fx.Node):
            out.append(n.args[i])
    return out


def region_cost(ctx: PassContext, nodes: list, keep: set) -> dict:
    """What a region of ``nodes`` costs the cost model: flops (its GEMMs' apart, with their seconds at
    the peak GEMM rate, for the roofline floor), bytes, launches, time, and the time of the nodes not
    in ``keep`` (recomputed in backward)."""
    total = {"flops": 0.0, "matmul_flops": 0.0, "matmul_floor_s": 0.0, "bytes": 0.0, "launches": 0, "time_s": 0.0,
             "recompute_s": 0.0}
    for n in nodes:
        c = ctx.cost.node_cost(n)
        f = lambda v: float(ir.concrete(v, ctx.hints))  # noqa: E731
        total["flops"] += f(c.flops)
        if ctx.cost.flops_bytes(n)[3] == "matmul":  # the roofline floor prices these at the GEMM rate
            total["matmul_flops"] += f(c.flops)
            total["matmul_floor_s"] += ctx.cost.matmul_floor_s(n, f(c.flops))
        total["bytes"] += f(c.bytes)
        total["launches"] += int(c.launches)
        total["time_s"] += f(c.time_s)
        if n not in keep:
            total["recompute_s"] += f(c.time_s)
    return total


REGION = "graphopt_ckpt_region"  # node meta: the plan region a node (or its rewritten call) came from


def _boundary(nodes: list) -> tuple:
    """(set of nodes, the values they read from outside in first-use order, the nodes read outside)."""
    inside = set(nodes)
    inputs: list = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    return inside, inputs, [n for n in nodes if any(u not in inside for u in n.users)]


def _call_replacing(gm: fx.GraphModule, name: str, nodes: list, inputs: list, outputs: list, inside: set,
                    movers: tuple = (), source: bool = False) -> fx.Node:
    """Insert ``name(*inputs)`` after ``nodes``, one getitem per output in their place (``movers``
    after them), and erase ``nodes``. ``source``: each getitem records the node it stands for."""
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    if REGION in nodes[0].meta:
        call.meta[REGION] = nodes[0].meta[REGION]
    getters = []
    prev = call
    for i, o in enumerate(outputs):
        with gm.graph.inserting_after(prev):
            prev = gm.graph.call_function(operator.getitem, (call, i))
        prev.meta = dict(o.meta)
        if source:
            prev.meta["ckpt_source"] = o.name  # the captured node this region output stands for
        getters.append(prev)
    for n in movers:
        prev.append(n)
        prev = n
    for o, gi in zip(outputs, getters):
        o.replace_all_uses_with(gi, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return call


def _placeholders(g: fx.Graph, inputs: list) -> dict:
    env = {}
    for a in inputs:
        p = g.placeholder(a.name)
        p.meta = dict(a.meta)
        env[a] = p
    return env


def extract_region(gm: fx.GraphModule, nodes: list, keep: set, name: str, ctx: PassContext,
                   selective: bool | None = None, make_module=None) -> fx.Node:
    """Replace ``nodes`` (contiguous in topological order) by one call of a CheckpointRegion
    (or of ``make_module(body, inputs)``'s module: the AOT backend's whole-graph body)."""
    inside, inputs, outputs = _boundary(nodes)
    # nodes interleaved with the region but not in it (export's _guards_fn) that read its values
    # move after it; one the region itself reads back would make a cycle: leave the region alone
    order = list(gm.graph.nodes)
    lo, hi = order.index(nodes[0]), order.index(nodes[-1])
    movers = [n for n in order[lo:hi] if n not in inside and any(a in inside for a in n.all_input_nodes)]
    closure = set(movers)
    for n in order[lo:hi]:  # and what reads those
        if n not in inside and n not in closure and any(a in closure for a in n.all_input_nodes):
            closure.add(n)
    if any(u in inside for n in closure for u in n.users):
        return None
    movers = [n for n in order[lo:hi] if n in closure]
    mutated, written_kept = set(), set()
    for n in nodes:
        for a in mutated_args(n):
            # a write through a view (x[:, 1:] += y: slice, add_, copy_) writes the tensor it views
            chain = [a]
            while chain[-1] in inside and ir.alias_source(chain[-1]) is not None:
                chain.append(ir.alias_source(chain[-1]))
            if chain[-1] not in inside:  # an input: checkpoint would save it and find it modified
                mutated.add(chain[-1])
            written_kept.update(c for c in chain if c in keep and c is not n)
    if make_module is None and written_kept:
        # a kept (cached) value the region then writes in place: the rerun would get the cached,
        # already written tensor and write it again; rerun its op instead
        keep = set(keep) - written_kept
    if make_module is not None:
        # submodules (a higher-order op's body, e.g. export's wrap_with_autocast) are not
        # arguments AOTAutograd can take: the body reads them as attributes of its own
        owned = [a for a in inputs if a.op == "get_attr" and not isinstance(ir.get_attr_value(gm, a.target), torch.Tensor)]
        inputs = [a for a in inputs if a not in owned]
    else:
        owned = []
    g = fx.Graph()
    env = _placeholders(g, inputs)
    for a in owned:
        env[a] = g.node_copy(a)
    state = None
    for n in nodes:
        flag = n in keep
        if flag != state and make_module is None:
            g.call_function(_mark, (flag,))
            state = flag
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(gm if owned else nn.Module(), g, class_name="CheckpointBody")
    if make_module is not None:
        region = make_module(body, inputs, tuple(i for i, a in enumerate(inputs) if a in mutated), outputs)
        region.cost = region_cost(ctx, nodes, keep)  # the cost model prices the call with it
    else:
        cost = region_cost(ctx, nodes, keep)
        region = CheckpointRegion(body, tuple(i for i, a in enumerate(inputs) if a in mutated),
                                  [n.name for n in nodes if n in keep], [n.name for n in nodes if n not in keep],
                                  cost, selective)
    gm.add_submodule(name, region)
    return _call_replacing(gm, name, nodes, inputs, outputs, inside, movers, source=True)


def outer_region(gm: fx.GraphModule, nodes: list, mutated: list, name: str, cost: dict) -> fx.Node:
    """Replace ``nodes`` (a contiguous run of the graph, less its placeholders and attributes,
    so nothing outside both reads and feeds it) by one OuterCheckpoint call; its body calls the
    same submodules (AOT regions) the nodes called."""
    inside, inputs, outputs = _boundary(nodes)
    g = fx.Graph()
    env = _placeholders(g, inputs)
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(gm, g, class_name="OuterBody")
    region = OuterCheckpoint(body, tuple(i for i, a in enumerate(inputs) if a in set(mutated)), [],
                             [n.name for n in nodes], cost, False)
    gm.add_submodule(name, region)
    call = _call_replacing(gm, name, nodes, inputs, outputs, inside)
    for n in nodes:  # the region calls now live in the outer body only
        if n.op == "call_module" and not any(m.op == "call_module" and m.target == n.target for m in gm.graph.nodes):
            gm.delete_submodule(n.target)
    return call
