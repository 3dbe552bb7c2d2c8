"""merge_summed_convs: convolutions of one input added together, with the input itself and
per-channel affine maps of it, become one convolution.

    y = conv(x, W1, b1, k=3, p=1) + conv(x, W2, b2, k=1, p=0) + batch_norm(x)
 -> y = conv(x, W1 + pad(W2) + diag(s), b1 + b2 + t, k=3, p=1)        s, t: the BatchNorm's scale and shift

A convolution is linear in its input, so a sum of convolutions of the same input with the same
stride, dilation and groups is one convolution whose kernel is the sum of theirs, each placed so
that it reads the same input positions (a smaller kernel sits at offset (P - p_i) / dilation inside
the merged one of padding P = max p_i, zeros around it: merge_split_convs' placement). The input
itself is a 1x1 convolution with the identity as kernel; an inference BatchNorm of it, or a
per-channel scale, the same with its scale on the diagonal. Sums and differences of such terms,
their products with per-channel constants (a layer scale) and added per-channel constants are
followed through the graph, so a layer-scaled residual ``x + gamma * (conv(x) + bn1(x) - bn2(x))``
is one convolution too. These are the training-time branches of reparameterizable blocks (RepVGG,
MobileOne, FastViT's RepMixer, RepViT) that a model in eval mode still runs one by one: each branch
is a pass over the activation, each sum another. The merged weight and bias are computed once in
float64 and stored in the convolutions' dtype (a new constant: inference only, counted against
optimize's ``weight_copies`` limit).

Runs after fold_conv_bn, so each branch's BatchNorm is already inside its convolution.
Refused, with the reason: convolutions of one input whose stride, dilation, groups or output
channels differ, padding differences the dilation does not divide, asymmetric merged padding,
the input itself (or its BatchNorm) added under a stride or with other channel counts, a term read
elsewhere too (it would still be computed), a dtype change inside the sum. Non-constant weights,
scales or statistics are not followed.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import inference_affine, set_meta
from .merge_split_convs import CONVS, _conv_args, _ints, place, placed

aten = torch.ops.aten
ADDS = (aten.add.Tensor, operator.add)
SUBS = (aten.sub.Tensor, operator.sub)
MULS = (aten.mul.Tensor, operator.mul)
DIVS = (aten.div.Tensor, operator.truediv)


@dataclass
class Form:
    """A node's value as ``sum_i s_i * conv_i(base) + ident * base + bias`` (per output channel
    ``s_i``, ``ident``, ``bias``: float64 vectors, or None for 1 / 0); ``nodes``: the nodes it covers
    (what merging removes), ``attrs``: the constants it reads."""

    base: fx.Node | None
    convs: list = field(default_factory=list)  # (conv node, scale or None)
    ident: torch.Tensor | float | None = None
    bias: torch.Tensor | float | None = None
    nodes: list = field(default_factory=list)
    attrs: list = field(default_factory=list)
    inputs: int = 0  # terms that are the input itself (for the report)

    def scaled(self, s) -> "Form":
        mul = lambda v: None if v is None else v * s  # noqa: E731
        return Form(self.base, [(c, s if k is None else k * s) for c, k in self.convs], mul(self.ident),
                    mul(self.bias), list(self.nodes), list(self.attrs), self.inputs)

    def plus(self, other: "Form") -> "Form":
        add = lambda a, b: b if a is None else a if b is None else a + b  # noqa: E731
        return Form(self.base if self.base is not None else other.base, self.convs + other.convs,
                    add(self.ident, other.ident), add(self.bias, other.bias), self.nodes + other.nodes,
                    self.attrs + other.attrs, self.inputs + other.inputs)


def _const(gm: fx.GraphModule, v, out: ir.TensorInfo):
    """(per-channel float64 vector or float, the get_attr node or None) where ``v`` is a number or a
    constant tensor that broadcasts against ``out`` [N, C, *spatial] along the channels only; else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v), None
    if not isinstance(v, fx.Node) or v.op != "get_attr":
        return None
    t = ir.get_attr_value(gm, v.target)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() > len(out.shape):
        return None
    if t.numel() == 1:
        return float(t.detach().reshape(()).double()), v
    lead = len(out.shape) - t.dim()  # t's dims sit under the output's last t.dim() dims
    for d in range(t.dim()):
        want = out.shape[1] if lead + d == 1 else 1
        if t.shape[d] != want:
            return None
    return t.detach().double().reshape(-1).cpu(), v


