"""merge_split_convs: convolutions over consecutive channel slices of one tensor, concatenated
along channels, become one grouped convolution.

    xs = split(x, [c0, c1, c2], dim=1)
    y = cat([conv(xs[0], W0, k=3, p=1, groups=g0), conv(xs[1], W1, k=5, p=2, groups=g1),
             conv(xs[2], W2, k=7, p=3, groups=g2)], dim=1)
 -> y = conv(x, cat([pad(W0 to 7x7), pad(W1 to 7x7), W2]), k=7, p=3, groups=g0 + g1 + g2)

A grouped convolution computes each group from its own input channels, so the pieces become the
groups of one call when every piece has the same input and output channels per group (depthwise
pieces always do). A smaller kernel becomes the larger one with zero taps around it, placed so
that it reads the same input positions: piece i with padding p_i sits at offset
(P - p_i) / dilation inside the merged kernel of padding P = max p_i. The result is the same sums
with zero terms added (exact for finite inputs). A zero pad written before a piece's convolution
(TF's ``same`` padding, more after than before) counts as that piece's padding; where the merged
padding is not symmetric, one zero pad of the whole input comes before the merged call. MixNet's mixed depthwise convolutions, CoaT's
convolutional position encodings over head groups, and grouped 1x1 convolutions written as a split.

What it saves: each slice of a channels_last (or a batch > 1 NCHW) tensor is copied before cuDNN
reads it, then the concatenation copies every output once more; merged, one call reads x as laid
out and writes the result. What it costs: the smaller kernels' zero taps (more FLOPs); the cost
model weighs both. The merged weight is a new constant (inference only; it counts against
optimize's ``weight_copies`` limit).

Refused, with the reason: pieces that are not consecutive slices of one tensor covering all its
channels in order, convolutions with other users than the concatenation, differing strides,
dilations, dtypes or per-group channel counts, paddings no zero-padded kernel can reproduce,
non-constant weights.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import set_meta
from ._slices import RANGES, SPLITS, arg, node_range, split_bounds

aten = torch.ops.aten

CONVS = {aten.conv1d.default: 1, aten.conv2d.default: 2, aten.conv3d.default: 3}


def _ints(v, n: int) -> list | None:
    v = [v] * n if isinstance(v, int) else list(v)
    if len(v) == 1 and n > 1:
        v = v * n
    return v if len(v) == n and all(isinstance(i, int) for i in v) else None


def _channel_range(node: fx.Node) -> tuple | None:
    """(base, start, stop) where ``node`` is a slice along dim 1 (a split's item or a step-1
    slice or narrow) of ``base``, else None."""
    if node.op != "call_function":
        return None
    split = node.args[0] if node.target is operator.getitem else None
    if isinstance(split, fx.Node) and split.target in SPLITS:
        base, d = split.args[0], arg(split, 2, "dim", 0)
    elif node.target in RANGES and node.target is not aten.select.int:
        base, d = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    else:
        return None
    bi = ir.info(base) if isinstance(base, fx.Node) else None
    if bi is None or not isinstance(d, int) or d % len(bi.shape) != 1 or not isinstance(bi.shape[1], int):
        return None
    if split is not None:
        bounds, k = split_bounds(split, bi.shape[1]), node.args[1]
        return (base, bounds[k], bounds[k + 1]) if bounds is not None and isinstance(k, int) else None
    _, _, _, start, stop = node_range(node, bi.shape[1])
    return (base, start, stop) if start is not None else None


PADS = (aten.pad.default, aten.constant_pad_nd.default)


def _zero_pad(node: fx.Node, nd: int) -> tuple | None:
    """(input, [(before, after) per spatial dim]) where ``node`` pads only the last ``nd`` dims of
    its input with zeros (TF's ``same`` padding written before a convolution), else None."""
    if node.op != "call_function" or node.target not in PADS:
        return None
    pads = node.args[1]
    if node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
    else:
        mode, value = "constant", node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if mode != "constant" or value not in (None, 0, 0.0) or not isinstance(pads, (list, tuple)) or len(pads) != 2 * nd \
            or not all(isinstance(v, int) and v >= 0 for v in pads):
        return None
    return node.args[0], [(pads[2 * (nd - 1 - d)], pads[2 * (nd - 1 - d) + 1]) for d in range(nd)]


def _conv_args(conv: fx.Node) -> tuple:
    """(x, w, b, stride, padding, dilation, groups) of an aten.convNd.default node."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    defaults = (None, None, None, 1, 0, 1, 1)
    return tuple(conv.args[i] if i < len(conv.args) else conv.kwargs.get(n, d)
                 for i, (n, d) in enumerate(zip(names, defaults)))


def place(parts: list, key: str, dil: list) -> tuple:
    """(merged padding P, merged kernel size), per spatial dim, for kernels ``p["k"]`` of paddings
    ``p[key]`` with one dilation: each part gets ``p["offset"]`` = (P - p_i) / dilation, where its kernel
    sits inside the merged one so that it reads the same input positions; (None, why) where a padding
    difference is not a multiple of the dilation."""
    nd = len(dil)
    before = [max(p[key][d] for p in parts) for d in range(nd)]
    for p in parts:
        if any((before[d] - p[key][d]) % dil[d] for d in range(nd)):
            return None, "a padding difference the dilation does not divide (no zero-padded kernel reads the same taps)"
        p["offset"] = [(before[d] - p[key][d]) // dil[d] for d in range(nd)]
    return before, [max(p["offset"][d] + p["k"][d] for p in parts) for d in range(nd)]


def placed(w: torch.Tensor, offset: list, kernel: list) -> torch.Tensor:
    """Weight ``w`` [out, in, *k] zero-padded to ``kernel``, its taps at ``offset`` (see :func:`place`)."""
    pads = []
    for d in reversed(range(len(kernel))):  # F.pad: the last dim's (before, after) first
        pads += [offset[d], kernel[d] - offset[d] - w.shape[2 + d]]
    return F.pad(w, pads)


def _plan(cat: fx.Node) -> tuple:
    """(plan, None) for a mergeable concatenation, else (None, why); plan None and why None: not
    a concatenation of convolutions at all (nothing to report)."""
    ci = ir.info(cat)
    pieces = cat.args[0] if cat.args else []
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    convs = [p for p in pieces if isinstance(p, fx.Node) and p.op == "call_function" and p.target in CONVS]
    if ci is None or len(convs) < 2:
        return None, None
    if not isinstance(dim, int) or dim % len(ci.shape) != 1:
        return None, "concatenated along another dim than the channels"
    if len(convs) != len(pieces):
        return None, "a piece of the concatenation is not a convolution"
    if len(set(convs)) != len(convs):
        return None, "a convolution is concatenated more than once"
    if len({c.target for c in convs}) != 1:
        return None, "convolutions of different ranks"
    nd = CONVS[convs[0].target]
    parts, base, at = [], None, 0
    for c in convs:
        if len(c.users) != 1:
            return None, f"{c.name} is read by more than the concatenation"
        x, w, b, stride, padding, dilation, groups = _conv_args(c)
        padded = _zero_pad(x, nd) if isinstance(x, fx.Node) else None
        if padded is not None:
            if len(x.users) != 1:
                return None, f"{c.name}'s padded input is read by more than the convolution"
            x, extra = padded
        else:
            extra = [(0, 0)] * nd
        rng = _channel_range(x) if isinstance(x, fx.Node) else None
        if rng is None:
            return None, f"{c.name} does not read a channel slice of a tensor"
        if base is None:
            base = rng[0]
        if rng[0] is not base or rng[1] != at:
            return None, "the convolutions do not read consecutive channel slices of one tensor, in order"
        at = rng[2]
        if w.op != "get_attr" or (b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr")):
            return None, f"{c.name}'s weight or bias is not a constant"
        stride, padding, dilation = _ints(stride, nd), _ints(padding, nd), _ints(dilation, nd)
        if stride is None or padding is None or dilation is None or not isinstance(groups, int):
            return None, f"{c.name}: string or symbolic padding, stride or dilation"
        wi = ir.info(w)
        if wi is None or not all(isinstance(s, int) for s in wi.shape):
            return None, f"{c.name}: a weight of symbolic shape"
        parts.append(dict(conv=c, w=w, b=b, stride=stride, dilation=dilation, groups=groups,
                          before=[padding[d] + extra[d][0] for d in range(nd)],
                          after=[padding[d] + extra[d][1] for d in range(nd)],
                          out=wi.shape[0], cin_g=wi.shape[1], k=list(wi.shape[2:]), dtype=wi.dtype, device=wi.device))
    bi = ir.info(base)
    if bi is None or at != bi.shape[1]:
        return None, "the slices do not cover the tensor's channels"
    one = parts[0]
    for key in ("stride", "dilation", "cin_g", "dtype", "device"):
        if any(p[key] != one[key] for p in parts):
            return None, f"the convolutions differ in {key.replace('cin_g', 'input channels per group')}"
    if any(p["out"] % p["groups"] or p["out"] // p["groups"] != one["out"] // one["groups"] for p in parts):
        return None, "the convolutions differ in output channels per group"
    dil, stride = one["dilation"], one["stride"]
    before, kernel = place(parts, "before", dil)
    if before is None:
        return None, kernel
    size, want = list(bi.shape[2:]), list(ci.shape[2:])
    if not all(isinstance(v, int) for v in size + want):
        return None, "symbolic spatial sizes"
    # the padding after: the least that gives the merged call the pieces' output size (the extra taps
    # past a piece's own kernel are zeros, so what they read does not matter)
    after = [max(0, (want[d] - 1) * stride[d] + dil[d] * (kernel[d] - 1) + 1 - size[d] - before[d]) for d in range(nd)]
    out = [(size[d] + before[d] + after[d] - dil[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in range(nd)]
    if out != want:
        return None, f"the merged convolution's output {out} is not the pieces' {want}"
    return dict(base=base, parts=parts, before=before, after=after, kernel=kernel, nd=nd, target=convs[0].target,
                groups=sum(p["groups"] for p in parts), out=sum(p["out"] for p in parts),
                bias=any(p["b"] is not None for p in parts)), None


@register
class MergeSplitConvs(Pass):
    name = "merge_split_convs"
    family = "fusion"
    description = "convolutions over consecutive channel slices, concatenated, become one grouped convolution"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates = []
        for cat in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.cat.default]:
            plan, why = _plan(cat)
            label = f"{cat.name} ({len(cat.args[0])} pieces)"
            if plan is None:
                if why is not None:
                    res.reject(label, why)
                continue
            convs = [p["conv"] for p in plan["parts"]]
            gain = ctx.node_time(convs + [cat]) - _merged_time(ctx, plan)
            kernel = "x".join(str(k) for k in plan["kernel"])
            w_bytes = plan["out"] * plan["parts"][0]["cin_g"] * math.prod(plan["kernel"]) * plan["parts"][0]["dtype"].itemsize
            candidates.append(Candidate(f"{len(convs)} sliced convolutions as one of {plan['groups']} groups, "
                                        f"kernel {kernel}", convs + [cat], gain,
                                        lambda gm=gm, cat=cat, plan=plan: _merge(gm, cat, plan),
                                        label=label, constant_bytes=w_bytes))
        res.apply_ranked(ctx, candidates)
        return res


def _merged_time(ctx: PassContext, plan: dict) -> float:
    """Predicted time of the one grouped convolution over the whole input."""
    r = ctx.replacement()
    one = plan["parts"][0]
    w = r.tensor((plan["out"], one["cin_g"], *plan["kernel"]), one["dtype"], one["device"])
    b = r.tensor((plan["out"],), one["dtype"], one["device"]) if plan["bias"] else None
    x, padding = r.input(plan["base"]), _padding(plan)
    if padding is None:
        x, padding = r.call(aten.constant_pad_nd.default, x, _pad_list(plan), 0.0), [0] * plan["nd"]
    r.call(plan["target"], x, w, b, one["stride"], padding, one["dilation"], plan["groups"])
    return r.time()


def _padding(plan: dict) -> list | None:
    """The merged convolution's own (symmetric) padding, or None where before and after differ."""
    return plan["before"] if plan["before"] == plan["after"] else None


def _pad_list(plan: dict) -> list:
    """constant_pad_nd's list for the merged padding: the last dim's (before, after) first."""
    return [v for d in reversed(range(plan["nd"])) for v in (plan["before"][d], plan["after"][d])]


def _merge(gm: fx.GraphModule, cat: fx.Node, plan: dict) -> fx.Node:
    g = gm.graph
    nd = plan["nd"]
    ws, bs = [], []
    with torch.no_grad():
        for p in plan["parts"]:
            w = ir.get_attr_value(gm, p["w"].target).detach()
            ws.append(placed(w, p["offset"], plan["kernel"]))
            if plan["bias"]:
                bs.append(ir.get_attr_value(gm, p["b"].target).detach() if p["b"] is not None
                          else torch.zeros(p["out"], dtype=w.dtype, device=w.device))
        w = torch.cat(ws, 0).contiguous()
        b = torch.cat(bs, 0).contiguous() if bs else None
    first = plan["parts"][0]
    w_name = ir.register_constant(gm, f"{first['conv'].name}_merged_weight", w)
    b_name = ir.register_constant(gm, f"{first['conv'].name}_merged_bias", b) if b is not None else None
    padding, made = _padding(plan), []
    with g.inserting_before(cat):
        w_node = g.get_attr(w_name)
        b_node = g.get_attr(b_name) if b_name else None
        x = plan["base"]
        if padding is None:  # TF's same padding, more after than before: one zero pad of the whole input
            x = g.call_function(aten.constant_pad_nd.default, (x, _pad_list(plan), 0.0))
            made.append(x)
            padding = [0] * nd
        merged = g.call_function(plan["target"], (x, w_node, b_node, first["stride"], padding, first["dilation"],
                                                  plan["groups"]))
    set_meta(gm, [w_node] + ([b_node] if b_node is not None else []) + made + [merged])
    cat.replace_all_uses_with(merged)
    attrs = [p["w"] for p in plan["parts"]] + [p["b"] for p in plan["parts"] if p["b"] is not None]
    pads = [_conv_args(p["conv"])[0] for p in plan["parts"]]
    slices = [x.args[0] if x.target in PADS else x for x in pads]
    splits = [s.args[0] for s in slices if s.target is operator.getitem]
    ir.erase_dead(gm, [cat] + [p["conv"] for p in plan["parts"]] + pads + slices + splits)
    for a in attrs:
        if not a.users:
            g.erase_node(a)
    return merged
