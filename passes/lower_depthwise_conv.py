"""lower_depthwise_conv: a depthwise ``conv2d`` (one filter per channel) and the ``bias_act`` epilogue
that reads it -> one ``graphopt::dwconv2d`` kernel.

aten runs a depthwise convolution as a cuDNN call that needs its input dense in its memory format
(a channel slice of a wider tensor, CoaT's value heads read out of the qkv projection, is copied
first), then the bias, activation and residual add that ``fuse_bias_act`` gathered into one
``bias_act`` kernel read the convolution's output back. The rewrite hands the input as it is (any
strides), the filter, the bias (the convolution's own or the epilogue's), the activation and the
residual to one Triton kernel, which writes the layout aten's last node wrote (channels_last or
contiguous). Sums in fp32 and rounds once (aten rounds the convolution's output first): values
within the accuracy rule, not bitwise.

Applies to a 2-D convolution with ``groups`` equal to its input and output channels (a filter
multiplier of 1), static shapes, fp32/fp16/bf16, on a CUDA profile, in inference graphs (the op has
no backward). The epilogue is taken when it is the convolution's only reader, reads it as its ``x``
with the bias (if any) along the channels, and at most one of the two has a bias. A constant filter
is stored again tap-major (the channels innermost: the kernel loads a tap's channels in one vector)
as a new constant, the model's own left unread. Priced against
the convolution (with its input copy) and the epilogue, like every rewrite: the kernel's taps are
read from the cache, so a large filter can price it above cuDNN and it is left alone.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_ext.ops.bias_act import known
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, conv_pair, dense_layout, set_meta

aten = torch.ops.aten
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def depthwise(node: fx.Node) -> bool:
    """One filter per channel: ``groups`` equal to the input channels, weights [C, 1, kh, kw]."""
    xi, wi = ir.info(node.args[0]), ir.info(node.args[1]) if len(node.args) > 1 else None
    if xi is None or wi is None or len(xi.shape) != 4 or len(wi.shape) != 4:
        return False
    groups = get_arg(node, 6, "groups") or 1
    return groups != 1 and groups == xi.shape[1] and tuple(wi.shape[:2]) == (xi.shape[1], 1)


def spec(node: fx.Node) -> tuple[str, list | None]:
    """(why not, [stride, padding, dilation]) of an aten.conv2d node."""
    pairs = [conv_pair(get_arg(node, i, name), default)
             for i, name, default in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1))]
    if any(len(a) != 2 or not all(isinstance(v, int) for v in a) for a in pairs):
        return "stride, padding or dilation not two integers", None
    xi, wi, oi = ir.info(node.args[0]), ir.info(node.args[1]), ir.info(node)
    if xi is None or wi is None or oi is None:
        return "no tensor metadata", None
    if xi.symbolic or wi.symbolic:
        return "symbolic shapes", None
    if len(xi.shape) != 4 or len(wi.shape) != 4:
        return f"a {len(xi.shape)}-D input (the kernel takes a batched 2-D image)", None
    if xi.dtype not in DTYPES or wi.dtype != xi.dtype:
        return f"dtypes {xi.dtype}/{wi.dtype} (the kernel takes fp32, fp16 and bf16, alike)", None
    return "", pairs


def epilogue(node: fx.Node, has_bias: bool) -> tuple[fx.Node | None, str]:
    """(the bias_act node the kernel can take in, or None; why not, where there is one it cannot)."""
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target is not torch.ops.graphopt.bias_act.default:
        return None, ""
    u = users[0]
    x, bias, act = u.args[0], get_arg(u, 1, "bias"), get_arg(u, 2, "act")
    bias_dim = get_arg(u, 4, "bias_dim")
    bias_dim = -1 if bias_dim is None else bias_dim
    if x is not node:
        return None, "its epilogue reads it as the residual"
    if bias is not None and (bias_dim % 4 != 1 or has_bias):
        return None, "its epilogue's bias is not along the channels, or both have one"
    if not isinstance(act, str) or not known(act):
        return None, f"its epilogue's activation {act!r}"
    r = get_arg(u, 3, "residual")
    ri, oi = ir.info(r) if isinstance(r, fx.Node) else None, ir.info(node)
    if r is not None and (ri is None or ri.dtype != oi.dtype):
        return None, "its epilogue's residual is of another dtype"
    return u, ""


def tap_major(w: torch.Tensor) -> torch.Tensor:
    """``w`` [C, 1, kh, kw] stored with the channels innermost (strides 1, 1, kw*C, C), as the kernel
    reads a tap's channels in one vector load."""
    return w.permute(2, 3, 0, 1).contiguous().permute(2, 3, 0, 1)


