"""fuse_rms_norm: RMSNorm (and residual add + RMSNorm) -> ``graphopt::add_rms_norm``.

Matches RMSNorm as Hugging Face writes it (LlamaRMSNorm, Glm4RMSNorm, Qwen2RMSNorm...)::

    h = x.to(float32)                      # optional; a no-op cast in fp32 models
    var = h.pow(2).mean(-1, keepdim=True)   # or h * h
    normed = h * rsqrt(var + eps)           # either operand order
    out = weight * normed.to(x.dtype)       # cast optional, either operand order

and ``aten.rms_norm`` (torch.nn.RMSNorm). When ``x`` is itself ``residual + y`` (same shapes and
dtypes) the add is absorbed: ``add_rms_norm(y, residual, weight, eps)`` returns the normalized
output and ``h = y + residual``, which replaces the add for its other readers (the residual
stream of a decoder layer). Numerics are the kernel's contract: h rounded to x's dtype, fp32
statistics, ``weight * normed.to(x.dtype)`` -- exactly HF's roundings.

A sandwich norm (GLM-4: ``post_self_attn_layernorm`` on the attention's output, the residual add,
then ``post_attention_layernorm``; likewise after the MLP) is then one more step: a plain fused
RMSNorm whose output only feeds the next residual add + RMSNorm becomes, with it,
``rms_norm_add_rms_norm(y, residual, weight_y, weight)`` -- one pass that reads y and the residual
and writes the normalized output and h, instead of writing y's norm (and an unread copy of y) for
the next kernel to read back. Cost-gated; rows wider than the kernel's limit are refused.

Refused, with the reason recorded: normalization over more than the last dim, ``keepdim=False``,
a weight that is not 1-D of the hidden size, an eps that is not a literal, an output dtype other
than x's (a weight of another dtype promotes), and every candidate on a CPU profile
(``NO_FUSED_KERNELS``: the kernel is a CUDA kernel).

Training graphs too: ``add_rms_norm`` is differentiable (cuda_ext/norm_grad.py), and a candidate's
gain there adds its backward's (eager's derivative kernels of the matched nodes against
``graphopt::fused_norm_backward``, one pass that recomputes the statistics, at its measured rate). The sandwich merge has no backward and is
refused in training with that reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_ext.norm_triton import MAX_HIDDEN
from graphopt.matcher import Alt, Any, Attr, Const, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import requires_grad
from ._norms_common import ADDS, CASTS, backward_gain, is_noop_cast, position, residual_add, residual_operands

aten = torch.ops.aten

def _hf_pattern(cast_in: bool, cast_out: bool) -> Op:
    # (cast_in, cast_out) are separate patterns, not Alt: matcher._needs_single_use does not look
    # inside Alt, so a single_use=False Op under an Alt would still be held to single use.
    x = Any("x")
    h = Op(CASTS, x, name="cast_in", single_use=False) if cast_in else x
    sq = Alt(Op(aten.pow.Tensor_Scalar, h, Const("p", pred=lambda v: v == 2), name="sq"),
             Op(aten.mul.Tensor, h, h, name="sq"))
    var = Op(aten.mean.dim, sq, Any("dims"), Any("keepdim"), name="mean")
    rstd = Op(aten.rsqrt.default, Op(ADDS + (aten.add.Scalar,), var, Any("eps"), name="add_eps", commutative=True),
              name="rsqrt")
    normed = Op(aten.mul.Tensor, h, rstd, name="normed", commutative=True)
    out = Op(CASTS, normed, name="cast_out") if cast_out else normed
    return Op(aten.mul.Tensor, Attr("weight"), out, name="out", commutative=True)


HF_PATTERNS = [_hf_pattern(ci, co) for ci in (True, False) for co in (True, False)]
ATEN_PATTERN = Op(aten.rms_norm.default, Any("x"), Any("shape"), Any("weight"), Any("eps"), name="out")


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Site:
    """One RMSNorm found in the graph, in a form both spellings share."""

    def __init__(self, root, x, weight, eps, nodes, cast_in=None, label=""):
        self.root, self.x, self.weight, self.eps, self.nodes, self.cast_in = root, x, weight, eps, nodes, cast_in
        self.label = label or root.name


def _check_weight(weight, x_info) -> str:
    if not isinstance(weight, fx.Node) or ir.info(weight) is None:
        return f"weight {weight!r} is not a tensor"
    w = ir.info(weight)
    if len(w.shape) != 1 or w.shape[0] != x_info.shape[-1]:
        return f"weight {weight.name} has shape {list(w.shape)}, not 1-D over the last dim ({x_info.shape[-1]})"
    if w.device != x_info.device:
        return f"weight {weight.name} is on {w.device}, x on {x_info.device}"
    return ""


def _check_eps(eps) -> str:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps {getattr(eps, 'name', eps)!r} is not a literal number"
    return ""


def _hf_site(m) -> tuple[_Site | None, str]:
    root = m["out"]
    dims, keepdim = m["dims"], m["keepdim"]
    out = ir.info(root)
    cast_in = m.get("cast_in")
    # the input: the cast's source, unless the cast is not the norm's upcast (then the cast is x)
    choices = [(m["x"], cast_in), (cast_in, None)] if cast_in is not None else [(m["x"], None)]
    why = ""
    for x, cin in choices:
        xi = ir.info(x) if isinstance(x, fx.Node) else None
        if xi is None:
            why = "its input has no tensor metadata"
            continue
        if cin is not None:
            ci = ir.info(cin)
            if not (ci.dtype == xi.dtype or ci.dtype == _compute_dtype(xi.dtype)) or ci.device != xi.device:
                why = f"{cin.name} casts {xi.dtype} to {ci.dtype}, not to the fp32 statistics type"
                continue
        if out is None or out.dtype != xi.dtype or out.shape != xi.shape:
            why = (f"output {root.name} is {getattr(out, 'dtype', None)} {list(getattr(out, 'shape', []))}, "
                   f"input {xi.dtype} {list(xi.shape)}: the kernel returns the input's dtype and shape")
            continue
        nd = len(xi.shape)
        if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] % nd != nd - 1:
            return None, f"normalizes over dims {dims}, not the last dim only"
        if keepdim is not True:
            return None, "mean without keepdim"
        why = _check_weight(m["weight"], xi) or _check_eps(m["eps"])
        if why:
            return None, why
        nodes = [n for n in m.nodes if n is not cin] + ([cin] if cin is not None else [])
        if cin is None and cast_in is not None:
            nodes = [n for n in nodes if n is not cast_in]
        return _Site(root, x, m["weight"], float(m["eps"]), nodes, cin), ""
    return None, why


def _aten_site(m) -> tuple[_Site | None, str]:
    root, x, shape, weight, eps = m["out"], m["x"], m["shape"], m["weight"], m["eps"]
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    if xi is None:
        return None, "its input has no tensor metadata"
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or shape[0] != xi.shape[-1]:
        return None, f"normalized_shape {shape} is not the last dim only"
    if weight is None:
        return None, "no weight (the kernel needs one)"
    if eps is None:
        eps = torch.finfo(xi.dtype).eps
    why = _check_weight(weight, xi) or _check_eps(eps)
    if why:
        return None, why
    out = ir.info(root)
    if out is None or out.dtype != xi.dtype:
        return None, "output dtype differs from the input's"
    return _Site(root, x, weight, float(eps), [root]), ""


def _sandwich_pairs(gm: fx.GraphModule):
    """(first, its output, second, residual) for each fused plain RMSNorm ``first`` whose output
    is read only by the fused residual add + RMSNorm ``second`` (either add operand), of the same
    dtype, and whose h (a copy of its input) nobody reads."""
    op = torch.ops.graphopt.add_rms_norm.default
    for second in list(gm.graph.nodes):
        if second.target is not op or second.args[1] is None:
            continue
        for taken, residual in ((second.args[0], second.args[1]), (second.args[1], second.args[0])):
            if not (isinstance(taken, fx.Node) and taken.target is operator.getitem and taken.args[1] == 0):
                continue
            first = taken.args[0]
            if not (isinstance(first, fx.Node) and first.target is op and first.args[1] is None):
                continue
            if list(taken.users) != [second] or list(first.users) != [taken]:
                continue
            a, b = ir.info(first.args[0]), ir.info(residual)
            if a is None or b is None or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
                continue
            yield first, taken, second, residual
            break


@register
class FuseRmsNorm(Pass):
    name = "fuse_rms_norm"
    family = "fusion"
    description = "RMSNorm (Hugging Face's spelling, aten.rms_norm), with a residual add before it -> add_rms_norm"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        sites = []
        seen, matched = set(), set()
        for pattern, build in [(p, _hf_site) for p in HF_PATTERNS] + [(ATEN_PATTERN, _aten_site)]:
            for m in find(gm, pattern):
                if m.root in seen:
                    continue
                seen.add(m.root)
                matched.update(m.nodes)
                site, why = build(m)
                if site is None:
                    res.reject(f"rms_norm at {m.root.name}", f"not fused: {why}")
                else:
                    sites.append(site)
        # an rsqrt no RMSNorm claimed: say so (an intermediate read elsewhere, or another spelling)
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is aten.rsqrt.default and n not in matched:
                res.reject(f"rsqrt {n.name}", "not fused: not an RMSNorm spelling this pass knows, or one of "
                           "the norm's intermediates is also read outside it")
        candidates = []
        untrainable = ctx.untrainable(torch.ops.graphopt.add_rms_norm.default)
        grad = requires_grad(gm) if ctx.training else {}
        for s in sites:
            if untrainable:
                res.reject(f"rms_norm at {s.root.name}", untrainable)
                continue
            add, why = residual_add(s.x)
            if why:
                res.reject(f"residual add {s.x.name} into rms_norm at {s.root.name}", f"add not absorbed: {why}")
            candidates.append(self._candidate(gm, ctx, s, add, grad))
        res.apply_ranked(ctx, candidates, fused_kernels=True)
        if res.rewrites:  # then the sandwich pairs among the fused norms
            pairs = [self._sandwich(gm, ctx, res, *pair) for pair in _sandwich_pairs(gm)]
            res.apply_ranked(ctx, [c for c in pairs if c is not None], fused_kernels=True)
        return res

    @staticmethod
    def _sandwich(gm, ctx, res, first, taken, second, residual) -> Candidate | None:
        y, wy, eps_y = first.args[0], first.args[2], first.args[3]
        w, eps = second.args[2], second.args[3]
        info = ir.info(y)
        gone = [first, taken, second]
        label = f"rms_norm {first.name} + residual add + rms_norm {second.name}"
        untrainable = ctx.untrainable(torch.ops.graphopt.rms_norm_add_rms_norm.default)
        if untrainable:
            res.reject(label, f"not merged: {untrainable}")
            return None
        if ir.concrete(info.shape[-1], ctx.hints) > MAX_HIDDEN:
            res.reject(label, f"not merged: rows wider than {MAX_HIDDEN} (the one-pass kernel's limit)")
            return None
        gain = ctx.node_time(gone) - ctx.price(torch.ops.graphopt.rms_norm_add_rms_norm.default, y, residual, wy, w,
                                               eps_y, eps, val=second.meta.get("val"))

        def apply():
            g = gm.graph
            with g.inserting_before(second):
                new = g.call_function(torch.ops.graphopt.rms_norm_add_rms_norm.default, (y, residual, wy, w, eps_y, eps))
            new.meta["val"] = second.meta.get("val")
            second.replace_all_uses_with(new)
            for n in (second, taken, first):
                g.erase_node(n)
            return new
        return Candidate("rms_norm + residual add + rms_norm", gone, gain, apply, label=label)

    @staticmethod
    def _candidate(gm, ctx, s: _Site, add, grad: dict) -> Candidate:
        xi = ir.info(s.x)
        # nodes that go away (a real upcast also read elsewhere stays)
        kept = s.cast_in if (s.cast_in is not None and not is_noop_cast(s.cast_in)
                             and any(u not in s.nodes for u in s.cast_in.users)) else None
        gone = [n for n in s.nodes if n is not kept] + ([add] if add is not None else [])
        y, residual = (add.args[0], add.args[1]) if add is not None else (s.x, None)
        new = ctx.price(torch.ops.graphopt.add_rms_norm.default, y, residual, s.weight, s.eps,
                        val=(s.root.meta.get("val"), s.x.meta.get("val")))
        gain = ctx.node_time(gone) - new
        if ctx.training:
            gain += backward_gain(ctx, gone, grad, s.root, s.x, s.weight, None, s.eps)
        pattern = "residual add + rms_norm" if add is not None else "rms_norm"
        label = f"{add.name} + " if add is not None else ""
        label += f"rms_norm {s.root.name} ({s.weight.name})"
        return Candidate(pattern, gone, gain, lambda: FuseRmsNorm._apply(gm, s, add), label=label,
                         refusal="its weight is computed after the point where the fused kernel must run")

    @staticmethod
    def _apply(gm: fx.GraphModule, s: _Site, add):
        g = gm.graph
        # a no-op upcast shared with a norm fused before this one was folded into its input
        while getattr(s.x, "_erased", False) and is_noop_cast(s.x):
            s.x = s.x.args[0]
        if getattr(s.x, "_erased", False):
            return None
        pos = position(gm)
        if add is not None:
            y, residual = residual_operands(add)
            anchor = add.next
            args = (y, residual)
        else:
            # right before the norm's last node: every input of the pattern is defined above it
            # and every reader of its result below (the first pattern node can precede x when
            # two norms share an upcast)
            anchor = s.root
            args = (s.x, None)
        if s.weight.op != "get_attr" and pos[s.weight] >= pos[anchor]:
            return None  # a computed weight defined after the insertion point
        with g.inserting_before(anchor):
            fresh = s.weight.op == "get_attr" and pos[s.weight] >= pos[anchor]
            w = g.get_attr(s.weight.target) if fresh else s.weight
            fused = g.call_function(torch.ops.graphopt.add_rms_norm.default, (args[0], args[1], w, s.eps))
            out = g.call_function(operator.getitem, (fused, 0))
        xv = s.x.meta.get("val")
        out.meta["val"] = s.root.meta.get("val")
        fused.meta["val"] = (out.meta["val"], xv)
        if w is not s.weight:
            w.meta["val"] = s.weight.meta.get("val")
        s.root.replace_all_uses_with(out)
        if s.cast_in is not None and is_noop_cast(s.cast_in):
            s.cast_in.replace_all_uses_with(s.x)
        ir.erase_dead(gm, s.nodes)
        if add is not None:
            if add.users:  # the residual stream (or a kept upcast) reads the sum: the kernel's h
                with g.inserting_after(out):
                    h = g.call_function(operator.getitem, (fused, 1))
                h.meta["val"] = xv
                add.replace_all_uses_with(h)
            g.erase_node(add)
        if w is not s.weight and not s.weight.users:
            g.erase_node(s.weight)
        return fused
