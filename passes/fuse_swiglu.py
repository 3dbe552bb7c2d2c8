"""fuse_swiglu: ``silu(gate) * up`` where gate and up are the two halves of one tensor's last
dim -> ``torch.ops.graphopt.swiglu(gate_up)`` (one kernel: reads gate_up once, writes the
product; eager launches silu and mul and writes/reads the silu output in between).

Spellings: ``gate, up = gate_up.chunk(2, -1)`` (GLM-4), ``split(gate_up, H, -1)``,
``split_with_sizes(gate_up, [H, H], -1)`` (what merge_sibling_linears makes of Llama's
gate_proj/up_proj), ``gate_up[..., :H]`` / ``gate_up[..., H:]`` slices; ``silu(g) * u`` and
``u * silu(g)``. The halves are proven from metadata: same base tensor, split along its last
dim (any spelling of it), gate = [0, H), up = [H, 2H), 2H the whole last dim, and the product
has the halves' shape and dtype (no broadcasting, no promotion).

Refused: the silu output read elsewhere (the kernel does not produce it: no gain), halves
that are not the first/second halves of one tensor, dtype promotion, a CPU profile.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Const, Op, find, match
from graphopt.pipeline import NO_FUSED_KERNELS, Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import set_meta

aten = torch.ops.aten


def _pattern(single_use: bool):
    return Op(aten.mul.Tensor, Op(aten.silu.default, Any("gate"), name="silu", single_use=single_use), Any("up"),
              name="mul", commutative=True)


PATTERN = _pattern(True)
LOOSE = _pattern(False)  # to report silu outputs that are read elsewhere

# one piece of a tensor along a dim: getitem of chunk/split/split_with_sizes, or a slice
PIECE = Op(operator.getitem,
           Op((aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.split_with_sizes_copy.default),
              Any("base"), Any("size"), Any("dim"), name="splitter", single_use=False),
           Const("idx"), name="item", single_use=False)
SLICE = Op(aten.slice.Tensor, Any("base"), Any("dim"), Any("start"), Any("end"), Const("step", 1), name="slice",
           single_use=False)


def piece(node) -> tuple | str:
    """(base, start, stop) of ``node`` as a contiguous range of its base's last dim, or a reason."""
    if not isinstance(node, fx.Node):
        return f"{node!r} is not a tensor"
    m = match(PIECE, node)
    if m is not None:
        base, spl = m["base"], m["splitter"]
        bi = ir.info(base)
        dim = m["dim"] if m["dim"] is not None else 0
        if not isinstance(dim, int) or dim % len(bi.shape) != len(bi.shape) - 1:
            return f"{spl.name} splits dim {dim}, not the last"
        n = bi.shape[-1]
        if not isinstance(n, int):
            return f"{base.name}'s last dim is symbolic"
        if spl.target is aten.chunk.default:
            step = -(-n // m["size"])
            sizes = [min(step, n - i) for i in range(0, n, step)]
        elif spl.target is aten.split.Tensor:
            sizes = [min(m["size"], n - i) for i in range(0, n, m["size"])]
        else:
            sizes = list(m["size"])
        idx = m["idx"]
        if not isinstance(idx, int) or not 0 <= idx < len(sizes):
            return f"{node.name} picks piece {idx!r}"
        start = sum(sizes[:idx])
        return base, start, start + sizes[idx]
    m = match(SLICE, node)
    if m is not None:
        base = m["base"]
        bi = ir.info(base)
        n = bi.shape[-1]
        dim = m["dim"] if m["dim"] is not None else 0
        if not isinstance(dim, int) or dim % len(bi.shape) != len(bi.shape) - 1 or not isinstance(n, int):
            return f"{node.name} slices dim {dim}, not the (static) last"
        start, end = m["start"], m["end"]
        if not isinstance(start or 0, int) or not isinstance(end if end is not None else n, int):
            return f"{node.name} has symbolic bounds"
        s = slice(start, end).indices(n)
        return base, s[0], s[1]
    return f"{node.name} ({ir.target_name(node) if node.op == 'call_function' else node.op}) is not a slice of a tensor's last dim"


@register
class FuseSwiglu(Pass):
    name = "fuse_swiglu"
    family = "fusion"
    description = "silu(gate) * up over the two halves of one tensor -> graphopt.swiglu"
    requires = ("merge_sibling_linears",)
    inference_only = True  # graphopt's kernels have no autograd formulas

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates, seen = [], set()
        for m in find(gm, PATTERN):
            seen.add(m["mul"])
            why, base = self._prove(m)
            label = f"{m['silu'].name} * {getattr(m['up'], 'name', m['up'])}"
            if why:
                res.reject(label, why)
                continue
            if not ctx.fused_kernels:
                res.reject(label, NO_FUSED_KERNELS)
                continue
            gain = ctx.node_time([m["mul"], m["silu"]]) - self._new_time(ctx, base, m["mul"])
            candidates.append(Candidate("silu(gate) * up", [m["mul"], m["silu"]], gain,
                                        lambda m=m, base=base: self._apply(gm, m, base), label=label))
        for m in find(gm, LOOSE):
            if m["mul"] not in seen:
                res.reject(f"{m['silu'].name} * {getattr(m['up'], 'name', m['up'])}",
                           f"the silu output {m['silu'].name} is also read elsewhere; swiglu does not produce it")
        res.apply_ranked(ctx, candidates)
        return res

    @staticmethod
    def _prove(m) -> tuple[str, fx.Node | None]:
        g, u = piece(m["gate"]), piece(m["up"])
        for who, p in (("gate", g), ("up", u)):
            if isinstance(p, str):
                return f"{who}: {p}", None
        if g[0] is not u[0]:
            return f"gate and up are slices of different tensors ({g[0].name}, {u[0].name})", None
        base = g[0]
        bi, oi = ir.info(base), ir.info(m["mul"])
        n = bi.shape[-1]
        if n % 2 or (g[1], g[2]) != (0, n // 2) or (u[1], u[2]) != (n // 2, n):
            return (f"gate is [{g[1]}, {g[2]}) and up [{u[1]}, {u[2]}) of {base.name}'s last dim {n}; "
                    "swiglu needs gate = first half, up = second half"), None
        if oi is None or tuple(oi.shape) != tuple(bi.shape[:-1]) + (n // 2,) or oi.dtype != bi.dtype:
            return "the product broadcasts or promotes (shape/dtype differ from the halves')", None
        if ir.info(m["silu"]).dtype != bi.dtype:
            return "silu output dtype differs from gate_up's", None
        return "", base

    @staticmethod
    def _new_time(ctx, base, mul) -> float:
        """swiglu(gate_up), which makes a strided gate_up contiguous first (free when it is)."""
        r = ctx.replacement()
        r.call(torch.ops.graphopt.swiglu.default, r.call(aten.contiguous.default, base), val=mul.meta.get("val"))
        return r.time()

    @staticmethod
    def _apply(gm, m, base) -> fx.Node:
        g = gm.graph
        mul = m["mul"]
        live = piece(m["gate"])  # live: an earlier rewrite may have replaced the base node
        if isinstance(live, str):
            return None
        base = live[0]
        with g.inserting_before(mul):
            new = g.call_function(torch.ops.graphopt.swiglu.default, (base,))
        set_meta(gm, [new])
        mul.replace_all_uses_with(new)
        dead = [mul, m["silu"], m["gate"], m["up"]]
        for p in (m["gate"], m["up"]):
            if isinstance(p, fx.Node) and p.target is operator.getitem:
                dead.append(p.args[0])
        ir.erase_dead(gm, dead)
        return new
