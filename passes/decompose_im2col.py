"""decompose_im2col: ``aten.im2col`` (``F.unfold``, ``nn.Unfold``) -> a window view of its input and one copy.

aten's CUDA im2col launches one kernel per sample of the batch (and copies a non-contiguous input
first), so a batch of 64 is 64 small kernels. The same values are a strided view of the input:
``unfold`` along the height then the width gives every window (``slice`` with a step picks a
dilated window's taps), a ``permute`` puts them in im2col's (C, kh, kw, L) order, and one copy
(``clone``) makes the [N, C*kh*kw, L] result, which ``fuse_elementwise`` may fold into its readers.
Padding is a ``constant_pad_nd`` of zeros first, as im2col reads zeros outside the input.

Exact (a copy of the same values) in any dtype, differentiable through aten's view backward.
Applies to a 4-D input of static shape; an unbatched (3-D) input is one aten kernel already.
Cost-gated: the cost model prices aten's im2col as a kernel per sample.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, int_pairs, set_meta

aten = torch.ops.aten
IM2COL = aten.im2col.default


def spec(node: fx.Node):
    """(why not, (kernel, dilation, padding, stride)): im2col's arguments as (h, w) pairs, or the
    reason the rewrite does not take the call."""
    args = int_pairs(node, ((1, "kernel_size"), (2, "dilation"), (3, "padding"), (4, "stride")))
    if args is None:
        return "kernel, dilation, padding or stride not two integers", None
    xi, oi = ir.info(node.args[0]), ir.info(node)
    if xi is None or oi is None:
        return "no tensor metadata", None
    if xi.symbolic:
        return "symbolic shapes", None
    if len(xi.shape) != 4:
        return f"a {len(xi.shape)}-D input (an unbatched input is one aten kernel)", None
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = args
    n, c, h, w = xi.shape
    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1 or tuple(oi.shape) != (n, c * kh * kw, oh * ow):
        return f"output {tuple(oi.shape)} is not im2col's {(n, c * kh * kw, oh * ow)}", None
    return "", tuple(args)


def _build(call, x, args, n, c):
    """The nodes of the decomposition, made with ``call(target, *args)``; returns the last."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = args
    if ph or pw:
        x = call(aten.constant_pad_nd.default, x, [pw, pw, ph, ph], 0.0)
    u = call(aten.unfold.default, x, 2, dh * (kh - 1) + 1, sh)   # [N, C, oh, W', span h]
    u = call(aten.unfold.default, u, 3, dw * (kw - 1) + 1, sw)   # [N, C, oh, ow, span h, span w]
    if dh > 1:
        u = call(aten.slice.Tensor, u, 4, 0, None, dh)
    if dw > 1:
        u = call(aten.slice.Tensor, u, 5, 0, None, dw)
    u = call(aten.permute.default, u, [0, 1, 4, 5, 2, 3])       # [N, C, kh, kw, oh, ow]
    u = call(aten.clone.default, u, memory_format=torch.contiguous_format)
    return call(aten.view.default, u, [n, c * kh * kw, -1])


@register
class DecomposeIm2col(Pass):
    name = "decompose_im2col"
    family = "fusion"
    description = "im2col (F.unfold) -> a window view of the input and one copy (aten launches a kernel per sample)"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        cands = []
        for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is IM2COL]:
            why, args = spec(node)
            if why:
                res.reject(node.name, why)
                continue
            n, c = ir.info(node.args[0]).shape[:2]
            r = ctx.cost.replacement(ctx.hints)
            _build(r.call, node.args[0], args, n, c)
            old, new = ctx.node_time([node]), r.time()
            (kh, kw), _, _, (sh, sw) = args
            cands.append(Candidate(f"im2col {kh}x{kw}/{sh}x{sw} over {n} samples -> window view + copy", [node],
                                   old - new, lambda node=node, args=args, n=n, c=c: self._apply(gm, node, args, n, c),
                                   label=node.name))
        res.apply_ranked(ctx, cands)
        return res

    @staticmethod
    def _apply(gm, node, args, n, c):
        g = gm.graph
        b = GraphBuilder(g)
        with g.inserting_before(node):
            out = _build(b.call, node.args[0], args, n, c)
        set_meta(gm, b.made)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        return out