def _conv_form(gm: fx.GraphModule, n: fx.Node) -> Form | None:
    x, w, b, stride, padding, dilation, groups = _conv_args(n)
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or w.op != "get_attr" or \
            (b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr")):
        return None
    nd = CONVS[n.target]
    if _ints(stride, nd) is None or _ints(padding, nd) is None or _ints(dilation, nd) is None \
            or not isinstance(groups, int):
        return None
    return Form(x, [(n, None)], nodes=[n], attrs=[a for a in (w, b) if a is not None])


class _Forms:
    """Each node's Form where it has one, built in graph order; a node's Form takes in its operands'
    Forms only where the operand is read by that node alone (``taken`` then holds the operand)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.forms, self.taken, self.refused = gm, {}, set(), {}
        for n in gm.graph.nodes:
            if n.op == "call_function":
                f = self._form(n)
                if f is not None:
                    self.forms[n] = f

    def _operand(self, n: fx.Node, v, out: ir.TensorInfo) -> Form | None:
        if isinstance(v, fx.Node) and v in self.forms:
            return self.forms[v] if len(v.users) == 1 else None  # (one read elsewhere too would still be computed)
        c = _const(self.gm, v, out)
        if c is not None:
            return Form(None, bias=c[0], attrs=[c[1]] if c[1] is not None else [])
        return None

    def _scalable(self, n: fx.Node, v, out: ir.TensorInfo) -> Form | None:
        """``v``'s Form for a product with a constant: its own, else v itself as the input of one
        (``x * gamma`` joins a sum with convolutions of x)."""
        f = self._operand(n, v, out)
        if f is None and isinstance(v, fx.Node) and _const(self.gm, v, out) is None:
            return Form(v, ident=1.0, inputs=1)
        return f

    def _form(self, n: fx.Node) -> Form | None:
        out = ir.info(n)
        if out is None or len(out.shape) < 3 or not isinstance(out.shape[1], int):
            return None
        if n.target in CONVS:
            return _conv_form(self.gm, n)
        if n.target is aten.batch_norm.default:
            bn = inference_affine(self.gm, n)
            if bn is None or not isinstance(n.args[0], fx.Node):
                return None
            return Form(n.args[0], ident=bn[0].cpu(), bias=bn[1].cpu(), nodes=[n], attrs=bn[2])
        if n.target in ADDS + SUBS and len(n.args) == 2:
            alpha = n.kwargs.get("alpha", 1)
            if not isinstance(alpha, (int, float)) or set(n.kwargs) - {"alpha"}:
                return None
            a, b = n.args
            fa, fb = self._operand(n, a, out), self._operand(n, b, out)
            # the input itself, where the other side is a form over it
            if fa is None and fb is not None and a is fb.base:
                fa = Form(a, ident=1.0, inputs=1)
            if fb is None and fa is not None and b is fa.base:
                fb = Form(b, ident=1.0, inputs=1)
            if fa is None or fb is None or (fa.base is None and fb.base is None):
                self._why_not(n, (a, fb or self.forms.get(b)), (b, fa or self.forms.get(a)))
                return None
            if fa.base is not None and fb.base is not None and fa.base is not fb.base:
                return None
            if not self._same_dtype(n, fa, fb):
                return None
            sign = -1.0 if n.target in SUBS else 1.0
            f = fa.plus(fb.scaled(sign * alpha))
        elif n.target in MULS + DIVS and len(n.args) == 2 and not n.kwargs:
            a, b = n.args
            fa, c = self._scalable(n, a, out), _const(self.gm, b, out)
            if (fa is None or c is None) and n.target in MULS:
                fa, c = self._scalable(n, b, out), _const(self.gm, a, out)
            if fa is None or c is None or fa.base is None or not self._same_dtype(n, fa):
                return None
            scale = c[0]
            if n.target in DIVS:
                if isinstance(scale, float) and scale == 0.0 or isinstance(scale, torch.Tensor) and bool((scale == 0).any()):
                    return None
                scale = 1.0 / scale
            f = fa.scaled(scale)
            f.attrs += [c[1]] if c[1] is not None else []
        else:
            return None
        for v in n.args:
            if isinstance(v, fx.Node) and v in self.forms and len(v.users) == 1:
                self.taken.add(v)
        f.nodes.append(n)
        return f

    def _why_not(self, n: fx.Node, *sides) -> None:
        """Record why ``n`` sums no Form where one operand is a convolution read elsewhere too and the
        other side is a Form over that convolution's input (a larger Form read elsewhere is merged on its own)."""
        for v, other in sides:
            f = self.forms.get(v) if isinstance(v, fx.Node) else None
            if f is not None and len(v.users) > 1 and f.convs and len(f.nodes) == 1 and other is not None \
                    and other.base is f.base:
                self.refused.setdefault(n, f"{v.name} is read elsewhere too (it would still be computed)")

    @staticmethod
    def _same_dtype(n: fx.Node, *forms: Form) -> bool:
        dt = ir.info(n).dtype
        return all(ir.info(m) is not None and ir.info(m).dtype == dt for f in forms for m in f.nodes + [f.base]
                   if m is not None)

    def roots(self) -> list[tuple[fx.Node, Form]]:
        """The largest Forms (taken into no other) with a convolution and something to merge into it."""
        return [(n, f) for n, f in self.forms.items() if n not in self.taken and f.convs and len(f.nodes) > 1]


def _plan(root: fx.Node, f: Form) -> tuple[dict | None, str]:
    """The merged convolution's geometry, or (None, why)."""
    terms = []
    for c, _ in f.convs:
        x, w, b, stride, padding, dilation, groups = _conv_args(c)
        nd = CONVS[c.target]
        wi = ir.info(w)
        if wi is None or not all(isinstance(s, int) for s in wi.shape):
            return None, f"{c.name}: a weight of symbolic shape"
        terms.append(dict(conv=c, w=w, b=b, stride=_ints(stride, nd), pad=_ints(padding, nd),
                          dil=_ints(dilation, nd), groups=groups, out=wi.shape[0], cin_g=wi.shape[1],
                          k=list(wi.shape[2:]), dtype=wi.dtype, target=c.target))
    one = terms[0]
    for key in ("target", "stride", "dil", "groups", "out", "cin_g", "dtype"):
        if any(t[key] != one[key] for t in terms):
            name = {"dil": "dilation", "out": "output channels", "cin_g": "input channels per group",
                    "target": "rank"}.get(key, key)
            return None, f"{' and '.join(t['conv'].name for t in terms)} differ in {name}"
    nd, xi, oi = len(one["k"]), ir.info(f.base), ir.info(root)
    if xi is None or oi is None or not all(isinstance(s, int) for s in list(xi.shape) + list(oi.shape)):
        return None, "symbolic sizes"
    if f.ident is not None:
        if any(s != 1 for s in one["stride"]) or xi.shape[1] != one["out"]:
            return None, f"{f.base.name} itself is added to a convolution of stride {one['stride']} from " \
                         f"{xi.shape[1]} to {one['out']} channels"
        terms.append(dict(conv=None, pad=[0] * nd, k=[1] * nd))
    dil, stride = one["dil"], one["stride"]
    before, kernel = place(terms, "pad", dil)
    if before is None:
        return None, kernel
    size, want = list(xi.shape[2:]), list(oi.shape[2:])
    out = [(size[d] + 2 * before[d] - dil[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in range(nd)]
    if out != want:
        return None, f"the merged convolution (kernel {kernel}, padding {before}) gives {out}, not {want}"
    return dict(terms=terms, kernel=kernel, padding=before, one=one,
                bias=any(t.get("b") is not None for t in terms) or f.bias is not None), ""


def _vec(v, n: int) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.full((n,), float(v), dtype=torch.float64)


def _weights(gm: fx.GraphModule, f: Form, plan: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    one, kernel = plan["one"], plan["kernel"]
    C, cpg = one["out"], one["cin_g"]
    w_sum = torch.zeros((C, cpg, *kernel), dtype=torch.float64)
    b_sum = torch.zeros(C, dtype=torch.float64)
    scales = dict(f.convs)
    for t in plan["terms"]:
        if t["conv"] is None:  # the input itself: the identity on the diagonal, at the taps reading position o
            idx = torch.arange(C)
            w_sum[(idx, idx % cpg, *[torch.full((C,), o) for o in t["offset"]])] += _vec(f.ident, C)
            continue
        s = _vec(scales[t["conv"]] if scales[t["conv"]] is not None else 1.0, C)
        w = ir.get_attr_value(gm, t["w"].target).detach().double().cpu()
        w_sum += placed(w, t["offset"], kernel) * s.reshape(-1, *[1] * (w.dim() - 1))
        if t["b"] is not None:
            b_sum += ir.get_attr_value(gm, t["b"].target).detach().double().cpu() * s
    if f.bias is not None:
        b_sum += _vec(f.bias, C)
    device = ir.info(one["w"]).device
    return w_sum.to(one["dtype"]).to(device), (b_sum.to(one["dtype"]).to(device) if plan["bias"] else None)


def _merged_time(ctx: PassContext, f: Form, plan: dict) -> float:
    r = ctx.replacement()
    one = plan["one"]
    device = ir.info(one["w"]).device
    w = r.tensor((one["out"], one["cin_g"], *plan["kernel"]), one["dtype"], device)
    b = r.tensor((one["out"],), one["dtype"], device) if plan["bias"] else None
    r.call(one["target"], r.input(f.base), w, b, one["stride"], plan["padding"], one["dil"], one["groups"])
    return r.time()


def _merge(gm: fx.GraphModule, root: fx.Node, f: Form, plan: dict) -> fx.Node:
    g = gm.graph
    w, b = _weights(gm, f, plan)
    first = f.convs[0][0]
    one = plan["one"]
    w_name = ir.register_constant(gm, f"{first.name}_summed_weight", w)
    b_name = ir.register_constant(gm, f"{first.name}_summed_bias", b) if b is not None else None
    with g.inserting_before(root):
        w_node = g.get_attr(w_name)
        b_node = g.get_attr(b_name) if b_name else None
        merged = g.call_function(one["target"], (f.base, w_node, b_node, one["stride"], plan["padding"], one["dil"],
                                                 one["groups"]))
    set_meta(gm, [w_node] + ([b_node] if b_node is not None else []) + [merged])
    root.replace_all_uses_with(merged)
    ir.erase_dead(gm, list(reversed(f.nodes)))
    for a in dict.fromkeys(f.attrs):
        if not a.users:
            g.erase_node(a)
    return merged


def _describe(f: Form) -> str:
    plural = lambda k, what: f"{k} {what}{'s' if k > 1 else ''}"  # noqa: E731
    parts = [plural(len(f.convs), "convolution")]
    if f.inputs:
        parts.append("the input")
    bns = sum(n.target is aten.batch_norm.default for n in f.nodes)
    if bns:
        parts.append("the input's BatchNorm" if bns == 1 else f"{bns} BatchNorms of the input")
    scales = sum(n.target in MULS + DIVS for n in f.nodes)
    return " + ".join(parts) + (f", {plural(scales, 'per-channel scale')}" if scales else "") + " as one convolution"


@register
class MergeSummedConvs(Pass):
    name = "merge_summed_convs"
    family = "fusion"
    description = ("convolutions of one input added together (with the input, its BatchNorm, per-channel "
                   "scales) -> one convolution")
    inference_only = True
    requires = ("fold_conv_bn",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        forms = _Forms(gm)
        for n, why in forms.refused.items():
            if n not in forms.forms:
                res.reject(n.name, f"not merged: {why}")
        candidates = []
        for root, f in forms.roots():
            plan, why = _plan(root, f)
            if plan is None:
                res.reject(root.name, f"not merged: {why}")
                continue
            one = plan["one"]
            gain = ctx.node_time(f.nodes) - _merged_time(ctx, f, plan)
            w_bytes = one["out"] * one["cin_g"] * math.prod(plan["kernel"]) * one["dtype"].itemsize
            kernel = "x".join(str(k) for k in plan["kernel"])
            candidates.append(Candidate(f"{_describe(f)}, kernel {kernel}", list(f.nodes), gain,
                                        lambda root=root, f=f, plan=plan: _merge(gm, root, f, plan),
                                        label=f"{root.name} ({len(f.nodes)} nodes)", constant_bytes=w_bytes))
        res.apply_ranked(ctx, candidates)
        return res
