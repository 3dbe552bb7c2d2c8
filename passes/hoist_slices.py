"""hoist_slices: the pieces of a pointwise op's result become the pointwise op over the same pieces of
its operands, so each piece's computation can fuse with what reads it.

    y = masked_fill(x, row_mask, 0.0)          # x: [S, 2I], row_mask: [S, 1]
    gate, up = y.chunk(2, -1)
    h = silu(gate) * up
 -> gate = masked_fill(x[:, :I], row_mask, 0.0)
    up = masked_fill(x[:, I:], row_mask, 0.0)
    h = silu(gate) * up                       # fuse_elementwise: one kernel reading x once

Before, ``y`` is written whole and read back by the pieces' readers (and a gate-and-up kernel
cannot take the masked_fill as a prologue); after, fuse_elementwise joins each piece's pointwise op
with its readers and ``y`` is never written. transformers' grouped-GEMM experts mask the gate-up
projection's padding rows this way; a bias added, a cast or a scale applied before a split are the
same shape of graph.

Legality, per pointwise node P (an op fuse_elementwise expresses, or a cast):
* every reader of P is a piece of it along one dim d: an item of split / split_with_sizes / chunk,
  or a step-1 slice / narrow, with static bounds; the pieces do not overlap (nothing is computed
  twice);
* each tensor operand of P, aligned with P's output from the right, either has P's size along d
  (it is sliced the same way) or broadcasts there (size 1, or no such dim; it is read as is);
* nothing writes P's result in place, and the graph returns no piece (the caller would get a new
  tensor where it had a view);
* P is not an activation of a convolution or GEMM: that is the GEMM's epilogue, which
  fuse_bias_act and fuse_conv_relu take whole (CSPDarknet's LeakyReLU before its channel split);
* static shapes.
The new nodes stand where P stood, so they read what P read.

Profitability: each piece has a pointwise reader fuse_elementwise can join (a concatenation, a
reduction or a GEMM reading a piece fuses nothing with it); the gain is P's own kernel, which
that fusion removes (fuse_elementwise prices the groups it forms). Without fuse_elementwise scheduled
on a GPU profile nothing would fuse the pieces, and the pass leaves the graph as it is.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import set_meta
from ._slices import arg, node_range, split_bounds

aten = torch.ops.aten

SLICES = (aten.slice.Tensor, aten.narrow.default)
SPLITTERS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
MAX_ROUNDS = 8
# an activation of a convolution or GEMM is its epilogue (fuse_bias_act, fuse_conv_relu): not hoisted away from it
PRODUCERS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.linear.default, aten.addmm.default,
             aten.mm.default, aten.bmm.default, aten.matmul.default)
EPILOGUE_ACTS = (aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
                 aten.hardswish.default, aten.leaky_relu.default)


def _bounds(split: fx.Node, size: int) -> list | None:
    """Item boundaries of a split, split_with_sizes or chunk over a dim ``size`` long (None: symbolic)."""
    if split.target is aten.chunk.default:
        n = split.args[1]
        if not isinstance(n, int) or n <= 0:
            return None
        step = math.ceil(size / n) if size else 0
        if step == 0:
            return None
        bounds = list(range(0, size, step)) + [size]
        return bounds
    return split_bounds(split, size)


def _pieces(p: fx.Node, rank: int, shape) -> tuple[str, int | None, list]:
    """("", d, [(node, lo, hi), ...]) the readers of ``p`` as pieces along one dim d (the node each
    piece is: a slice, or a split's item; the split nodes are listed with lo = None), or (why not, None, [])."""
    dim, out = None, []
    for u in p.users:
        if u.op != "call_function" or u.args[0] is not p:
            return f"read by {u.name} ({ir.op_name(u) if u.op == 'call_function' else u.op}), not a piece", None, []
        if u.target in SLICES:
            d = arg(u, 1, "dim", 0)
            if not isinstance(d, int):
                return f"{u.name} slices a symbolic dim", None, []
            d %= rank
            _, _, _, lo, hi = node_range(u, shape[d])
            if lo is None:
                return f"{u.name} has symbolic bounds or a step", None, []
            items = [(u, lo, hi)]
        elif u.target in SPLITTERS:
            d = arg(u, 2, "dim", 0)
            if not isinstance(d, int):
                return f"{u.name} splits a symbolic dim", None, []
            d %= rank
            bounds = _bounds(u, shape[d])
            if bounds is None:
                return f"{u.name} has symbolic sizes", None, []
            items = []
            for it in u.users:
                if it.target is not operator.getitem or not isinstance(it.args[1], int):
                    return f"{u.name}'s result is read whole", None, []
                k = it.args[1]
                items.append((it, bounds[k], bounds[k + 1]))
            out.append((u, None, None))
        else:
            return f"read by {u.name} ({ir.op_name(u)}), not a piece", None, []
        if dim is None:
            dim = d
        elif d != dim:
            return "pieces along different dims", None, []
        out.extend(items)
    ranges = sorted((lo, hi) for n, lo, hi in out if lo is not None)
    if not ranges:
        return "no piece reads it", None, []
    if any(hi <= lo for lo, hi in ranges):
        return "an empty piece", None, []
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
        return "its pieces overlap (the op would be computed twice)", None, []
    return "", dim, out


@register
class HoistSlices(Pass):
    name = "hoist_slices"
    family = "fusion"
    description = "the pieces of a pointwise op's result are computed from the pieces of its operands"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from .fuse_elementwise import _dtypes

        res = self.result()
        if not self._read_in_pieces(gm):
            return res  # no pointwise result is read in pieces: nothing to consider
        if "fuse_elementwise" not in ctx.scheduled or not ctx.fused_kernels:
            res.reject_all(self._read_in_pieces(gm),
                           "nothing fuses the pieces with their readers (fuse_elementwise not scheduled on a GPU profile)")
            return res
        dtypes = _dtypes()
        # a hoisted op's operands are read in pieces in turn (a scale, then a bias, then a split):
        # rounds until none is left; the refusals are the last round's
        for _ in range(MAX_ROUNDS):
            res.rejected.clear()
            done = len(res.rewrites)
            storage, writes = ir.storages(gm)
            candidates = []
            for p in self._read_in_pieces(gm):
                why, plan = self._plan(p, dtypes, storage, writes)
                if why:
                    res.reject(p.name, why)
                    continue
                candidates.append(Candidate(
                    "pointwise op read in pieces -> the op over its operands' pieces", [p] + [n for n, _, _ in plan[1]],
                    ctx.node_time([p]), lambda gm=gm, p=p, plan=plan: self._apply(gm, p, *plan),
                    label=f"{p.name}: {sum(lo is not None for _, lo, _ in plan[1])} pieces along dim {plan[0]}"))
            res.apply_ranked(ctx, candidates)
            if len(res.rewrites) == done:
                break
        return res

    @staticmethod
    def _read_in_pieces(gm) -> list:
        from .fuse_elementwise import CASTS, OPS

        return [n for n in gm.graph.nodes if n.op == "call_function" and (n.target in OPS or n.target in CASTS)
                and any(u.op == "call_function" and u.target in SPLITTERS + SLICES for u in n.users)]

    @staticmethod
    def _plan(p, dtypes, storage, writes):
        from .fuse_elementwise import CASTS, OPS, fusible

        why = fusible(p, dtypes)
        if why:
            return why, None
        pi = ir.info(p)
        if pi is None or not all(isinstance(s, int) for s in pi.shape) or not pi.shape:
            return "no static shape", None
        if writes.get(storage.get(p, p)):
            return f"{writes[storage.get(p, p)][0].name} writes its result in place", None
        rank = len(pi.shape)
        why, d, pieces = _pieces(p, rank, pi.shape)
        if why:
            return why, None
        for a in p.all_input_nodes:
            ai = ir.info(a)
            if ai is None or not all(isinstance(s, int) for s in ai.shape):
                return f"operand {a.name} has no static shape", None
            da = d - (rank - len(ai.shape))
            if da >= 0 and ai.shape[da] not in (1, pi.shape[d]):
                return f"operand {a.name} neither has its size along dim {d} nor broadcasts there", None
        src = p.args[0] if p.args and isinstance(p.args[0], fx.Node) else None
        if p.target in EPILOGUE_ACTS and src is not None and src.op == "call_function" and src.target in PRODUCERS:
            return (f"an activation of {src.name} ({ir.op_name(src)}): its epilogue, left to fuse_bias_act and "
                    "fuse_conv_relu"), None
        for n, lo, _ in pieces:
            if lo is None:
                continue
            if any(u.op == "output" for u in n.users):
                return f"the graph returns the piece {n.name}", None
            if not any(u.op == "call_function" and (u.target in OPS or u.target in CASTS) and fusible(u, dtypes) == ""
                       for u in n.users):
                return f"no pointwise op fuse_elementwise joins reads the piece {n.name}", None
        return "", (d, pieces)

    @staticmethod
    def _apply(gm, p, d, pieces):
        g = gm.graph
        rank = len(ir.info(p).shape)
        made, dead = [], [p]
        for n, lo, hi in pieces:
            if lo is None:
                dead.append(n)
                continue

            sliced: dict = {}  # an operand read twice (x * x) is sliced once

            def piece_of(a, lo=lo, hi=hi, sliced=sliced):
                if not isinstance(a, fx.Node):
                    return a
                ai = ir.info(a)
                da = d - (rank - len(ai.shape))
                if da < 0 or ai.shape[da] != ir.info(p).shape[d] or (lo == 0 and hi == ai.shape[da]):
                    return a  # broadcast along d (or the whole of it): read as is
                if a not in sliced:
                    with g.inserting_before(p):
                        sliced[a] = g.call_function(aten.slice.Tensor, (a, da, lo, hi))
                    made.append(sliced[a])
                return sliced[a]

            args = fx.node.map_aggregate(p.args, piece_of)
            kwargs = fx.node.map_aggregate(p.kwargs, piece_of)
            with g.inserting_before(p):
                new = g.call_function(p.target, tuple(args), dict(kwargs))
            made.append(new)
            set_meta(gm, [m for m in made if "val" not in m.meta])
            n.replace_all_uses_with(new)
            dead.append(n)
        ir.erase_dead(gm, dead)
        return made
