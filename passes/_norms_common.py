"""Helpers shared by fuse_rms_norm, fuse_layer_norm and fuse_rotary (not a pass: the leading
underscore keeps passes/__init__ from importing it as one).

- :class:`Seq`: a matcher pattern for a list argument (``cat``/``stack`` inputs), element-wise.
- :func:`residual_add`: is a norm's input ``residual + y`` that the fused residual-norm kernel can
  absorb (same shape and dtype, no alpha)?
- :func:`backward_gain`: in a training graph, what the fused norm's backward saves (or costs)
  against eager's derivative kernels of the nodes it replaces.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Op, Pattern, _bind, match

aten = torch.ops.aten

CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.to.device)
ADDS = (aten.add.Tensor,)


class Seq(Pattern):
    """A list/tuple argument whose elements match ``items`` in order."""

    def __init__(self, *items: Pattern, name: str | None = None):
        self.items, self.name = items, name

    def match(self, value, m):
        if not isinstance(value, (list, tuple)) or len(value) != len(self.items):
            return m.fail(f"{self.name or 'list'} is {value!r}, wanted {len(self.items)} items")
        if not all(p.match(v, m) for p, v in zip(self.items, value)):
            return False
        return _bind(self.name, value, m)


def is_noop_cast(node: fx.Node) -> bool:
    src = node.args[0] if node.args else None
    a, b = ir.info(node), ir.info(src) if isinstance(src, fx.Node) else None
    return a is not None and b is not None and a.dtype == b.dtype and a.device == b.device


RESIDUAL = Op(ADDS, Any("a"), Any("b"), name="add")


def residual_add(x: fx.Node) -> tuple[fx.Node | None, str]:
    """(the add node, "") if ``x`` is an add the residual-norm kernel can absorb, else (None, why)
    (why is "" when x simply is not an add)."""
    if not isinstance(x, fx.Node) or x.op != "call_function" or x.target not in ADDS:
        return None, ""
    m = match(RESIDUAL, x)
    if m is None:
        return None, ""
    a, b = m["a"], m["b"]
    alpha = x.kwargs.get("alpha", 1)
    if alpha != 1:
        return None, f"{x.name} has alpha={alpha}"
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None, f"{x.name} adds a literal"
    out, ia, ib = ir.info(x), ir.info(a), ir.info(b)
    if out is None or ia is None or ib is None:
        return None, f"{x.name} has no tensor metadata"
    if ia.shape != out.shape or ib.shape != out.shape:
        return None, (f"{x.name} broadcasts ({list(ia.shape)} + {list(ib.shape)}); the kernel would "
                      "materialize the broadcast residual")
    if ia.dtype != out.dtype or ib.dtype != out.dtype:
        return None, f"{x.name} promotes dtypes ({ia.dtype} + {ib.dtype} -> {out.dtype})"
    if ia.device != out.device or ib.device != out.device:
        return None, f"{x.name} mixes devices"
    return x, ""


def residual_operands(add: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(y, residual) of an absorbed add, read at apply time (earlier rewrites may have replaced
    an operand). The residual is the operand that is also read elsewhere (the skip connection)."""
    a, b = add.args[0], add.args[1]
    if len(a.users) > 1 and len(b.users) == 1:
        return b, a
    return a, b


def position(gm: fx.GraphModule) -> dict:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


NORMS = (aten.layer_norm.default, aten.rms_norm.default)


def _norm_backward(r, g, h, weight, bias, eps: float, recompute: bool, fused: bool = False, rms: bool = False) -> None:
    """A norm's backward on the builder ``r``: ``fused``, graphopt::fused_norm_backward (statistics, input
    and weight gradients in one pass: the fused norms' backward on CUDA); else (the row statistics
    recomputed from h,) then one backward kernel, priced as aten's LayerNorm kernels (RMSNorm's
    move the same bytes)."""
    hs = [ir.info(h).shape[-1]]
    if fused:
        r.call(torch.ops.graphopt.fused_norm_backward.default, g, h, weight, None, eps,
               weight is not None or bias is not None, rms)
        return
    if recompute:
        stats = r.call(aten.native_layer_norm.default, h, hs, None, None, eps)
        mean, rstd = r.call(operator.getitem, stats, 1), r.call(operator.getitem, stats, 2)
    else:  # eager saved them in its forward
        shape = tuple(ir.info(h).shape[:-1]) + (1,)
        mean = rstd = r.tensor(shape, torch.float32, ir.info(h).device)
    r.call(aten.native_layer_norm_backward.default, g, h, hs, mean, rstd, weight, bias, [True, weight is not None,
                                                                                        bias is not None])


def backward_gain(ctx, gone, grad: dict, out: fx.Node, h: fx.Node, weight, bias, eps: float) -> float:
    """Predicted seconds the backward of a fused norm (graphopt.cuda_ext.norm_grad) saves in a
    training graph, against eager's backward of the nodes ``gone`` (negative where it costs more).
    Eager: an aten norm's backward kernel, an elementwise kernel per operand taking a gradient for
    the other nodes (a reduction's of its input's shape), nothing for an add (autograd hands its
    gradient on). Fused: the statistics recomputed from h (``out``: a tensor shaped as the
    output's gradient), then the norm's backward kernel. ``grad``: _fusion_meta.requires_grad."""
    eager = ctx.replacement()
    for n in gone:
        if not grad.get(n, False):
            continue
        if n.target in NORMS:
            _norm_backward(eager, n, n.args[0], weight, bias, eps, recompute=False)
            continue
        if n.target in ADDS + (aten.add.Scalar,) and n.kwargs.get("alpha", 1) == 1:
            continue
        shaped = n.args[0] if n.target is aten.mean.dim else n
        for a in n.args:
            if isinstance(a, fx.Node) and grad.get(a, False):
                eager.call(aten.mul.Tensor, shaped, shaped)
    fused = ctx.replacement()
    _norm_backward(fused, out, h, weight, bias, eps, recompute=True, fused=ctx.fused_kernels,
                   rms=not any(n.target is aten.layer_norm.default for n in gone))
    return eager.time() - fused.time()
