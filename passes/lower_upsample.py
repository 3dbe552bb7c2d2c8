"""lower_upsample: bilinear ``upsample_bilinear2d`` (``F.interpolate(..., mode="bilinear")``) ->
``graphopt::upsample_bilinear2d``, reading its input through its strides.

aten's CUDA kernel for a channels-innermost input wants it dense channels_last (CoaT's token views,
an image read out of [B, 1 + H*W, C] tokens, are copied first) and moves its bytes at a fraction of
the copy rate (the profile's ``op_efficiency["upsample_bilinear2d_nhwc"]``). The rewrite hands the
input as it is to one Triton kernel that computes each output pixel's source position and weights
as aten does (align_corners, the scale factors given) in fp32 and writes the layout aten's node wrote.
Values within the accuracy rule (aten rounds once too, but may order the four products differently).

Applies to a 4-D input of static shape in fp32/fp16/bf16 whose output is contiguous or dense
channels_last, on a CUDA profile, in inference graphs (the op has no backward); priced against
aten's call (its copy included).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import dense_layout

aten = torch.ops.aten
UPSAMPLES = (aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def spec(node: fx.Node) -> tuple[str, tuple | None]:
    """(why not, (output size, align_corners, scale_h, scale_w, channels_last)) of an upsampling node."""
    xi, oi = ir.info(node.args[0]), ir.info(node)
    if xi is None or oi is None:
        return "no tensor metadata", None
    if xi.symbolic or oi.symbolic:
        return "symbolic shapes", None
    if len(xi.shape) != 4:
        return f"a {len(xi.shape)}-D input", None
    if xi.dtype not in DTYPES:
        return f"{xi.dtype} (the kernel takes fp32, fp16 and bf16)", None
    cl = dense_layout(oi)
    if cl is None:
        return "its output is neither contiguous nor dense channels_last", None
    align = bool(get_arg(node, 2, "align_corners"))
    if node.target is aten.upsample_bilinear2d.vec:
        factors = get_arg(node, 3, "scale_factors")
        sh, sw = factors if factors else (None, None)
    else:
        sh, sw = get_arg(node, 3, "scales_h"), get_arg(node, 4, "scales_w")
    if (sh is None) != (sw is None):
        return "a scale factor for one dim only", None
    scales = (float(sh), float(sw)) if sh is not None else (0.0, 0.0)
    return "", ([int(v) for v in oi.shape[2:]], align, *scales, cl)


@register
class LowerUpsample(Pass):
    name = "lower_upsample"
    family = "lower"
    description = ("bilinear upsample_bilinear2d -> one Triton kernel reading the input through its strides "
                   "(aten's NHWC kernel copies a token view first and runs far below the copy rate)")
    inference_only = True  # the op has no backward

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in UPSAMPLES]
        if not nodes:
            return res
        if ctx.cost.device_kind != "cuda":
            res.reject_all(nodes, f"the kernel is for CUDA; {ctx.cost.device_name} runs aten's")
            return res
        cands = []
        for node in nodes:
            why, args = spec(node)
            if why:
                res.reject(node.name, why)
                continue
            op = torch.ops.graphopt.upsample_bilinear2d.default
            old = ctx.node_time([node])
            r = ctx.replacement()
            r.call(op, node.args[0], *args, val=node.meta.get("val"))
            new = r.time()
            xi = ir.info(node.args[0])
            what = f"bilinear {tuple(xi.shape[2:])} -> {tuple(args[0])} over {xi.shape[1]} channels"
            cands.append(Candidate(what, [node], old - new,
                                   lambda node=node, args=args: self._apply(gm, node, op, args), label=node.name,
                                   replacement=r))
        res.apply_ranked(ctx, cands, fused_kernels=True)
        return res

    @staticmethod
    def _apply(gm, node, op, args):
        g = gm.graph
        with g.inserting_before(node):
            new = g.call_function(op, (node.args[0], *args))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
        return new
