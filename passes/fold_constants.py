"""fold_constants: evaluate subgraphs that read only parameters, buffers and literals once, at
optimization time, and store the result as a buffer.

Never folds random or uninitialised-memory ops, never in training mode across a trainable
parameter (its gradient would be lost), never on meta (a constant there holds no values), and
refuses to store a large constant that is much bigger than what it is computed from (an
``expand`` turned into memory), unless the value repeats along the dims that make it large (an
``expand`` carried through the ops after it: ConViT's position scores, computed from relative
indices expanded over the batch): then one slice along each is stored and expanded where it is read.

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
# factories whose value depends on their tensor argument's shape, dtype and device only (never on its
# values): with static shapes a constant (torchvision's Swin builds its shifted-window mask from
# ``x.new_zeros`` in every call)
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}


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
    """Computable from constants alone (in-place ops included: :class:`Constants` decides whether
    the storage they write is the graph's own)."""
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
    if ir.op_name(node) in _NEVER:
        return False
    if ir.is_random(node):
        return False
    if shape_only(node):
        return all(a in const for a in node.all_input_nodes if a is not node.args[0])
    return all(a in const for a in node.all_input_nodes)


def shape_only(node: fx.Node) -> bool:
    """A factory reading only its first argument's metadata, with a static shape (_SHAPE_ONLY)."""
    if ir.op_name(node) not in _SHAPE_ONLY or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = ir.info(node.args[0]), ir.info(node)
    return src is not None and out is not None and all(type(d) is int for d in (*src.shape, *out.shape))


def _metadata_stand_in(node: fx.Node) -> torch.Tensor:
    """A tensor with ``node``'s shape, strides, dtype and device (what a shape-only factory reads)."""
    ti = ir.info(node)
    if ti.stride is None:
        return torch.empty(tuple(ti.shape), dtype=ti.dtype, device=ti.device)
    return torch.empty_strided(tuple(ti.shape), tuple(ti.stride), dtype=ti.dtype, device=ti.device)


class Constants:
    """Which nodes of a graph compute the same value on every call from parameters, buffers and
    literals alone (``const``), and those values.

    In-place writes are followed through storage: a node's storage is that of the input it aliases
    (views, ``to``, in-place ops). A storage the graph creates itself (``zeros``, ``arange``...) and
    writes in place only from constants (Swin's mask: ``zeros`` then slice assignments) stays
    constant, its value computed with those writes in graph order; a parameter, buffer or input
    written in place, or a storage written from anything else, is not constant (nor anything read
    from it). Valid for the graph as it is when made."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(nodes)}
        self.storage, self.writes = ir.storages(gm)  # writes: storage -> the nodes writing it, in order
        tainted = {r for r in self.writes if r.op != "call_function"}
        while True:
            const: set = set()
            for n in nodes:
                if self.storage[n] not in tainted and _is_const_node(n, const) \
                        and all(self.storage.get(w, w) not in tainted for w in ir.written(n)):
                    const.add(n)
            more = {r for r, ws in self.writes.items() if r not in tainted and any(w not in const for w in ws)}
            if not more:
                break
            tainted |= more
        self.const = const
        self._shared: dict = {}  # values of nodes whose computation writes nothing

    def written_after(self, node: fx.Node) -> bool:
        """Is ``node``'s storage written after it (its value is not final where it is computed)?"""
        return any(self.pos[w] > self.pos[node] for w in self.writes.get(self.storage[node], ()))

    def closure(self, node: fx.Node) -> list:
        """The constant nodes computing ``node``, with the in-place writes into the storages they
        read that come before it, in graph order."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(a for a in n.all_input_nodes if a in self.const)
            stack.extend(w for w in self.writes.get(self.storage[n], ()) if self.pos[w] < self.pos[node])
        return sorted(seen, key=self.pos.__getitem__)

    def trainable_sources(self, node: fx.Node, closure: list | None = None) -> list[str]:
        """The attributes that require grad (trainable parameters) among those constant ``node`` is
        computed from (``closure``: its :meth:`closure`, when already made): in a training graph such a
        value is not a constant."""
        return [n.target for n in (closure if closure is not None else self.closure(node)) if n.op == "get_attr"
                and getattr(ir.get_attr_value(self.gm, n.target), "requires_grad", False)]

    def value(self, node: fx.Node):
        """The value of constant ``node`` where the graph computes it."""
        order = self.closure(node)
        if not any(self.writes.get(self.storage[n]) for n in order):
            env = self._shared  # nothing written in place: values are shared between calls
        else:
            env = {}  # the writes run on fresh copies of the storages, in graph order
        for n in order:
            if n in env:
                continue
            if n.op == "get_attr":
                env[n] = ir.get_attr_value(self.gm, n.target)
                continue
            # a constant an earlier fold stored (a get_attr the analysis never saw): its value
            load = lambda a: env[a] if a in env or a.op != "get_attr" else ir.get_attr_value(self.gm, a.target)  # noqa: E731
            if shape_only(n) and n.args[0] not in env:
                load = lambda a, src=n.args[0]: _metadata_stand_in(a) if a is src else env[a]  # noqa: E731
            with torch.no_grad():
                env[n] = n.target(*fx.node.map_arg(n.args, load), **fx.node.map_arg(n.kwargs, load))
        return env[node]

    def erase_unread_storages(self, gm: fx.GraphModule) -> int:
        """Erase each storage the graph created and wrote in place that nothing outside it reads
        any more (what is left of a folded mask: ``zeros``, its slices and the writes into them)."""
        removed = 0
        for root, writes in self.writes.items():
            if root.op != "call_function" or getattr(root, "_erased", False):
                continue
            members = {n for n, st in self.storage.items() if st is root and not getattr(n, "_erased", False)}
            inner = members | {w for w in writes if not getattr(w, "_erased", False)}
            if any(u not in inner for n in inner for u in n.users):
                continue
            inputs = [a for n in inner for a in n.all_input_nodes if a not in inner]
            for n in sorted(inner, key=self.pos.__getitem__, reverse=True):
                gm.graph.erase_node(n)
                removed += 1
            removed += ir.erase_dead(gm, [a for a in inputs if not getattr(a, "_erased", False)])
        return removed


def _reader_device(node: fx.Node, const: set):
    """The one device other than the host that the non-constant readers of ``node`` (a host
    tensor) compute on, where the constant belongs, else None: a reader that returns something
    other than tensors on that device (``item()``, a host computation, the graph's output) keeps
    it on the host."""
    devices = set()
    for u in node.users:
        if u in const:
            continue
        if u.op != "call_function":
            return None
        val, outs = u.meta.get("val"), ir.infos(u)
        if not outs or not isinstance(val, (torch.Tensor, tuple, list)):
            return None
        devices |= {o.device for o in outs}
    if len(devices) == 1 and next(iter(devices)).type != "cpu":
        return next(iter(devices))
    return None


def _copies_across_devices(nodes) -> bool:
    """Does one of ``nodes`` copy a tensor to another device (``.to(x.device)`` of a host tensor)?"""
    for n in nodes:
        out = ir.info(n) if n.op == "call_function" else None
        if out is not None and any(ir.info(a) is not None and ir.info(a).device != out.device
                                   for a in n.all_input_nodes):
            return True
    return False


def _store(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor, expand: bool = False) -> fx.Node:
    """Replace ``node`` with a get_attr of ``value`` stored as a constant (its metadata made from
    the value, on the value's device); ``expand``: the value is expanded to ``node``'s shape there."""
    from ._fusion_meta import set_meta

    name = ir.register_constant(gm, node.name, value)
    with gm.graph.inserting_before(node):
        new = gm.graph.get_attr(name)
        made = [new]
        if expand:
            new = gm.graph.call_function(aten.expand.default, (new, list(ir.info(node).shape)))
            made.append(new)
    if not expand and ir.info(node) is not None and ir.info(node).device == value.device:
        new.meta["val"] = node.meta["val"]
    else:
        set_meta(gm, made)
    ir.replace_with(new=new, old=node)
    if node.op == "get_attr" and not node.users:
        gm.graph.erase_node(node)
    return new


def repeated_dims(v: torch.Tensor) -> list[int]:
    """The dims of ``v`` (of size over 1) along which every slice equals the first."""
    return [d for d in range(v.dim()) if v.shape[d] > 1 and torch.equal(v, v.narrow(d, 0, 1).expand_as(v))]


def _repeated_value(consts, root: fx.Node, limit: float) -> tuple[str, torch.Tensor | None]:
    """('', the value of ``root`` with one slice along each dim it repeats along) when that fits in
    ``limit`` bytes and every reader reads values (no view of its memory), else (why not, None)."""
    from ._fusion_meta import STRIDE_READERS

    if any(u.op != "call_function" or u.target in STRIDE_READERS for u in root.users):
        return " (a reader views its memory)", None
    v = consts.value(root)
    if not isinstance(v, torch.Tensor):
        return "", None
    dims = repeated_dims(v)
    small = v
    for d in dims:
        small = small.narrow(d, 0, 1)
    if not dims or small.numel() * small.element_size() > limit:
        return " (not repeated along a dim)" if not dims else f" ({small.numel() * small.element_size() / 2**20:.1f} MiB " \
            "without the dims it repeats along)", None
    return "", small.detach().contiguous()


@register
class FoldConstants(Pass):
    name = "fold_constants"
    family = "cleanup"
    description = "compute parameter-only subgraphs once and store them as constants"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        consts = Constants(gm)
        const = consts.const
        # fold at the frontier: constant call nodes read by something that is not constant
        roots = [n for n in gm.graph.nodes if n in const and n.op == "call_function"
                 and any(u not in const for u in n.users)]

        candidates, host_built = [], []
        for root in roots:
            if not isinstance(root.meta.get("val"), torch.Tensor):
                continue
            if any(u.op == "output" for u in root.users):
                # a stored constant returned would be the same tensor every call: a caller writing
                # into one call's output would change the next call's
                res.reject(root.name, "the graph returns it; a stored constant would be one tensor shared by every call")
                continue
            if consts.written_after(root):
                res.reject(root.name, "its storage is written in place after it is read; the value is not final")
                continue
            sub = consts.closure(root)
            sources = [n for n in sub if n.op == "get_attr"]
            if ctx.training:
                trainable = consts.trainable_sources(root, sub)
                if trainable:
                    res.reject(f"{root.name}", f"reads trainable parameter {trainable[0]} in a training graph")
                    continue
            out_info = ir.info(root)
            to_device = _reader_device(root, const) if out_info.device.type == "cpu" else None
            host = to_device is not None or _copies_across_devices(sub)
            if out_info.device.type == "meta" and not host:
                # shapes only: a folded constant would hold no values, and later passes that read
                # constants (the cache positions an arange makes) could prove nothing from it
                res.reject(root.name, "on meta: a constant there holds no values; kept as the ops that make it")
                continue
            src_bytes = sum(ir.concrete(ir.info(s).nbytes) for s in sources if ir.info(s) is not None)
            out_bytes = ir.concrete(out_info.nbytes, ctx.hints)
            repeated = None
            if out_bytes > LARGE_BYTES and out_bytes > 2 * src_bytes and not host:
                # the value of an expand carried through the ops after it repeats along the expanded
                # dims: stored once along them, expanded again where it is read
                why, repeated = _repeated_value(consts, root, max(LARGE_BYTES, 2 * src_bytes))
                if repeated is None:
                    res.reject(root.name, f"would store a {out_bytes / 2**20:.1f} MiB constant computed from "
                                          f"{src_bytes / 2**20:.1f} MiB{why}")
                    continue
                out_bytes = repeated.numel() * repeated.element_size()
            # the gain: the ops that no longer run (only those feeding nothing but constants)
            work = [n for n in sub if n.op == "call_function" and all(u in const for u in n.users) or n is root]
            gain = ctx.node_time(work)

            def apply(root=root, to_device=to_device, repeated=repeated):
                # the closure as the graph is now: an earlier fold may have stored part of it (erased)
                sub = consts.closure(root)
                if repeated is not None:
                    new = _store(gm, root, repeated, expand=True)
                else:
                    v = consts.value(root)
                    v = v.detach().clone() if v._base is not None else v.detach()
                    new = _store(gm, root, v if to_device is None else v.to(to_device))
                ir.erase_dead(gm, [root] + [n for n in sub if n.op == "call_function"])
                return new

            c = Candidate("constant subgraph" if not host else "host-built constant -> device constant", [root], gain,
                          apply, label=f"{root.name} ({len(sub)} nodes from {len(sources)} constants)",
                          constant_bytes=out_bytes)
            (host_built if host else candidates).append(c)
        # tensors that export lifted out of the forward (torch.tensor(...) literals), on the host but
        # read on another device
        attrs = {id(t) for t in list(gm.parameters()) + list(gm.buffers())}
        for n in gm.graph.nodes:
            if n.op != "get_attr" or ir.info(n) is None or ir.info(n).device.type != "cpu":
                continue
            if id(ir.get_attr_value(gm, n.target)) in attrs:
                continue  # the model's own parameter or buffer: where the model put it
            dev = _reader_device(n, const)
            if dev is not None:
                host_built.append(Candidate("host constant -> device constant", [n], 0.0,
                                            lambda n=n, dev=dev: _store(gm, n, ir.get_attr_value(gm, n.target).to(dev)),
                                            label=f"{n.name} -> {dev}"))
        res.apply_ranked(ctx, candidates)
        # a tensor built on the host in every call and copied to the device costs host work, a
        # copy and a synchronization each call, and keeps the graph from CUDA-graph replay: stored
        # on the device once, also where the cost model sees nothing to gain
        res.apply_ranked(ctx, host_built, allow_zero_gain=True)
        if res.rewrites:
            consts.erase_unread_storages(gm)
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


def constant_value(gm: fx.GraphModule, node, max_nodes: int = 256, max_bytes: int = 256 << 20,
                   consts: Constants | None = None):
    """The value of ``node`` when everything it depends on is a parameter, buffer or literal (no
    placeholder, random op or uninitialised memory; in-place writes as :class:`Constants` follows
    them), computed now; None otherwise, or when the subgraph has more than ``max_nodes`` nodes or
    an output over ``max_bytes``. For passes that must prove a property of a value (a causal mask
    built in the graph) without storing it as a buffer. ``consts``: an analysis of the graph as it
    is, to share between calls."""
    if not isinstance(node, fx.Node):
        return None
    consts = consts or Constants(gm)
    if node not in consts.const or consts.written_after(node):
        return None
    order = consts.closure(node)
    if len(order) > max_nodes:
        return None
    for n in order:
        ti = ir.info(n) if n.op == "call_function" else None
        try:
            if ti is not None and ir.concrete(ti.nbytes, {}) > max_bytes:
                return None
        except GraphoptError:
            return None
    v = consts.value(node)
    return v if isinstance(v, torch.Tensor) else None
