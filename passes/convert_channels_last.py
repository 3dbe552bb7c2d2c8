"""convert_channels_last: run a conv net's convolutions on NHWC (channels_last) tensors.

Tensor-core convolutions are much faster on NHWC inputs (the profile's measured
``conv_nchw_slowdown``). The graph is split into connected regions of 4-D activations that hold a
convolution; each region is decided on its own. The rewrite converts the 4-D graph inputs a region
reads once, at its boundary, and its 4-D convolution weights once at optimization time
(inference; in training graphs the weights stay the model's parameters and cuDNN converts
them). Pointwise ops, batch norm, pooling, residual adds and concatenations propagate the
layout on their own (PyTorch's memory-format propagation), so no conversion is inserted inside
the region; 4-D outputs are converted back to the contiguous layout the caller expects. A copy to
the contiguous layout inside the region of a tensor whose channels are already innermost
(``x.permute(0, 3, 1, 2).contiguous()`` of an NHWC activation) is dropped with the region, so the
region stays channels_last there too, unless a reader downstream depends on the strides (a
``view``) or something writes either tensor in place. A reshape that copies into a 4-D map a
convolution reads (attention heads folded back into channels) is written NHWC by the same one copy.
Grouped
and depthwise convolutions are included. The cost model decides per region: the convolutions'
time saved (each priced again on a channels_last input) against its boundary conversions (the
clones it adds, priced as nodes); on a profile with no measured NCHW penalty (CPUs, unmeasured
GPUs) the pass refuses and says so. Training graphs on the CPU keep NCHW (see run()).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import is_channels_last
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import STRIDE_READERS, nbytes

aten = torch.ops.aten


def _ancestors(node: fx.Node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


@register
class ConvertChannelsLast(Pass):
    name = "convert_channels_last"
    family = "layout"
    description = "run 2-D convolutions on channels_last tensors; convert only at the region's boundaries"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.conv2d.default
                 and ir.info(n.args[0]) is not None and len(ir.info(n.args[0]).shape) == 4]
        volumetric = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CONV_3D]
        if volumetric:
            res.reject(f"{len(volumetric)} 3-D convolution(s)", "this pass converts 2-D convolutions only; the "
                                                              "profiles hold no measured NDHWC penalty to price them")
        if not convs:
            return res
        if ctx.training and ctx.cost.device_kind == "cpu":
            # the accuracy guard judges a training graph by its forward; on the CPU oneDNN's
            # channels_last convolution backward can be far less accurate than its NCHW one
            # (tests/passes/test_convert_channels_last.py), so the layout is not changed unchecked
            res.reject(f"{len(convs)} convolutions", "training on the CPU: channels_last convolution gradients are "
                                                     "not checked by the guard (forward only); the layout stays NCHW")
            return res
        slow = [c for c in convs if ctx.cost.conv_layout_penalized(ir.info(c.args[0]))]
        if not slow:
            if all(is_channels_last(ir.info(c.args[0])) for c in convs):
                res.notes.append("the convolutions already run on channels_last tensors")
            else:
                res.reject(f"{len(convs)} convolutions", f"no measured NCHW penalty for these convolutions on "
                                                         f"{ctx.cost.device_name}; the layout stays NCHW")
            return res
        output = next(n for n in gm.graph.nodes if n.op == "output")
        storage, writes = ir.storages(gm)
        candidates = []
        for i, region in enumerate(_regions(gm, convs)):
            rconvs = [c for c in convs if c in region]
            rslow = [c for c in rconvs if c in slow]
            # the region's inputs: 4-D float graph inputs its nodes read; its outputs: 4-D values
            # it returns to the caller (readers outside it that are not 4-D, flatten or a
            # reduction, take either layout)
            # (a linear or a copy makes its own layout: an input only they read, and an output they
            # make, need no conversion)
            inputs = list(dict.fromkeys(
                a for n in region if not _own_layout(n) for a in n.all_input_nodes
                if a.op == "placeholder" and ir.info(a) is not None and len(ir.info(a).shape) == 4
                and ir.info(a).dtype.is_floating_point and not is_channels_last(ir.info(a))))
            outs = [a for a in output.all_input_nodes if a in region and not _own_layout(a)]
            # convolutions whose weights the rewrite stores NHWC write NHWC whatever their input's layout
            # (inference): a layout change upstream ends there; not a 1x1 or depthwise filter, whose NHWC
            # and NCHW layouts coincide (its output takes its input's layout)
            ends = set() if ctx.training else {c for c in rconvs if _nhwc_weight(c)}
            copies, reshapes = [], []
            for n in region:
                why = _nhwc_copy(n, output, outs, storage, writes, ends)
                if why is None:
                    copies.append(n)
                elif why:
                    res.reject(f"{n.name} (copy of the channels-innermost {n.args[0].name})", why)
                why = _copying_reshape(n, output, outs, storage, writes, rconvs, ends)
                if why is None:
                    reshapes.append(n)
                elif why:
                    res.reject(f"{n.name} (a reshape that copies into a 4-D map)", why)
            saved = ctx.node_time(rslow) - self._channels_last_time(ctx, rslow) + ctx.node_time(copies)
            cost = self._conversion_time(ctx, inputs, outs)
            info = {"convolutions": len(rconvs), "input_conversions": len(inputs), "output_conversions": len(outs),
                    "copies_dropped": len(copies),
                    "predicted_conv_saving_ms": saved * 1e3, "predicted_conversion_ms": cost * 1e3}
            # the NHWC weights stored at optimization time (inference): copies of the model's weights
            weights = {} if ctx.training else {
                c.args[1].target: c.args[1] for c in rconvs if isinstance(c.args[1], fx.Node) and c.args[1].op == "get_attr"
                and ir.info(c.args[1]) is not None and len(ir.info(c.args[1]).shape) == 4
                and not is_channels_last(ir.info(c.args[1]))}
            copied = sum(nbytes(ir.info(w), ctx.hints) for w in weights.values())
            candidates.append(Candidate(
                "channels_last region", rconvs, saved - cost,
                lambda region=region, rconvs=rconvs, inputs=inputs, outs=outs, info=info, copies=copies,
                reshapes=reshapes: self._apply(gm, ctx, region, rconvs, inputs, outs, info, output, copies, reshapes,
                                               res, (storage, writes)),
                label=f"region {i + 1}: {len(rconvs)} convolutions ({len(rslow)} on NCHW), {len(inputs)} input and "
                      f"{len(outs)} output conversions", constant_bytes=copied))
        self._applied: list = []
        res.apply_ranked(ctx, candidates)
        if self._applied:
            res.details = {k: sum(r[k] for r in self._applied) for k in self._applied[0]}
            res.details["regions"] = self._applied
            where = "weights converted once" if not ctx.training else \
                "weights converted by cuDNN per call (training: they stay the model's parameters)"
            res.notes.append(f"{len(self._applied)} channels_last region(s) of {len(candidates)}: "
                             f"{res.details['convolutions']} convolutions, {res.details['input_conversions']} input and "
                             f"{res.details['output_conversions']} output conversions"
                             + (f", {res.details['copies_dropped']} copies to NCHW dropped" if res.details["copies_dropped"]
                                else "")
                             + (f", {res.details['reshapes_to_channels_last']} copying reshapes write channels_last"
                                if res.details["reshapes_to_channels_last"] else "")
                             + (f", {res.details['views_as_reshapes']} views of a map read as reshapes (NHWC does "
                                "not view as they ask: a copy each)" if res.details["views_as_reshapes"] else "")
                             + f"; {where}")
        return res

    @staticmethod
    def _channels_last_time(ctx, convs) -> float:
        """The convolutions as they run inside the region: on channels_last inputs."""
        r = ctx.replacement()
        for c in convs:
            r.call(c.target, r.like(c.args[0], memory_format=torch.channels_last), *c.args[1:], val=c.meta.get("val"),
                   **c.kwargs)
        return r.time()

    @staticmethod
    def _conversion_time(ctx, inputs, outs) -> float:
        """The copies the rewrite adds at the region's boundary (the _apply's clones)."""
        r = ctx.replacement()
        for x in inputs:
            r.call(aten.clone.default, x, memory_format=torch.channels_last)
        for o in outs:
            r.call(aten.clone.default, r.like(o, memory_format=torch.channels_last), memory_format=torch.contiguous_format)
        return r.time()

    def _apply(self, gm, ctx, region, rconvs, inputs, outs, info, output, copies=(), reshapes=(), res=None,
               aliasing=None):
        g = gm.graph
        if not ctx.training:
            converted = {}
            for c in rconvs:
                w = c.args[1]
                if not (isinstance(w, fx.Node) and w.op == "get_attr"):
                    continue
                if w.target not in converted:
                    value = ir.get_attr_value(gm, w.target)
                    if value.dim() != 4 or value.is_contiguous(memory_format=torch.channels_last):
                        continue
                    name = ir.register_constant(gm, f"{w.target}_nhwc",
                                                value.detach().contiguous(memory_format=torch.channels_last))
                    with g.inserting_before(c):
                        converted[w.target] = g.get_attr(name)
                c.replace_input_with(w, converted[w.target])
            ir.erase_dead(gm, [n for n in g.nodes if n.op == "get_attr" and not n.users])
        for x in inputs:
            first = next(n for n in g.nodes if n in region and x in n.all_input_nodes)
            with g.inserting_before(first):
                cl = g.call_function(aten.clone.default, (x,), {"memory_format": torch.channels_last})
            x.replace_all_uses_with(cl, delete_user_cb=lambda u: u in region)
        for o in outs:
            with g.inserting_before(output):
                back = g.call_function(aten.clone.default, (o,), {"memory_format": torch.contiguous_format})
            output.replace_input_with(o, back)
        for c in copies:
            c.replace_all_uses_with(c.args[0])
        ir.erase_dead(gm, list(copies))
        info["views_as_reshapes"] = _settle(gm, aliasing or ir.storages(gm))
        kept = _write_channels_last(gm, reshapes)
        for n, why in kept.items():
            if res is not None:
                res.reject(f"{n.name} (a reshape that copies into a 4-D map)", why)
        info["reshapes_to_channels_last"] = len(reshapes) - len(kept)
        self._applied.append(info)
        return True


# readers whose result does not take its input's layout: the layout change a dropped copy makes ends there
_LAYOUT_ENDS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
                aten.contiguous.default}


def _own_layout(n: fx.Node) -> bool:
    """``n``'s result has a layout of its own, whatever its input's (a GEMM's output, a copy to the
    contiguous layout)."""
    if n.op != "call_function":
        return False
    if n.target is aten.clone.default:
        return n.kwargs.get("memory_format") is torch.contiguous_format
    if n.target is aten.contiguous.default:
        return n.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format
    return n.target in _LAYOUT_ENDS


def _nhwc_copy(n: fx.Node, output: fx.Node, outs, storage, writes, ends=(), limit: int = 4096) -> str | None:
    """None if ``n`` is a copy to the contiguous layout of a 4-D tensor whose channels are innermost
    in memory, and the region can read that tensor instead; else why it must stay ('' when ``n``
    is no such copy). ``outs``: the region's outputs, which the rewrite converts back for the caller."""
    if n.target not in (aten.contiguous.default, aten.clone.default) or not _own_layout(n) \
            or not isinstance(n.args[0], fx.Node):
        return ""
    x = n.args[0]
    xi, ni = ir.info(x), ir.info(n)
    if xi is None or ni is None or len(xi.shape) != 4 or not is_channels_last(xi) or is_channels_last(ni) \
            or xi.dtype != ni.dtype or xi.device != ni.device:
        return ""
    why = _pinned(n, output, storage, writes, ((n, "the copy"), (x, "its source")))
    if why:
        return why
    why, _ = _layout_readers(n, outs, ends, limit)
    return why


