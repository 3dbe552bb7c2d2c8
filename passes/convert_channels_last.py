"""convert_channels_last: run a conv net's convolutions on NHWC (channels_last) tensors.

Tensor-core convolutions are much faster on NHWC inputs (the profile's measured
``conv_nchw_slowdown``). The rewrite converts the 4-D graph inputs that reach a convolution
once, at the region's boundary, and the 4-D convolution weights once at optimization time
(inference; in training graphs the weights stay the model's parameters and cuDNN converts
them). Pointwise ops, batch norm, pooling, residual adds and concatenations propagate the
layout on their own (PyTorch's memory-format propagation), so no conversion is inserted inside
the region; 4-D outputs are converted back to the contiguous layout the caller expects. Grouped
and depthwise convolutions are included. The cost model decides: predicted conv time saved
against the bytes the boundary conversions move; on a profile with no measured NCHW penalty
(CPUs, unmeasured GPUs) the pass refuses and says so.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import conv_layout_penalized, is_channels_last
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import nbytes, pointwise_kernel_time

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
        if not convs:
            return res
        slow = [c for c in convs if conv_layout_penalized(ir.info(c.args[0]), ctx.profile)]
        if not slow:
            if all(is_channels_last(ir.info(c.args[0])) for c in convs):
                res.notes.append("the convolutions already run on channels_last tensors")
            else:
                res.reject(f"{len(convs)} convolutions", f"no measured NCHW penalty for these convolutions on "
                                                         f"{ctx.profile.name}; the layout stays NCHW")
            return res
        # the region's inputs: 4-D float graph inputs that reach a convolution
        reach = set().union(*(_ancestors(c) for c in convs))
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n in reach and ir.info(n) is not None
                  and len(ir.info(n).shape) == 4 and ir.info(n).dtype.is_floating_point
                  and not is_channels_last(ir.info(n))]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        outs = [a for a in output.all_input_nodes if ir.info(a) is not None and len(ir.info(a).shape) == 4]
        p = ctx.profile
        saved = 0.0
        for c in slow:  # each convolution's time with and without the NCHW penalty
            nc = ctx.cost.node_cost(c)
            comp, mem = ir.concrete(nc.compute_s, ctx.hints), ir.concrete(nc.memory_s, ctx.hints)
            saved += p.kernel_seconds(comp, mem, "conv") - p.kernel_seconds(comp / p.conv_nchw_slowdown, mem, "conv")
        cost = sum(pointwise_kernel_time(ctx, 2 * nbytes(ir.info(n), ctx.hints)) for n in inputs + outs)
        gain = saved - cost

        def apply():
            g = gm.graph
            if not ctx.training:
                converted = {}
                for c in convs:
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
            for p in inputs:
                first = next(n for n in g.nodes if n in p.users)
                with g.inserting_before(first):
                    cl = g.call_function(aten.clone.default, (p,), {"memory_format": torch.channels_last})
                p.replace_all_uses_with(cl, delete_user_cb=lambda u: u is not cl)
            for o in outs:
                with g.inserting_before(output):
                    back = g.call_function(aten.clone.default, (o,), {"memory_format": torch.contiguous_format})
                output.replace_input_with(o, back)
            return True

        res.apply_ranked(ctx, [Candidate(
            "channels_last region", convs, gain, apply,
            label=f"{len(convs)} convolutions ({len(slow)} on NCHW), {len(inputs)} input and {len(outs)} output "
                  "conversions")])
        if res.rewrites:
            res.details = {"convolutions": len(convs), "input_conversions": len(inputs),
                           "output_conversions": len(outs), "predicted_conv_saving_ms": saved * 1e3,
                           "predicted_conversion_ms": cost * 1e3}
            res.notes.append(f"one channels_last region: {len(convs)} convolutions, {len(inputs)} input and "
                             f"{len(outs)} output conversions; weights converted once" if not ctx.training else
                             f"one channels_last region: {len(convs)} convolutions; weights converted by cuDNN per call "
                             "(training: they stay the model's parameters)")
        return res
