"""fold_conv_bn: fold an inference-mode BatchNorm into the convolution before it.

    y = (conv(x, W) + b - mean) * gamma / sqrt(var + eps) + beta
      = conv(x, W * s) + (b - mean) * s + beta,      s = gamma / sqrt(var + eps)

The folded weight and bias are computed once in float64 and stored in the conv's dtype. Only
BatchNorm with ``training=False`` matches: in training mode the batch statistics change every
step, so the rewrite would be wrong, and the pass does not run on training graphs at all.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Attr, Const, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

aten = torch.ops.aten
CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)

PATTERN = Op(
    aten.batch_norm.default,
    Op(CONVS, Any("x"), Attr("w"), Attr("b", optional=True), name="conv"),
    Attr("gamma", optional=True), Attr("beta", optional=True), Attr("mean"), Attr("var"),
    Const("training", False), Any("momentum"), Const("eps", pred=lambda e: isinstance(e, float)),
    name="bn",
)


@register
class FoldConvBn(Pass):
    name = "fold_conv_bn"
    family = "fusion"
    description = "fold inference BatchNorm into the preceding convolution's weight and bias"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates = []
        for m in find(gm, PATTERN):
            conv, bn = m["conv"], m["bn"]
            gain = ctx.node_time([bn])
            w = ir.info(m["w"])
            copied = ir.concrete(w.nbytes, ctx.hints) + ir.concrete(ir.info(m["mean"]).numel, ctx.hints) * w.dtype.itemsize
            candidates.append(Candidate("conv+batchnorm", [bn, conv], gain,
                                        lambda m=m: self._fold(gm, m), label=f"{conv.name} + {bn.name}",
                                        constant_bytes=copied))
        # BatchNorms that follow something else are reported, not silently ignored
        matched = {c.nodes[0] for c in candidates}
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is aten.batch_norm.default and n not in matched:
                src = n.args[0]
                why = "in training mode" if (len(n.args) > 5 and n.args[5]) else (
                    f"its input {getattr(src, 'name', src)} is not a convolution" if not (
                        isinstance(src, fx.Node) and src.target in CONVS) else
                    f"the convolution {src.name} has other users")
                res.reject(n.name, f"not folded: {why}")
        res.apply_ranked(ctx, candidates)
        return res

    @staticmethod
    def _fold(gm: fx.GraphModule, m) -> fx.Node:
        conv, bn = m["conv"], m["bn"]
        get = lambda key: None if m.get(key) is None else ir.get_attr_value(gm, m[key].target)  # noqa: E731
        w, b, gamma, beta, mean, var = (get(k) for k in ("w", "b", "gamma", "beta", "mean", "var"))
        eps = m["eps"]
        with torch.no_grad():
            scale = torch.rsqrt(var.double() + eps)
            if gamma is not None:
                scale = scale * gamma.double()
            shape = [-1] + [1] * (w.dim() - 1)
            new_w = (w.double() * scale.reshape(shape)).to(w.dtype)
            bias = b.double() if b is not None else torch.zeros_like(mean, dtype=torch.float64)
            new_b = (bias - mean.double()) * scale
            if beta is not None:
                new_b = new_b + beta.double()
            new_b = new_b.to(w.dtype)
        g = gm.graph
        w_name = ir.register_constant(gm, f"{conv.name}_folded_weight", new_w)
        b_name = ir.register_constant(gm, f"{conv.name}_folded_bias", new_b)
        with g.inserting_before(conv):
            w_node, b_node = g.get_attr(w_name), g.get_attr(b_name)
        args = list(conv.args)
        while len(args) < 3:
            args.append(None)
        args[1], args[2] = w_node, b_node
        with g.inserting_after(conv):
            new = g.call_function(conv.target, tuple(args), dict(conv.kwargs))
        new.meta["val"] = bn.meta.get("val")
        bn.replace_all_uses_with(new)
        ir.erase_dead(gm, [bn, conv])
        for attr in (m["w"], m.get("b"), m.get("gamma"), m.get("beta"), m["mean"], m["var"]):
            if attr is not None and not attr.users:
                g.erase_node(attr)
        return new