def _pinned(n: fx.Node, output: fx.Node, storage, writes, tensors) -> str:
    """Why ``n``'s layout must stay as the caller sees it: returned to the caller, or one of
    ``tensors`` ((node, what it is), ...) written in place; '' where neither."""
    if n in output.all_input_nodes:
        return "kept: returned to the caller, who gets the contiguous layout"
    for node, what in tensors:
        w = writes.get(storage.get(node, node))
        if w:
            return f"kept: {w[0].name} writes {what} in place"
    return ""


def _nhwc_weight(conv: fx.Node) -> bool:
    """The convolution's weight is a stored 4-D filter whose NHWC layout differs from its NCHW one
    (more than one input channel and tap): stored NHWC, it makes the output NHWC."""
    w = conv.args[1]
    wi = ir.info(w) if isinstance(w, fx.Node) and w.op == "get_attr" else None
    if wi is None or len(wi.shape) != 4 or not all(type(d) is int for d in wi.shape):
        return False
    return wi.shape[1] > 1 and wi.shape[2] * wi.shape[3] > 1


def _layout_readers(n: fx.Node, outs, ends=(), limit: int = 4096, views: bool = True) -> tuple[str | None, set]:
    """(why ``n``'s layout cannot change, or None; the readers its layout reaches): the change
    follows the readers until an op that makes its own layout (or one of ``ends``), and is refused
    where a reader reads strides (a ``view``) or the graph returns a changed tensor (``outs``: the
    region's outputs, which the rewrite converts back for the caller). ``views=False``: a view is
    followed, not refused (the caller tries the rewrite by propagating shapes, _write_channels_last)."""
    seen, stack = {n}, [n]
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u.op == "output" and cur not in outs:
                return f"kept: {cur.name}, whose layout would change, is returned to the caller", seen
            if u in seen or u.op != "call_function":
                continue
            if views and u.target in STRIDE_READERS:
                return (f"kept: {u.name} ({ir.target_name(u)}) reads the strides of a tensor whose layout would "
                        "change"), seen
            seen.add(u)
            if _own_layout(u) or u in ends:
                continue
            if len(seen) > limit:
                return f"kept: more than {limit} readers downstream to check", seen
            stack.append(u)
    return None, seen


