"""lower_pool: max_pool2d / avg_pool2d over a channels_last tensor -> graphopt::max_pool2d_nhwc /
graphopt::avg_pool2d_nhwc.

aten's channels_last pooling kernels move their bytes far below the copy rate (the profile's
``op_efficiency["pool"]``, measured by ``graphopt calibrate``). The bundled kernels
(cuda_ext/csrc/pool.cu) give each thread one output pixel and a 16-byte vector of channels, so a
window's reads are vector loads of adjacent channels.

max_pool2d is exact (a max is a max: the values are compared in float and stored back unchanged;
padding is left out of the window as aten's -inf padding is; a NaN in a window gives NaN as in
aten). avg_pool2d sums in fp32 and rounds once, as aten's kernels do, with aten's divisor
(count_include_pad or not). Applies to a square kernel, stride and padding, dilation 1, floor
mode or a ceil mode that adds no window (and no divisor override) over a dense channels_last 4-D
input in fp32/bf16/fp16, on a CUDA profile, in inference graphs (the ops have no backward);
cost-gated like every rewrite.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import dense_channels_last

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _square(v, default):
    """A pooling argument (int, [a] or [a, a]; [] or None for ``default``) as one int, or None
    when its two values differ."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    if isinstance(v, int):
        return v
    v = list(v)
    if len(v) == 1:
        return v[0]
    return v[0] if len(v) == 2 and v[0] == v[1] else None


POOLS = (aten.max_pool2d.default, aten.avg_pool2d.default)


def _floor_mode_shape(node: fx.Node, k, s, p) -> bool:
    """Does the pooling's output have floor mode's height and width (static sizes, square window)?"""
    xi, oi = ir.info(node.args[0]), ir.info(node)
    if xi is None or oi is None or len(xi.shape) != 4 or len(oi.shape) != 4 or None in (k, s, p) or xi.symbolic:
        return False
    return all(isinstance(i, int) and o == (i + 2 * p - k) // s + 1 for i, o in zip(xi.shape[2:], oi.shape[2:]))


@register
class LowerPool(Pass):
    name = "lower_pool"
    family = "lower"
    description = ("max_pool2d / avg_pool2d over channels_last -> graphopt::max_pool2d_nhwc / avg_pool2d_nhwc "
                   "(aten's NHWC pooling runs far below the copy rate)")
    inference_only = True  # the bundled ops have no backward

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        pools = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in POOLS]
        if not pools:
            return res
        if ctx.cost.device_kind != "cuda":
            res.reject_all(pools, f"the bundled pooling kernel is for CUDA; {ctx.cost.device_name} runs aten's")
            return res
        cands = [c for c in (self._candidate(gm, ctx, res, n) for n in pools) if c is not None]
        res.apply_ranked(ctx, cands)
        return res

    def _candidate(self, gm, ctx, res, node) -> Candidate | None:
        x = node.args[0]
        k = _square(get_arg(node, 1, "kernel_size"), None)
        s = _square(get_arg(node, 2, "stride"), k)
        p = _square(get_arg(node, 3, "padding"), 0)
        d = _square(get_arg(node, 4, "dilation"), 1)
        avg = node.target is aten.avg_pool2d.default
        if avg:  # avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
            d, ceil = 1, get_arg(node, 4, "ceil_mode") or False
            include_pad = get_arg(node, 5, "count_include_pad")
            include_pad = True if include_pad is None else bool(include_pad)
            if get_arg(node, 6, "divisor_override") is not None:
                res.reject(node.name, "a divisor override (the kernel divides by the window's size)")
                return None
        else:
            ceil = get_arg(node, 5, "ceil_mode") or False
        label = node.name
        if ceil and _floor_mode_shape(node, k, s, p):
            ceil = False  # every window starts inside the input: ceil mode adds none (ResNet-D's 2x2/2 on even sizes)
        if k is None or s is None or p is None or d != 1 or ceil:
            res.reject(label, "not a square, undilated, floor-mode window (the kernel's case)")
            return None
        if not 0 <= 2 * p <= k:
            res.reject(label, f"padding {p} over a {k}x{k} window")
            return None
        xi = ir.info(x)
        if xi is None or xi.dtype not in DTYPES:
            res.reject(label, f"dtype {None if xi is None else xi.dtype} (fp32, bf16, fp16 only)")
            return None
        if not dense_channels_last(xi):
            res.reject(label, "the input is not a dense channels_last tensor (convert_channels_last lays CNNs out so)")
            return None
        old = ctx.node_time([node])
        op, args = ((torch.ops.graphopt.avg_pool2d_nhwc.default, (x, k, s, p, include_pad)) if avg
                    else (torch.ops.graphopt.max_pool2d_nhwc.default, (x, k, s, p)))
        r = ctx.replacement()
        r.call(op, *args, val=node.meta.get("val"))
        new = r.time()
        kind = "avg" if avg else "max"
        return Candidate(f"{kind}_pool2d {k}x{k}/{s} -> {kind}_pool2d_nhwc", [node], old - new,
                         lambda: self._apply(gm, node, op, args), label=label, replacement=r)

    @staticmethod
    def _apply(gm, node, op, args):
        g = gm.graph
        with g.inserting_before(node):
            new = g.call_function(op, args)
        node.replace_all_uses_with(new)
        g.erase_node(node)
        return new
