"""fuse_conv_relu: conv2d + bias + ReLU, and conv2d + bias + residual add + ReLU, as one cuDNN
fused convolution (``torch.ops.graphopt.conv_bias_relu``, which calls aten's
``cudnn_convolution_relu`` / ``cudnn_convolution_add_relu``).

aten runs ``relu(conv2d(x, W, b) + z)`` as four kernels: the convolution, the bias add (cuDNN's
convolution in aten takes no bias), the residual add and the ReLU, each reading and writing the
whole activation. cuDNN's fused engines apply bias, residual and ReLU in the convolution's
epilogue (``benchmarks/diag/diag_resnet_fusion.py`` measured the difference on ResNet-50).

A lowering step: it runs after the layout and precision passes, so it sees the layout and the
dtypes the graph will run in (the fused op keeps cuDNN's layout: channels_last in, channels_last
out). Inference graphs on a CUDA profile only (the op has no autograd formula, and on the CPU it
is the reference convolution).

Then the residual branch's bias moves into the fused convolution's bias: a residual read only by
the fused op that is itself ``conv2d(x2, W2, b2)`` (ResNet's downsample: convolution + folded
BatchNorm) gives ``relu(conv(x, W) + b + conv(x2, W2) + b2)``, so ``b + b2`` (summed once, in fp32,
at optimization time) goes to the fused op and the residual convolution runs without a bias, which
aten would add in a separate broadcast kernel, slow in channels_last. Only constant biases move.

Refused, with the reason in the report: grouped and depthwise
convolutions (cuDNN's fused engines for them are unmeasured here), a convolution whose output
is read elsewhere (the pre-ReLU value would be lost), a residual of another shape or dtype, and
``add`` with alpha != 1.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import conv_pair, set_meta

aten = torch.ops.aten
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _conv_args(conv: fx.Node):
    """(x, w, bias, stride, padding, dilation, groups) of an aten.conv2d.default node."""
    return (conv.args[0], conv.args[1], get_arg(conv, 2), conv_pair(get_arg(conv, 3), 1), conv_pair(get_arg(conv, 4), 0),
            conv_pair(get_arg(conv, 5), 1), get_arg(conv, 6) if get_arg(conv, 6) is not None else 1)


def match_epilogue(relu: fx.Node, res: PassResult | None = None):
    """(conv, add or None, residual or None) when ``relu`` ends a conv2d [+ residual] + ReLU
    epilogue this pass can fuse (structure, dtypes, single readers); else None, with the reason
    recorded in ``res`` when given. fuse_elementwise reads it to leave these nodes to this pass."""
    def reject(label, why):
        if res is not None:
            res.reject(label, why)

    src = relu.args[0] if relu.args else None
    if not isinstance(src, fx.Node):
        return None
    add = z = None
    conv = src if src.target is aten.conv2d.default else None
    if conv is None and src.target is aten.add.Tensor:
        a, b = src.args[0], src.args[1]
        if get_arg(src, 2, "alpha", 1) != 1:
            reject(f"{src.name} + {relu.name}", "add with alpha != 1")
            return None
        convs = [(c, other) for c, other in ((a, b), (b, a))
                 if isinstance(c, fx.Node) and c.target is aten.conv2d.default]
        conv, z = next(((c, o) for c, o in convs if len(c.users) == 1), (None, None))
        if conv is None and convs:
            reject(f"{convs[0][0].name} + {src.name} + {relu.name}",
                   f"{convs[0][0].name} (the convolution before the residual add) is also read elsewhere")
        add = src if conv is not None else None
    if conv is None:
        return None
    label = " + ".join(n.name for n in (conv, add, relu) if n is not None)
    x, w, bias, stride, padding, dilation, groups = _conv_args(conv)
    xi, wi, ci = ir.info(x), ir.info(w), ir.info(conv)
    if xi is None or wi is None or ci is None or len(xi.shape) != 4 or len(wi.shape) != 4:
        reject(label, "not a batched 2-D convolution")
        return None
    if ci.dtype not in DTYPES or xi.dtype != ci.dtype or wi.dtype != ci.dtype:
        reject(label, f"dtype {ci.dtype} (fp32, fp16 or bf16 with matching weight)")
        return None
    if groups != 1:
        reject(label, f"grouped convolution (groups={groups}): cuDNN's fused engines for it are unmeasured")
        return None
    if len(conv.users) != 1:
        reject(label, f"{conv.name} (the convolution before the ReLU) is also read elsewhere")
        return None
    if add is not None:
        zi = ir.info(z) if isinstance(z, fx.Node) else None
        if zi is None or tuple(zi.shape) != tuple(ci.shape) or zi.dtype != ci.dtype:
            reject(label, "the residual does not have the convolution output's shape and dtype")
            return None
        if len(add.users) != 1:
            reject(label, f"{add.name} (the sum before the ReLU) is also read elsewhere")
            return None
    return conv, add, z


def epilogue_nodes(gm: fx.GraphModule) -> set:
    """The add/ReLU nodes of every conv epilogue this pass would take (see match_epilogue)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.relu.default:
            found = match_epilogue(n)
            if found is not None:
                out |= {n} | ({found[1]} if found[1] is not None else set())
    return out