def _copying_reshape(n: fx.Node, output: fx.Node, outs, storage, writes, convs, ends=()) -> str | None:
    """None if ``n`` is a reshape into a 4-D map that copies (an attention's ``[B, heads, HW, d]``
    output folded back to ``[B, C, H, W]``) and whose result reaches a convolution of the region:
    written channels_last instead (the same one copy, _write_channels_last), the convolutions after
    it read NHWC as the region's others do; else why not ('' when ``n`` is no such reshape)."""
    if n.target is not aten.reshape.default or not isinstance(n.args[0], fx.Node):
        return ""
    xi, ni = ir.info(n.args[0]), ir.info(n)
    if xi is None or ni is None or len(ni.shape) != 4 or ir.reshape_is_view(xi, ni.shape) \
            or xi.stride is None or not all(type(d) is int for d in (*xi.shape, *ni.shape)):
        return ""
    if _refine(xi.shape, ni.shape) is None:
        return "kept: its dims and the map's share no common split (no single copy writes it channels_last)"
    why = _pinned(n, output, storage, writes, ((n, "it"),))
    if why:
        return why
    why, reached = _layout_readers(n, outs, ends, views=False)
    if why:
        return why
    if not any(c in reached for c in convs):
        return ""  # nothing of the region's reads it as a map: left as it is
    return None


