"""fuse_layer_norm: residual add + LayerNorm over the last dim -> ``graphopt::add_layer_norm``.

Matches ``aten.layer_norm(x, [H], weight?, bias?, eps)`` where H is x's last dim. When x is
``residual + y`` (same shapes and dtypes) the add is absorbed and the kernel's second output
``h = y + residual`` replaces the add for its other readers: pre-norm stacks (ViT) keep it as the
residual stream; in post-norm stacks (BERT) nothing else reads it and it is dropped. The fused op
is ``add_layer_norm`` (one block per row) or, where the cost model prices it lower (narrow rows,
whose one-block-per-row floor the profile measures), ``add_layer_norm_rows`` (many rows per
program, the many-rows layer_norm's kernel with the residual summed in). Where the
norm reads the sum through a permute (a conv net's channels-first residual stream normalized over
its channels: ``layer_norm((a + b).permute(0, 2, 3, 1), [C])``), the kernel reads the permuted
operands, and the add's other readers get its sum permuted back; only where both permuted operands
are rows already in memory (no copy for the kernel to make).

A LayerNorm without a residual add becomes ``graphopt::layer_norm``, a Triton kernel that
normalizes many rows per program, where the cost model predicts a gain: aten's kernel (and
add_layer_norm) give each row a thread block, which the profile's measured ``row_norm`` entry prices
for narrow rows (ConvNeXt's 96-768 channels); for transformer-sized rows the two predict the same
and the aten op stays. Refused with the reason recorded: normalized_shape other than the last
dim alone, weight/bias not 1-D of the hidden size, an eps that is not a literal, an add that
broadcasts or promotes dtypes (the add is then left alone), and everything on a CPU profile
(``NO_FUSED_KERNELS``).

Training graphs too: both ops are differentiable (cuda_ext/norm_grad.py). On CUDA their backward is
``graphopt::fused_norm_backward``, one pass that recomputes the row statistics eager's LayerNorm saved
and sums the weight gradients; a candidate's training gain prices it and aten's LayerNorm backward
each at the rate the profile measured for it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Op, find, get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from graphopt.cuda_ext.norm_triton import MAX_HIDDEN

from ._fusion_meta import requires_grad, set_meta
from ._norms_common import backward_gain, position, residual_add, residual_operands

aten = torch.ops.aten

PATTERN = Op(aten.layer_norm.default, Any("x"), Any("shape"), Any("weight"), Any("bias"), Any("eps"), name="ln")


def _check(m) -> str:
    ln, x, shape = m["ln"], m["x"], m["shape"]
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    if xi is None or not xi.shape:
        return "its input has no tensor metadata"
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or shape[0] != xi.shape[-1]:
        return f"normalized_shape {list(shape) if isinstance(shape, (list, tuple)) else shape} is not the last dim only"
    for what in ("weight", "bias"):
        p = m[what]
        if p is None:
            continue
        pi = ir.info(p) if isinstance(p, fx.Node) else None
        if pi is None or len(pi.shape) != 1 or pi.shape[0] != xi.shape[-1]:
            return f"{what} {getattr(p, 'name', p)} is not 1-D over the last dim ({xi.shape[-1]})"
    eps = m["eps"]
    if eps is None:
        eps = 1e-5
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps {getattr(eps, 'name', eps)!r} is not a literal number"
    out = ir.info(ln)
    if out is None or out.dtype != xi.dtype:
        return "output dtype differs from the input's"
    return ""


def _permuted_add(x) -> tuple[fx.Node | None, str]:
    """(the add, "") if ``x`` is a permute of a residual add whose permuted operands are rows in
    memory (the kernel reads them without a copy), else (None, why) (why is "" when x is no
    permute of an add)."""
    if not isinstance(x, fx.Node) or x.target is not aten.permute.default:
        return None, ""
    add, why = residual_add(x.args[0])
    if add is None:
        return None, why
    perm = x.args[1]
    for t in add.args[:2]:
        v = t.meta.get("val")
        if not isinstance(v, torch.Tensor) or not v.permute(perm).is_contiguous():
            return None, f"{t.name} permuted as {x.name} is not rows in memory (the kernel would copy it)"
    return add, ""


@register
class FuseLayerNorm(Pass):
    name = "fuse_layer_norm"
    family = "fusion"
    description = "residual add + LayerNorm over the last dim -> add_layer_norm; narrow-row LayerNorm -> many-rows layer_norm (cost-gated)"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates = []
        grad = requires_grad(gm) if ctx.training else {}
        for m in find(gm, PATTERN):
            why = _check(m)
            if why:
                res.reject(f"layer_norm {m['ln'].name}", f"not fused: {why}")
                continue
            add, why = residual_add(m["x"])
            if add is None and not why:
                add, why = _permuted_add(m["x"])
            if why:
                res.reject(f"residual add {m['x'].name} into layer_norm {m['ln'].name}", f"add not absorbed: {why}")
            c = self._candidate(gm, ctx, m, add, res, grad)
            if c is not None:
                candidates.append(c)
        res.apply_ranked(ctx, candidates, fused_kernels=True)
        return res

    @staticmethod
    def _candidate(gm, ctx, m, add, res, grad) -> Candidate | None:
        ln, x = m["ln"], m["x"]
        xi = ir.info(x)
        gone = [ln] + ([add] if add is not None else [])
        y, residual = (add.args[0], add.args[1]) if add is not None else (x, None)
        eps = 1e-5 if m["eps"] is None else float(m["eps"])
        label = (f"{add.name} + " if add is not None else "") + f"layer_norm {ln.name}"
        refusal = "its weight or bias is computed after the point where the fused kernel must run"
        op = torch.ops.graphopt.add_layer_norm.default if add is not None else torch.ops.graphopt.layer_norm.default
        untrainable = ctx.untrainable(op)
        if untrainable:
            res.reject(label, untrainable)
            return None
        # training: the fused backward recomputes the statistics eager's saved
        bw = backward_gain(ctx, gone, grad, ln, x, m["weight"], m["bias"], eps) if ctx.training else 0.0
        if add is not None:
            # add_layer_norm (one block per row, like aten's) or, where it prices lower (narrow rows),
            # add_layer_norm_rows (many rows per program); through a permute, the kernel reads permuted views
            permuted = add is not x
            if permuted:
                gone.append(x)
            prices = {}
            for fused_op in (torch.ops.graphopt.add_layer_norm.default, torch.ops.graphopt.add_layer_norm_rows.default):
                if fused_op is torch.ops.graphopt.add_layer_norm_rows.default and (
                        ir.concrete(xi.shape[-1], ctx.hints) > MAX_HIDDEN or ctx.untrainable(fused_op)):
                    continue
                r = ctx.replacement()
                a, b = (r.call(aten.permute.default, t, x.args[1]) for t in (y, residual)) if permuted else (y, residual)
                r.call(fused_op, a, b, m["weight"], m["bias"], eps, val=(ln.meta.get("val"), x.meta.get("val")))
                prices[fused_op] = r.time()
            fused_op = min(prices, key=lambda o: (prices[o], o is not torch.ops.graphopt.add_layer_norm.default))
            pattern = "residual add + " + ("permute + " if permuted else "") + (
                "layer_norm" if fused_op is torch.ops.graphopt.add_layer_norm.default else "layer_norm -> many-rows add_layer_norm")
            return Candidate(pattern, gone, ctx.node_time(gone) - prices[fused_op] + bw,
                             lambda: FuseLayerNorm._apply(gm, m, add, eps, fused_op), label=label, refusal=refusal)
        if ir.concrete(xi.shape[-1], ctx.hints) > MAX_HIDDEN:
            res.reject(label, f"rows wider than {MAX_HIDDEN} (the many-rows kernel's limit)")
            return None
        # graphopt::layer_norm (Triton): many rows per program, no per-row block to schedule
        new = ctx.price(torch.ops.graphopt.layer_norm.default, x, m["weight"], m["bias"], eps, val=ln.meta.get("val"))
        return Candidate("layer_norm -> many-rows layer_norm", gone, ctx.node_time(gone) - new + bw,
                         lambda: FuseLayerNorm._apply_plain(gm, m, eps), label=label, refusal=refusal)

    @staticmethod
    def _apply_plain(gm: fx.GraphModule, m, eps):
        g = gm.graph
        ln = m["ln"]
        # the layer_norm's operands as they are now: an earlier rewrite may have replaced its input
        # (a LayerNorm reading another LayerNorm that became graphopt::layer_norm)
        x, weight, bias = (get_arg(ln, i, k) for i, k in ((0, "input"), (2, "weight"), (3, "bias")))
        with g.inserting_before(ln):
            new = g.call_function(torch.ops.graphopt.layer_norm.default, (x, weight, bias, eps))
        new.meta["val"] = ln.meta.get("val")
        ln.replace_all_uses_with(new)
        g.erase_node(ln)
        return new

    @staticmethod
    def _apply(gm: fx.GraphModule, m, add, eps, fused_op=torch.ops.graphopt.add_layer_norm.default):
        g = gm.graph
        ln = m["ln"]
        pos = position(gm)
        weight, bias = get_arg(ln, 2, "weight"), get_arg(ln, 3, "bias")  # as they are now
        x = m["x"]
        perm = x.args[1] if add is not None and add is not x else None
        if add is not None:
            y, residual = residual_operands(add)
            anchor = add.next
        else:
            y, residual, anchor = get_arg(ln, 0, "input"), None, ln
        params = []
        for p in (weight, bias):
            if isinstance(p, fx.Node) and p.op != "get_attr" and pos[p] >= pos[anchor]:
                return None
        with g.inserting_before(anchor):
            for p in (weight, bias):
                if isinstance(p, fx.Node) and p.op == "get_attr" and pos[p] >= pos[anchor]:
                    q = g.get_attr(p.target)
                    q.meta["val"] = p.meta.get("val")
                    params.append(q)
                else:
                    params.append(p)
            if perm is not None:
                y, residual = (g.call_function(aten.permute.default, (t, perm)) for t in (y, residual))
                set_meta(gm, [y, residual])
            fused = g.call_function(fused_op, (y, residual, params[0], params[1], eps))
            out = g.call_function(operator.getitem, (fused, 0))
        xv = m["x"].meta.get("val")
        out.meta["val"] = ln.meta.get("val")
        fused.meta["val"] = (out.meta["val"], xv)
        ln.replace_all_uses_with(out)
        g.erase_node(ln)
        if perm is not None:  # the permuted sum is the kernel's h; the add's other readers get it permuted back
            with g.inserting_after(out):
                h = g.call_function(operator.getitem, (fused, 1))
            h.meta["val"] = xv
            x.replace_all_uses_with(h)
            g.erase_node(x)
            if add.users:
                inverse = [0] * len(perm)
                for i, d in enumerate(perm):
                    inverse[d % len(perm)] = i
                with g.inserting_after(h):
                    back = g.call_function(aten.permute.default, (h, inverse))
                set_meta(gm, [back])
                add.replace_all_uses_with(back)
            g.erase_node(add)
        elif add is not None:
            if add.users:  # pre-norm: the sum is the residual stream -> the kernel's h output
                with g.inserting_after(out):
                    h = g.call_function(operator.getitem, (fused, 1))
                h.meta["val"] = xv
                add.replace_all_uses_with(h)
            g.erase_node(add)
        for p, q in zip((weight, bias), params):
            if isinstance(p, fx.Node) and q is not p and not p.users:
                g.erase_node(p)
        return fused