@register
class FuseConvReLU(Pass):
    name = "fuse_conv_relu"
    family = "lower"
    description = "conv2d + bias (+ residual) + ReLU -> one cuDNN fused convolution (graphopt.conv_bias_relu)"
    inference_only = True  # graphopt's ops have no autograd formulas

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates = []
        for relu in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.relu.default]:
            cand = self._candidate(gm, ctx, res, relu)
            if cand is not None:
                candidates.append(cand)
        if candidates and not ctx.fused_kernels:  # one line, not one per convolution
            res.reject(f"{len(candidates)} conv + bias (+ residual) + ReLU epilogues",
                       f"cuDNN's fused convolution is a GPU op; on {ctx.cost.device_name} the reference would only "
                       "repeat aten's kernels")
            return res
        res.apply_ranked(ctx, candidates, fused_kernels=True)
        if ctx.fused_kernels:
            self._move_residual_biases(gm, ctx, res)
        return res

    @staticmethod
    def _move_residual_biases(gm, ctx, res) -> None:
        """conv_bias_relu(x, W, b, z = conv2d(x2, W2, b2)) -> conv_bias_relu(x, W, b + b2, conv2d(x2, W2))."""
        g = gm.graph
        for fused in [n for n in g.nodes if n.op == "call_function" and n.target is torch.ops.graphopt.conv_bias_relu.default]:
            z, bias = fused.args[3], fused.args[2]
            if not (isinstance(z, fx.Node) and z.op == "call_function" and z.target is aten.conv2d.default):
                continue
            zb = get_arg(z, 2)
            if zb is None:
                continue
            label = f"{z.name} bias -> {fused.name}"
            if len(z.users) != 1:
                res.reject(label, f"{z.name} (the residual convolution) is also read elsewhere")
                continue
            consts = [b for b in (zb, bias) if b is not None]
            if any(not (isinstance(b, fx.Node) and b.op == "get_attr") for b in consts):
                res.reject(label, "a bias is computed in the graph, not a constant")
                continue
            b2 = ir.get_attr_value(gm, zb.target)
            b1 = ir.get_attr_value(gm, bias.target) if bias is not None else torch.zeros_like(b2)
            if b1.shape != b2.shape:
                res.reject(label, f"bias shapes {tuple(b1.shape)} and {tuple(b2.shape)} differ")
                continue
            too_big = ctx.constants.refusal(b1.numel() * b1.element_size())
            if too_big:
                res.reject(label, too_big)
                continue
            summed = (b1.double() + b2.double()).to(b1.dtype)
            args = list(z.args) + [None] * (3 - len(z.args))
            args[2] = None
            kwargs = {k: v for k, v in z.kwargs.items() if k != "bias"}
            # the residual convolution without its bias (aten's separate bias kernel) against with it
            gain = ctx.node_time([z]) - ctx.price(z.target, *args, val=z.meta.get("val"), **kwargs)
            with g.inserting_before(fused):
                new_bias = g.get_attr(ir.register_constant(gm, f"{fused.name}_bias", summed))
            fused.update_arg(2, new_bias)
            z.args = tuple(args)
            z.kwargs = kwargs
            ir.erase_dead(gm, [n for n in (zb, bias) if n is not None])
            res.record("residual convolution's bias -> the fused convolution's bias", [z, fused], [new_bias], gain)

    def _candidate(self, gm, ctx, res, relu) -> Candidate | None:
        found = match_epilogue(relu, res)
        if found is None:
            return None
        conv, add, z = found
        label = " + ".join(n.name for n in (conv, add, relu) if n is not None)
        nodes = [n for n in (relu, add, conv) if n is not None]
        old = ctx.node_time(nodes)  # the convolution's time includes aten's bias kernel
        x, w, bias, stride, padding, dilation, groups = _conv_args(conv)
        new = ctx.price(torch.ops.graphopt.conv_bias_relu.default, x, w, bias, z, stride, padding, dilation, groups,
                        val=relu.meta.get("val"))
        return Candidate(f"conv2d + bias{' + residual' if add is not None else ''} + relu -> conv_bias_relu", nodes,
                         old - new, lambda: self._apply(gm, conv, add, relu), label=label)

    @staticmethod
    def _apply(gm, conv, add, relu) -> fx.Node:
        g = gm.graph
        # read the inputs from the live nodes: an earlier rewrite may have replaced the residual
        # (the previous block's ReLU) or the convolution's input
        x, w, bias, stride, padding, dilation, groups = _conv_args(conv)
        z = None if add is None else (add.args[1] if add.args[0] is conv else add.args[0])
        with g.inserting_before(relu):
            new = g.call_function(torch.ops.graphopt.conv_bias_relu.default,
                                  (x, w, bias, z, stride, padding, dilation, groups))
        set_meta(gm, [new])
        relu.replace_all_uses_with(new)
        ir.erase_dead(gm, [n for n in (relu, add, conv) if n is not None])
        return new