def _refine(old, new) -> tuple[list, list] | None:
    """(the shape both ``old`` and ``new`` split into, the refined dims of each ``new`` dim), or None
    where there is none (a 4 and a 6 that share a factor 2 but neither divides the other's rest). A
    tensor of shape ``old`` views as the refined shape whatever its strides: each piece lies inside
    one old dim (splits only), and each new dim is a run of consecutive pieces."""
    old = [d for d in old if d != 1]  # (size-1 dims: dropped and inserted by the view)
    refined, groups, i = [], [], 0
    ra = old[0] if old else 1  # what is left of old[i]
    for b in new:
        group, rb = [], b
        if b == 1:
            group.append(len(refined))
            refined.append(1)
        while rb > 1:
            if i >= len(old):
                return None
            piece = min(ra, rb)
            if max(ra, rb) % piece:
                return None
            group.append(len(refined))
            refined.append(piece)
            ra, rb = ra // piece, rb // piece
            if ra == 1:
                i += 1
                ra = old[i] if i < len(old) else 1
        groups.append(group)
    return (refined, groups) if i == len(old) else None


def _settle(gm: fx.GraphModule, aliasing, limit: int = 64) -> int:
    """Propagate shapes through the converted region; a ``view`` of a map that NHWC strides cannot
    serve (``x.view(B, -1)`` before a classifier) becomes a ``reshape`` (a copy there), where nothing
    writes either tensor in place. Returns how many; any other failure is raised (the pass is undone)."""
    storage, writes = aliasing
    fixed = 0
    for _ in range(limit):
        try:
            ir.repropagate(gm)
            return fixed
        except Exception as e:
            u = ir.failing_node(gm, e)
            if u is None or u.target not in (aten.view.default, aten._unsafe_view.default) \
                    or writes.get(storage.get(u, u)) or writes.get(storage.get(u.args[0], u.args[0])):
                raise
            u.target = aten.reshape.default
            fixed += 1
    ir.repropagate(gm)
    return fixed


