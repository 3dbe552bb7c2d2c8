"""lower_attention: short-sequence ``scaled_dot_product_attention`` -> graphopt::short_attention.

At small batch the SDPA backends cost more around their kernel than in it (cuDNN adds a memset
and launch gaps inside a CUDA graph). The bundled one-tile Triton kernel
(cuda_ext/attention_triton.py) holds every key of a head in one tile, so it needs no running
maximum, no second pass and no workspace (``benchmarks/diag/diag_attention_small.py`` compares
them).

Applies to an SDPA call in an inference graph on a CUDA profile when:
* q, k, v are 4-D bf16/fp16 with static shapes, at most ``MAX_KEYS`` (256) keys and a head dim of
  at most 128 (one under 16 or not a multiple of 8 is padded in registers); grouped-query attention
  (``enable_gqa``) when q's heads are a multiple of k's;
* dropout is 0;
* the mask is absent, boolean, or a float tensor (additive), broadcastable to [B, H, Sq, Sk];
* the profile has measured the kernel (``op_efficiency["short_attention"]``), and it is predicted at most
  ``MARGIN`` (75%) of SDPA's time: the margin covers the SDPA fit's error at these sizes, which
  overestimates cuDNN most on short causal sequences.

Same semantics (a row whose every key is masked out gives zeros, as SDPA's safe softmax); the
probabilities are rounded to v's dtype before the product with v, as the flash kernels round
theirs, and the output is laid out [B, S, H, D], so the ``transpose(1, 2).reshape`` that usually
follows is a view. The op has no backward: inference graphs only.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MARGIN = 0.75


def _static(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in shape)
    except TypeError:
        return None


@register
class LowerAttention(Pass):
    name = "lower_attention"
    family = "lower"
    description = ("short-sequence SDPA (<= 256 keys, bf16/fp16, inference) -> graphopt::short_attention, one "
                   "Triton tile per query block (no memset, no workspace)")
    inference_only = True  # the bundled op has no backward
    requires = ("fuse_attention",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]
        if not calls:
            return res
        if ctx.cost.device_kind != "cuda":
            res.reject_all(calls, f"the bundled attention kernel is for CUDA; {ctx.cost.device_name} runs SDPA")
            return res
        if not ctx.cost.measured("short_attention"):
            res.reject_all(calls, f"profile {ctx.cost.device_name} has no measurement of graphopt::short_attention "
                                  "(op_efficiency short_attention; benchmarks/diag/diag_attention_small.py)")
            return res
        cands = [c for c in (self._candidate(gm, ctx, res, n) for n in calls) if c is not None]
        res.apply_ranked(ctx, cands, fused_kernels=True)
        return res

    def _candidate(self, gm, ctx, res, node) -> Candidate | None:
        label = node.name
        why, args = legal(node)
        if why:
            res.reject(label, why)
            return None
        old = ctx.node_time([node])
        new = self._time_of(ctx, node, args)
        if new > MARGIN * old and not ctx.ignore_cost:
            res.reject(label, f"predicted {new * 1e6:.1f} us against SDPA's {old * 1e6:.1f} us "
                              f"(applied below {MARGIN:.0%} of SDPA's: the SDPA fit's error)")
            return None
        qs, ks = _static(ir.info(args[0]).shape), _static(ir.info(args[1]).shape)
        causal = args[5]
        desc = f"SDPA {qs[0]}x{qs[1]}x{qs[2]}x{ks[2]}x{qs[3]}{' causal' if causal else ''} -> short_attention"
        return Candidate(desc, [node], old - new, lambda: self._apply(gm, node, args), label=label)

    @staticmethod
    def _time_of(ctx, like: fx.Node, args) -> float:
        """Predicted time of the short_attention node the rewrite makes."""
        from graphopt.cuda_ext.ops.short_attention import layout as short_attention_layout

        return ctx.price(torch.ops.graphopt.short_attention.default, *args, val=short_attention_layout(args[0].meta["val"]))

    @staticmethod
    def _apply(gm, node, args):
        from graphopt.cuda_ext.ops.short_attention import layout as short_attention_layout

        g = gm.graph
        with g.inserting_before(node):
            new = g.call_function(torch.ops.graphopt.short_attention.default, args)
        new.meta["val"] = short_attention_layout(args[0].meta["val"])
        node.replace_all_uses_with(new)
        g.erase_node(node)
        return new


def legal(node: fx.Node):
    """(why not, args): the short_attention arguments (q, k, v, mask, scale, is_causal) of an SDPA
    node the kernel takes, or the reason it does not ("" and the arguments when it does)."""
    from graphopt.cuda_ext.attention_triton import mask_problem, supported

    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = get_arg(node, 3, "attn_mask")
    dropout = get_arg(node, 4, "dropout_p")
    causal = bool(get_arg(node, 5, "is_causal"))
    scale = get_arg(node, 6, "scale")
    gqa = bool(get_arg(node, 7, "enable_gqa"))
    qi, ki, vi = ir.info(q), ir.info(k), ir.info(v)
    if qi is None or ki is None or vi is None:
        return "q, k or v has no tensor metadata", None
    qs, ks, vs = _static(qi.shape), _static(ki.shape), _static(vi.shape)
    if qs is None or ks is None or vs is None:
        return "symbolic shapes: the kernel's one tile needs the key count known", None
    why = supported(qs, ks, qi.dtype)
    if why is not None:
        return why, None
    if ki.dtype != qi.dtype or vi.dtype != qi.dtype or ks != vs or ks[0] != qs[0] or ks[3] != qs[3]:
        return f"q, k, v do not line up ({qs} {qi.dtype}, {ks} {ki.dtype}, {vs} {vi.dtype})", None
    if ks[1] != qs[1] and not gqa:
        return f"{qs[1]} query heads over {ks[1]} key heads without enable_gqa", None
    if dropout not in (None, 0, 0.0):
        return f"dropout {dropout} (the kernel draws no random numbers)", None
    if isinstance(scale, fx.Node):
        return "the scale is a tensor, not a number", None
    if mask is not None:
        mi = ir.info(mask) if isinstance(mask, fx.Node) else None
        ms = _static(mi.shape) if mi is not None else None
        if mi is None or ms is None:
            return "the mask is not a tensor of static shape", None
        why = mask_problem(ms, mi.dtype, (*qs[:3], ks[2]))
        if why is not None:
            return why, None
    scale = float(qs[3] ** -0.5 if scale is None else scale)
    return "", (q, k, v, mask, scale, causal)


def lowered_time(ctx: PassContext, node: fx.Node) -> float | None:
    """The predicted time of the short_attention call this pass would make of SDPA ``node`` (a node
    of the graph or of a Replacement), or None where it would not: a pass that makes SDPA prices
    what runs after this pass (fuse_attention)."""
    if ctx.training or ctx.cost.device_kind != "cuda" or not ctx.cost.measured("short_attention"):
        return None
    why, args = legal(node)
    if why:
        return None
    new = LowerAttention._time_of(ctx, node, args)
    return new if new <= MARGIN * ctx.node_time([node]) else None
