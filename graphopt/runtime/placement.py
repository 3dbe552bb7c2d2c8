"""Running a stage plan (graphopt.partition.plan_stages): the graph placed across devices in one
process (:class:`PlacedModule`), and one GraphModule per stage with a chain interface for the
multi-process pipeline (:func:`stage_modules`, used by graphopt.runtime.distributed).

- :class:`PlacedModule`: the graph split with ``torch.fx.passes.split_module`` into one submodule
  per stage, each on its device, tensors moved at the boundaries; autograd flows through the
  moves, so it trains. CPU+GPU, several GPUs, or ["cpu", "cpu"] for tests.
- :func:`stage_modules`: for each stage a GraphModule that takes the tensors crossing its left cut
  and returns those crossing its right cut (tensors a later stage needs are passed through).
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ir
from ..errors import GraphoptError
from ..partition import StagePlan, _Analysis

def _flat_io(gm: fx.GraphModule):
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return (info.in_spec, info.out_spec) if info is not None else (None, None)


def stage_modules(gm: fx.GraphModule, plan: StagePlan) -> list[fx.GraphModule]:
    """One GraphModule per stage with a chain interface: stage k's positional inputs are the
    tensors crossing its left cut (stage 0: the graph's flat inputs), its outputs the tensors
    crossing its right cut (a tuple; the last stage: the graph's flat outputs, a single tensor
    when there is one). Parameters are the graph's own objects (shared, not copied)."""
    an = _Analysis(gm, ir.shape_hints(gm))
    S = plan.num_stages
    mods = []
    for k, st in enumerate(plan.stages):
        g = fx.Graph()
        env: dict = {}
        ins = an.placeholders if k == 0 else an.crossing_nodes(st.start)
        for v in ins:
            ph = g.placeholder(v.name)
            ph.meta = dict(v.meta)
            env[v] = ph
        if k > 0:  # received activations send their gradients back: contiguous buffers
            for v in ins:
                val = v.meta.get("val")
                if isinstance(val, torch.Tensor) and val.is_floating_point():
                    env[v] = g.call_function(contiguous_grad, (env[v],))
                    env[v].meta = dict(v.meta)  # the same tensor (what a later rewrite reads)
        root = nn.Module()
        for a in an.attrs:
            if any(st.start <= p < st.end for p in an.attr_uses[a]):
                _copy_attr(root, gm, a.target)
                env[a] = g.get_attr(a.target)
                env[a].meta = dict(a.meta)
        for n in an.order[st.start:st.end]:
            if n.op == "call_module":
                _copy_attr(root, gm, n.target)
            env[n] = g.node_copy(n, lambda x: env[x])
        if k == S - 1:
            flat = an.output.args[0]
            flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
            res = [env[x] if isinstance(x, fx.Node) else x for x in flat]
            g.output(res[0] if len(res) == 1 else tuple(res))
        else:
            outs = an.crossing_nodes(st.end)
            g.output(tuple(_sendable(g, env[v]) for v in outs))
        mods.append(fx.GraphModule(root, g, class_name=f"Stage{k}"))
    return mods


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """Identity whose gradient is contiguous: a stage's input gradients are sent to the
    previous stage, whose receive buffers (and NCCL/gloo) need contiguous tensors."""
    return _ContiguousGrad.apply(x)


torch.fx.wrap("contiguous_grad")


def _sendable(g: fx.Graph, node: fx.Node) -> fx.Node:
    """A stage output the pipeline can send: a fresh tensor with standard contiguous strides
    (the pipeline allocates its send/recv and gradient buffers from the output's strides, and
    NCCL/gloo need contiguous buffers); a pass-through gets a buffer of its own."""
    return g.call_method("clone", (node,), {"memory_format": torch.contiguous_format})


def _copy_attr(root: nn.Module, gm: fx.GraphModule, target: str) -> None:
    *path, leaf = target.split(".")
    src, dst = gm, root
    for p in path:
        src = getattr(src, p)
        if not hasattr(dst, p):
            dst.add_module(p, nn.Module())
        dst = getattr(dst, p)
    val = getattr(src, leaf)
    if isinstance(val, nn.Parameter):
        dst.register_parameter(leaf, val)
    elif isinstance(val, torch.Tensor):
        dst.register_buffer(leaf, val)
    elif isinstance(val, nn.Module):
        dst.add_module(leaf, val)
    else:
        setattr(dst, leaf, val)


# --------------------------------------------------------------------------- single-process placement


def _move(x, device: str):
    """A boundary move; non_blocking where the host does not read the result (a GPU destination)."""
    if isinstance(x, torch.Tensor) and str(x.device) != device:
        return x.to(device, non_blocking=torch.device(device).type == "cuda")
    return x


class PlacedModule(nn.Module):
    """The graph split with ``torch.fx.passes.split_module`` into one submodule per stage, each
    on its device; inputs are moved to the first stage's device and every tensor crossing a
    boundary to its reader's device. Outputs stay on the last stage's device. Parameters are the
    model's own objects, moved to their stage's device (as ``model.to`` would); a parameter read
    by stages on two devices is copied for inference and refused for training."""

    def __init__(self, gm: fx.GraphModule, plan: StagePlan, training: bool = False):
        super().__init__()
        from torch.fx.passes.split_module import split_module
        from torch.utils import _pytree as pytree

        self.plan = plan
        self._in_spec, self._out_spec = _flat_io(gm)
        self._pytree = pytree
        stage_of = dict(plan.stage_of)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        if any(a.op == "get_attr" for a in out.all_input_nodes):
            # split_module drops a get_attr node that only the output reads (a buffer the model
            # returns as it is): the last stage returns a copy of it
            gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
            out = next(n for n in gm.graph.nodes if n.op == "output")
            last = plan.stages[-1].index
            for a in [a for a in out.all_input_nodes if a.op == "get_attr"]:
                with gm.graph.inserting_before(out):
                    c = gm.graph.call_method("clone", (a,))
                stage_of[c.name] = last
                out.replace_input_with(a, c)
            gm.recompile()
        split = split_module(gm, gm, lambda n: stage_of[n.name], keep_original_order=True)
        devices = {f"submod_{s.index}": s.device for s in plan.stages}
        seen: dict = {}
        for name, dev in devices.items():
            sub = getattr(split, name, None)
            if sub is None:
                continue
            for pname, p in list(sub.named_parameters(recurse=True)) + list(sub.named_buffers(recurse=True)):
                prev = seen.setdefault(id(p), (dev, name, pname))
                if prev[0] != dev and torch.device(prev[0]) != torch.device(dev):
                    if training and isinstance(p, nn.Parameter) and p.requires_grad:
                        raise GraphoptError(f"parameter {pname} is read by stages on {prev[0]} and {dev}; training "
                                            "would need its gradients summed across devices, which graphopt refuses")
                    *path, leaf = pname.split(".")
                    owner = sub.get_submodule(".".join(path)) if path else sub
                    moved = p.detach().to(dev)
                    if isinstance(p, nn.Parameter):
                        owner.register_parameter(leaf, nn.Parameter(moved, requires_grad=False))
                    else:
                        owner.register_buffer(leaf, moved)
            sub.to(dev)
        g = split.graph
        for n in list(g.nodes):
            if n.op == "call_module" and n.target in devices:
                dev = devices[n.target]
                with g.inserting_before(n):
                    new_args = tuple(g.call_function(_move, (a, dev)) if isinstance(a, fx.Node) else a for a in n.args)
                n.args = new_args
        g.lint()
        split.recompile()
        self.split = split

    def forward(self, *args, **kwargs):
        if self._in_spec is not None:
            from torch.fx._pytree import tree_flatten_spec

            flat = tree_flatten_spec((args, kwargs), self._in_spec)
        else:
            flat = list(args)
        out = self.split(*flat)
        if self._out_spec is not None:
            out = out if isinstance(out, (list, tuple)) else [out]
            return self._pytree.tree_unflatten(list(out), self._out_spec)
        return out
