"""lower_group_norm: ``group_norm`` (and a ReLU, SiLU or exact GELU read only by it) ->
``graphopt::group_norm``.

aten's GroupNorm gives each (sample, group) row one thread block for its statistics and applies
the normalization in a separate strided kernel: with few long rows (one group over C x H x W, as
in PoolFormer, or a diffusion UNet's 32 groups at small batch) most of the GPU idles. The bundled
Triton kernel splits every row across programs for its statistics (Chan's merge of per-tile
mean and squared deviations) and applies normalization, affine and activation in one pass,
keeping x's layout (NCHW or channels_last). The cost model prices aten's kernels from the
profile's measured ``op_efficiency["group_norm"]`` (block bandwidth, apply rate); without that
measurement the rewrite is refused with that reason.

Inference graphs on a CUDA profile (the op has no backward), fp32/bf16/fp16 input of 3 to 5 dims
whose channels divide into the groups; cost-gated like every rewrite.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import set_meta
from .fuse_bias_act import ACTS, act_name

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_ACTS = ("relu", "silu", "gelu")  # (bias_act's names; gelu is the exact one)


def _activation(node: fx.Node) -> tuple[fx.Node | None, str]:
    """(the activation the kernel can apply after ``node``: its only reader, a ReLU, SiLU or exact
    GELU, and its name), or (None, "none")."""
    if len(node.users) == 1:
        (u,) = node.users
        if u.op == "call_function" and u.target in ACTS and u.args[0] is node and act_name(u) in KERNEL_ACTS:
            return u, act_name(u)
    return None, "none"


@register
class LowerGroupNorm(Pass):
    name = "lower_group_norm"
    family = "lower"
    description = "group_norm (+ ReLU/SiLU/GELU) -> graphopt::group_norm (statistics split across the GPU)"
    inference_only = True  # the bundled op has no backward

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        norms = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.group_norm.default]
        if not norms:
            return res
        if ctx.cost.device_kind != "cuda":
            res.reject_all(norms, f"the bundled GroupNorm kernel is for CUDA; {ctx.cost.device_name} runs aten's")
            return res
        if not ctx.cost.measured("group_norm"):
            res.reject_all(norms, f"aten's GroupNorm is not measured on {ctx.cost.device_name} "
                                  "(op_efficiency 'group_norm'): no price to hold the kernel against")
            return res
        cands = [c for c in (self._candidate(gm, ctx, res, n) for n in norms) if c is not None]
        res.apply_ranked(ctx, cands)
        return res

    def _candidate(self, gm, ctx, res, node) -> Candidate | None:
        x, groups = node.args[0], get_arg(node, 1, "num_groups")
        w, b = get_arg(node, 2, "weight"), get_arg(node, 3, "bias")
        eps = get_arg(node, 4, "eps", 1e-5)
        xi = ir.info(x) if isinstance(x, fx.Node) else None
        label = node.name
        if xi is None or xi.dtype not in DTYPES:
            res.reject(label, f"dtype {None if xi is None else xi.dtype} (fp32, bf16, fp16 only)")
            return None
        if not 3 <= len(xi.shape) <= 5 or xi.symbolic or not isinstance(groups, int) or xi.shape[1] % groups:
            res.reject(label, "not a static [N, C, ...] input of 3 to 5 dims with C divisible by the groups")
            return None
        if any(a is not None and not isinstance(a, fx.Node) for a in (w, b)) or not isinstance(eps, (int, float)):
            res.reject(label, "a weight, bias or eps that is not a graph value")
            return None
        act, a = _activation(node)
        matched = [node] + ([act] if act is not None else [])
        args = (x, groups, w, b, float(eps), a)
        r = ctx.replacement()
        r.call(torch.ops.graphopt.group_norm.default, *args, val=matched[-1].meta.get("val"))
        gain = ctx.node_time(matched) - r.time()
        return Candidate(f"group_norm ({groups} group{'s' if groups != 1 else ''})"
                         f"{' + ' + a if act is not None else ''} -> graphopt::group_norm",
                         matched, gain, lambda: self._apply(gm, matched, args), label=label, replacement=r)

    @staticmethod
    def _apply(gm, matched, args):
        g = gm.graph
        top = matched[-1]
        with g.inserting_before(top):
            new = g.call_function(torch.ops.graphopt.group_norm.default, args)
        set_meta(gm, [new])
        top.replace_all_uses_with(new)
        for n in reversed(matched):
            g.erase_node(n)
        return new