def _build(call, x, w, bias, residual, pairs, act, cl):
    stride, padding, dilation = pairs
    return call(torch.ops.graphopt.dwconv2d.default, x, w, bias, residual, list(stride), list(padding),
                list(dilation), act, cl)


@register
class LowerDepthwiseConv(Pass):
    name = "lower_depthwise_conv"
    family = "lower"
    description = ("depthwise conv2d + its bias_act epilogue -> one Triton kernel reading the input through "
                   "its strides (no copy of a channel slice first) with the bias, activation and residual")
    inference_only = True  # the op has no backward

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.conv2d.default
                 and depthwise(n)]  # (the others are no candidates: nothing to report)
        if not convs:
            return res
        if ctx.cost.device_kind != "cuda":
            res.reject_all(convs, f"the kernel is for CUDA; {ctx.cost.device_name} runs aten's")
            return res
        cands = []
        for node in convs:
            why, pairs = spec(node)
            if why:
                res.reject(node.name, why)
                continue
            x, w, bias = node.args[0], node.args[1], get_arg(node, 2, "bias")
            u, why = epilogue(node, bias is not None)
            last = u if u is not None else node
            cl = dense_layout(ir.info(last))
            if cl is None:
                res.reject(node.name, "its output is neither contiguous nor dense channels_last")
                continue
            act, residual = "none", None
            if u is not None:
                bias = bias if bias is not None else get_arg(u, 1, "bias")
                act, residual = get_arg(u, 2, "act"), get_arg(u, 3, "residual")
            r = ctx.cost.replacement(ctx.hints)
            wi = ir.info(w)
            wr = w
            if isinstance(w, fx.Node) and w.op == "get_attr":  # the tap-major copy apply() stores
                C, _, kh, kw = wi.shape
                wr = r.tensor(wi.shape, wi.dtype, wi.device, stride=(1, 1, kw * C, C))
            _build(r.call, x, wr, bias, residual, pairs, act, cl)
            matched = [node] + ([u] if u is not None else [])
            old, new = ctx.node_time(matched), r.time()
            k = ir.info(w).shape[2:]
            what = (f"depthwise {k[0]}x{k[1]}/{pairs[0][0]} over {ir.info(x).shape[1]} channels"
                    f"{' + its epilogue (' + act + ')' if u is not None else ''}"
                    f"{'' if u is not None or not why else ' (epilogue left: ' + why + ')'}")
            copy = float(ir.info(w).nbytes) if isinstance(w, fx.Node) and w.op == "get_attr" else 0.0
            cands.append(Candidate(what, matched, old - new,
                                   lambda node=node, last=last, args=(x, w, bias, residual, pairs, act, cl), u=u:
                                   self._apply(gm, node, last, args, u),
                                   label=node.name, constant_bytes=copy, replacement=r))
        res.apply_ranked(ctx, cands, fused_kernels=True)
        return res

    @staticmethod
    def _apply(gm, node, last, args, u):
        g = gm.graph
        b = GraphBuilder(g)
        x, w, *rest = args
        made = []
        if isinstance(w, fx.Node) and w.op == "get_attr":  # the filter stored tap-major: a tap's channels adjacent
            value = ir.get_attr_value(gm, w.target).detach()
            name = ir.register_constant(gm, f"{node.name}_tap_major_weight", tap_major(value))
            with g.inserting_before(last):
                made.append(g.get_attr(name))
            old, w = w, made[0]
        with g.inserting_before(last):
            out = _build(b.call, x, w, *rest)
        set_meta(gm, made + b.made)
        last.replace_all_uses_with(out)
        if u is not None:
            g.erase_node(u)
        g.erase_node(node)
        if made and not old.users:  # the filter as the model stored it: read by nothing else now
            g.erase_node(old)
        return out