def _write_channels_last(gm: fx.GraphModule, reshapes) -> dict:
    """Each ``reshape(x, [N, C, H, W])`` (a copy) as one copy laid out NHWC: ``x`` viewed in the
    refined dims, permuted to N, H, W, C order and copied, viewed as ``[N, H, W, C]`` and permuted
    back. Tried by propagating shapes, all at once first and one by one where that fails: a rewrite
    a reader downstream cannot take (a ``view`` asking for strides NHWC does not have) is undone.
    Returns {reshape kept: why}."""
    g, kept, made = gm.graph, {}, {}
    for n in reshapes:
        x, shape = n.args[0], tuple(ir.info(n).shape)
        if ir.reshape_is_view(ir.info(x), shape):
            kept[n] = "kept: the region's layout made it a view (no copy to lay out)"
            continue
        refined, groups = _refine(tuple(ir.info(x).shape), shape)
        order = [k for j in (0, 2, 3, 1) for k in groups[j]]
        with g.inserting_before(n):
            split = g.call_function(aten.view.default, (x, list(refined)))
            moved = g.call_function(aten.permute.default, (split, order))
            copy = g.call_function(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
            rows = g.call_function(aten.view.default, (copy, [shape[0], shape[2], shape[3], shape[1]]))
            back = g.call_function(aten.permute.default, (rows, [0, 3, 1, 2]))
        made[n] = (back, rows, copy, moved, split)

    def undo(n):
        back = made.pop(n)
        back[0].replace_all_uses_with(n)
        for m in back:
            g.erase_node(m)

    def propagates(ns) -> BaseException | None:
        for n in ns:
            n.replace_all_uses_with(made[n][0])
        try:
            ir.repropagate(gm)
            return None
        except Exception as e:
            return e

    if made and propagates(list(made)) is not None:
        for n in list(made):  # some reader cannot take one of them: each alone
            made[n][0].replace_all_uses_with(n)
        ir.repropagate(gm)
        for n in list(made):
            e = propagates([n])
            if e is not None:
                u = ir.failing_node(gm, e)
                undo(n)
                ir.repropagate(gm)
                where = f"{u.name} ({ir.target_name(u)})" if u is not None else "a reader downstream"
                kept[n] = f"kept: {where} cannot read it laid out NHWC ({str(e).splitlines()[0][:80]})"
    for n in made:
        g.erase_node(n)
    return kept


_CONV_3D = (aten.conv3d.default, getattr(aten.conv3d, "padding", aten.conv3d.default))


def _regions(gm: fx.GraphModule, convs: list) -> list[set]:
    """Connected regions of 4-D activations that hold a convolution: nodes producing a 4-D tensor,
    joined where one reads another. The layout propagates through such a region on its own
    (pointwise ops, batch norm, pooling, residual adds, concatenations); a value leaving it as
    something else (flatten, a linear's input, a reduction) ends it."""
    # nodes producing 4-D tensors (one, or a tuple/list of them: max_pool2d_with_indices, a fused
    # pointwise kernel; their getitems are 4-D too)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    four_d = [n for n in gm.graph.nodes if n.op == "call_function" and ir.infos(n)
              and all(len(t.shape) == 4 for t in ir.infos(n))]
    conv_set = set(convs)
    return [set(c) for c in ir.connected_components(four_d, order) if conv_set.intersection(c)]
