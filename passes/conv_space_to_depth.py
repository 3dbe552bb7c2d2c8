"""conv_space_to_depth: a stride-2 convolution over a few input channels (ResNet's 3-channel
stem) as a stride-1 convolution over 2x2 pixel blocks.

cuDNN runs a channels_last convolution over few input channels on a slow path (it computes a
fixed chunk of input channels per kernel tap); padding the channels, NCHW or cudnn.benchmark do
not avoid it (``benchmarks/diag/diag_resnet_convs.py``, ``diag_stem.py``). Rearranged, the same
convolution reads each 2x2 block of the (padded) image as one pixel of 4 x C channels, so a KxK
stride-2 kernel becomes a ceil(K/2) x ceil(K/2) stride-1 kernel over 16 channels (3 padded to 4),
which cuDNN runs on its regular path.

    y = conv2d(x, W, b, stride=2, padding=p)                   x: [N, C, H, W], C <= 4
      = conv2d(s2d(pad(x)), W', b, stride=1, padding=0)

``pad`` zero-pads the channels to C4 (the next even count, so 4 x C4 is a multiple of 8) and the
image by p on the top/left and up to the block grid the output needs on the bottom/right (one
``constant_pad_nd``); ``s2d`` regroups [N, 2Hb, 2Wb, C4] into [N, Hb, Wb, (dy, dx, c)] (one copy,
channels_last); W' is W zero-padded to an even kernel and regrouped the same way at optimization
time. Exact: every product of the original sum appears once, the added ones multiply zeros.

Inference graphs on a CUDA profile that measured the slow path (``conv_channel_chunk`` or
``conv_narrow_input_slowdown``), bf16/fp16 channels_last inputs, ungrouped, undilated, stride 2, a
constant weight; cost-gated (the padded copy, the regrouping copy and the new convolution against
the slow one). Runs in the lowering family just before fuse_conv_relu, which then fuses the new
convolution's bias and ReLU.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import is_channels_last, narrow_conv_input
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, conv_pair

aten = torch.ops.aten
MAX_CHANNELS = 4  # 4 x C4 input channels after the regrouping: at most 16


def plan(shape, kernel, padding):
    """(C4, kb, [(pad_before, pad_after) for H and W], (Hb, Wb)) for a stride-2 convolution of a
    [N, C, H, W] input with a KxK-ish kernel, or None where the block grid would need cropping."""
    _, c, h, w = shape
    c4 = c + (c % 2)
    pads, blocks, kbs = [], [], []
    for size, k, p in ((h, kernel[0], padding[0]), (w, kernel[1], padding[1])):
        out = (size + 2 * p - k) // 2 + 1
        kb = (k + 1) // 2
        padded = 2 * (out + kb - 1)
        after = padded - size - p
        if after < 0:
            return None
        pads.append((p, after))
        blocks.append(out + kb - 1)
        kbs.append(kb)
    return c4, kbs, pads, blocks


def regroup_weight(w: torch.Tensor, c4: int, kbs) -> torch.Tensor:
    """W [Co, C, kh, kw] -> W' [Co, 4 * C4, kbh, kbw] with W'[o, (dy, dx, c), by, bx] = W[o, c, 2 by + dy, 2 bx + dx]
    (zero where that is outside W), channels_last."""
    co, c, kh, kw = w.shape
    w8 = torch.nn.functional.pad(w, (0, 2 * kbs[1] - kw, 0, 2 * kbs[0] - kh, 0, c4 - c))
    w8 = w8.view(co, c4, kbs[0], 2, kbs[1], 2).permute(0, 3, 5, 1, 2, 4)
    return w8.reshape(co, 4 * c4, kbs[0], kbs[1]).contiguous(memory_format=torch.channels_last)


@register
class ConvSpaceToDepth(Pass):
    name = "conv_space_to_depth"
    family = "lower"
    description = ("stride-2 convolution over <= 4 channels (ResNet's stem) -> stride-1 convolution over 2x2 "
                   "pixel blocks (cuDNN's slow narrow-input path avoided)")
    inference_only = True  # the regrouped weight is a constant: the model's parameter would not train

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.conv2d.default
                 and narrow_conv_input(n)]
        if not convs:
            return res
        if not ctx.cost.narrow_conv_slow_path:
            res.reject_all(convs, f"the {ctx.cost.device_name} profile measured no slow path for convolutions over "
                                  "few channels")
            return res
        cands = [c for c in (self._candidate(gm, ctx, res, n) for n in convs) if c is not None]
        res.apply_ranked(ctx, cands)
        return res

    def _candidate(self, gm, ctx, res, conv) -> Candidate | None:
        x, w = conv.args[0], conv.args[1]
        bias = get_arg(conv, 2, "bias")
        stride, padding = conv_pair(get_arg(conv, 3, "stride"), 1), conv_pair(get_arg(conv, 4, "padding"), 0)
        dilation, groups = conv_pair(get_arg(conv, 5, "dilation"), 1), get_arg(conv, 6, "groups") or 1
        xi, wi = ir.info(x), ir.info(w)
        label = conv.name
        if stride != [2, 2] or dilation != [1, 1] or groups != 1:
            res.reject(label, f"stride {stride}, dilation {dilation}, groups {groups} (stride 2, undilated, ungrouped only)")
            return None
        if xi.dtype not in (torch.bfloat16, torch.float16):
            res.reject(label, f"{xi.dtype} (the slow path was measured in bf16/fp16)")
            return None
        if not is_channels_last(xi) or xi.shape[1] > MAX_CHANNELS:
            res.reject(label, f"{xi.shape[1]} input channels (at most {MAX_CHANNELS}, channels_last)")
            return None
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or (
                bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr")):
            res.reject(label, "the weight or bias is computed in the graph, not a constant")
            return None
        try:
            shape = [int(d) for d in xi.shape]
            kernel = [int(d) for d in wi.shape[2:]]
        except TypeError:
            res.reject(label, "symbolic input shape")
            return None
        pl = plan(shape, kernel, padding)
        if pl is None:
            res.reject(label, "the block grid would crop the input (padding larger than the kernel needs)")
            return None
        c4, kbs, pads, blocks = pl
        # the pad and the regrouping copy, the new stride-1 convolution over 4 x C4 channels (the
        # cost model prices the copies' narrow runs and cuDNN's per-tap channel chunk)
        r = ctx.replacement()
        co = int(wi.shape[0])
        w_new = r.tensor((co, 4 * c4, kbs[0], kbs[1]), wi.dtype, wi.device,
                         stride=(4 * c4 * kbs[0] * kbs[1], 1, kbs[1] * 4 * c4, 4 * c4))  # channels_last
        _s2d_nodes(r, x, w_new, bias, shape[0], c4, kbs, pads, blocks)
        old, new = ctx.node_time([conv]), r.time()
        copied = co * 4 * c4 * kbs[0] * kbs[1] * wi.dtype.itemsize  # the regrouped weight, a new constant
        return Candidate("narrow stride-2 convolution -> space-to-depth + stride-1 convolution", [conv], old - new,
                         lambda: self._apply(gm, conv, c4, kbs, pads, blocks), label=label, constant_bytes=copied,
                         replacement=r)

    @staticmethod
    def _apply(gm, conv, c4, kbs, pads, blocks):
        g = gm.graph
        x, w = conv.args[0], conv.args[1]
        bias = get_arg(conv, 2, "bias")
        wv = ir.get_attr_value(gm, w.target)
        new_w = regroup_weight(wv.detach(), c4, kbs)
        with g.inserting_before(conv):
            w_node = g.get_attr(ir.register_constant(gm, f"{conv.name}_s2d_weight", new_w))
            new = _s2d_nodes(GraphBuilder(g), x, w_node, bias, int(ir.info(x).shape[0]), c4, kbs, pads, blocks)
        conv.replace_all_uses_with(new)
        g.erase_node(conv)
        ir.erase_dead(gm, [w])
        return new


def _s2d_nodes(b, x, w, bias, n_: int, c4: int, kbs, pads, blocks) -> fx.Node:
    """pad, regroup into 2x2 blocks, stride-1 convolution with the regrouped weight ``w``: the
    nodes the rewrite makes (built with ``b.call``); returns the convolution."""
    c = int(ir.info(x).shape[1])
    (ph0, ph1), (pw0, pw1) = pads
    hb, wb = blocks
    xp = b.call(aten.constant_pad_nd.default, x, [pw0, pw1, ph0, ph1, 0, c4 - c], 0.0)
    t = b.call(aten.permute.default, xp, [0, 2, 3, 1])          # [N, Hp, Wp, C4], a view
    t = b.call(aten.view.default, t, [n_, hb, 2, wb, 2, c4])
    t = b.call(aten.permute.default, t, [0, 1, 3, 2, 4, 5])    # [N, Hb, Wb, dy, dx, C4]
    t = b.call(aten.clone.default, t, memory_format=torch.contiguous_format)
    t = b.call(aten.view.default, t, [n_, hb, wb, 4 * c4])
    xs = b.call(aten.permute.default, t, [0, 3, 1, 2])          # channels_last [N, 4 C4, Hb, Wb]
    return b.call(aten.conv2d.default, xs, w, bias, [1, 1], [0, 0], [1, 1], 1)
