"""Helpers shared by fuse_rms_norm, fuse_layer_norm and fuse_rotary (not a pass: the leading
underscore keeps passes/__init__ from importing it as one).

- :class:`Seq`: a matcher pattern for a list argument (``cat``/``stack`` inputs), element-wise.
- :func:`residual_add`: is a norm's input ``residual + y`` that the fused residual-norm kernel can
  absorb (same shape and dtype, no alpha)?
"""

from __future__ import annotations

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
