"""left_matmul_linears: a linear over the axis a transpose moved last runs as a matmul from the
left, so neither the transpose before it nor the one after it is copied.

    y = linear(x.transpose(-2, -1), W, b).transpose(-2, -1)        x: [..., K, L], W: [N, K]
 -> y = W @ x + b[:, None]                                          [..., N, L], contiguous

``linear(t)`` of a transposed ``t`` first copies ``t`` to fold it into one GEMM (aten's reshape), and
writes rows that the transpose after it reads back strided. ``W @ x`` reads ``x`` as it is laid out
(one batched GEMM whose left operand is the weight, repeated over the batch as a stride-0 view) and
writes the result in ``x``'s own order. This is the token-mixing MLP of MLP-Mixer, ResMLP and gMLP's
spatial gating unit (a linear over the sequence of a [batch, tokens, channels] tensor), and any
model that applies a linear along a non-last axis by transposing it last.

The pass follows values through the graph in the untransposed order: a transpose of the last two
dims is its input, seen transposed; an elementwise op of such values (numbers and 0-d or 1-D
constants beside them) is one of them too, computed on the untransposed values (a 1-D constant,
broadcast along the last dim, becomes a column); a chunk or split along one of the last two dims
is one along the other; a linear of one is ``W @ z + b[:, None]``. So gMixer's gated token MLP
``fc2(x1 * silu(x2))^T``, ``x1, x2 = fc1(x^T).chunk(2, -1)``, becomes
``W2 @ (z1 * silu(z2)) + b2``, ``z1, z2 = (W1 @ x).chunk(2, -2)`` plus each its half of ``b1``.

A region of such values is rewritten only if it holds a linear and nothing outside it reads one
of its values except a transpose back (which then reads the untransposed value: the pair is
gone). Refused, with the reason: a value read transposed by anything else (a reduction over its
last dim, a view, the graph's output), a weight that is not 2-D. The bias is added by an elementwise
op after the matmul; where its readers are elementwise ops too, fuse_elementwise fuses it into them,
and it is priced as free. A linear read only by a split along its features (gMixer's GLU) adds each
piece its slice of the bias instead, so each slice fuses with that piece's readers.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, set_meta, stored_view
from .eliminate_permutes import concrete_layout, perm_of
from .fuse_elementwise import OPS

aten = torch.ops.aten
TRANSPOSES = (aten.transpose.int, aten.permute.default, aten.t.default)
SPLITS = (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default)


def _swaps_last_two(node) -> bool:
    """A transpose / permute / t node that swaps its input's last two dims and nothing else."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in TRANSPOSES:
        return False
    xi = ir.info(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if xi is None or len(xi.shape) < 2:
        return False
    r = len(xi.shape)
    return perm_of(node, r) == list(range(r - 2)) + [r - 1, r - 2]


def _rank(node) -> int | None:
    i = ir.info(node) if isinstance(node, fx.Node) else None
    return len(i.shape) if i is not None else None


def _linear_parts(lin: fx.Node):
    """(W, b or None) of a linear node with a 2-D weight and a 1-D bias, else None."""
    w = lin.args[1] if len(lin.args) > 1 else lin.kwargs.get("weight")
    b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    wi = ir.info(w) if isinstance(w, fx.Node) else None
    if wi is None or len(wi.shape) != 2:
        return None
    if b is not None and (not isinstance(b, fx.Node) or _rank(b) != 1):
        return None
    return w, b


def _side_operand(a) -> bool:
    """An operand an elementwise op of a transposed value may have besides such values: a number,
    or a 0-d or 1-D tensor (broadcast along the last dim; a column in the untransposed order)."""
    if not isinstance(a, fx.Node):
        return isinstance(a, (int, float, bool, type(None)))
    r = _rank(a)
    return r is not None and r <= 1


def _split_dim(n: fx.Node) -> int:
    """The dim a chunk / split node splits, non-negative."""
    return get_arg(n, 2, "dim", 0) % _rank(n.args[0])


def _left_matmul(call, w, x, shape) -> fx.Node:
    """``W @ x`` for x of ``shape`` [..., K, L] (W: [N, K]) with ``call(target, *args)`` (a real graph's
    GraphBuilder or the cost model's Replacement): mm for a matrix, else one bmm over the batch dims
    folded into one, the weight repeated over them as a stride-0 view."""
    *batch, k, l = shape
    n = int(ir.info(w).shape[0])
    if not batch:
        return call(aten.mm.default, w, x)
    p = math.prod(batch)
    xs = x if len(batch) == 1 else call(aten.reshape.default, x, [p, k, l])
    y = call(aten.bmm.default, call(aten.expand.default, w, [p, n, k]), xs)
    return y if len(batch) == 1 else call(aten.view.default, y, [*batch, n, l])


class _Values:
    """The nodes whose values the pass keeps in the untransposed order (``kept``: node -> kind), and
    how they join up (:meth:`region`: the connected set of them around a linear)."""

    def __init__(self, gm: fx.GraphModule):
        self.kept: dict = {}  # node -> kind: "source" | "pointwise" | "split" | "item" | "linear"
        self.why: dict = {}  # linear -> why it was not kept
        for n in gm.graph.nodes:
            kind = self._kind(n)
            if kind:
                self.kept[n] = kind
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def _kind(self, n: fx.Node) -> str:
        if n.op != "call_function":
            return ""
        if _swaps_last_two(n):
            # a transpose of a kept value is that value in the caller's order: it ends a region
            return "" if n.args[0] in self.kept else "source"
        if n.target is operator.getitem:
            return "item" if self.kept.get(n.args[0]) == "split" else ""
        if n.target in SPLITS:
            return "split" if n.args[0] in self.kept and _split_dim(n) >= _rank(n.args[0]) - 2 else ""
        if n.target is aten.linear.default:
            if n.args[0] not in self.kept:
                return ""
            parts, xi, li = _linear_parts(n), ir.info(n.args[0]), ir.info(n)
            if parts is None:
                self.why[n] = "not rewritten: its weight is not 2-D or its bias not 1-D"
            elif xi is None or li is None or not concrete_layout(xi) or xi.dtype != li.dtype:
                self.why[n] = "not rewritten: symbolic shapes or a dtype change"
            else:
                return "linear"
            return ""
        if n.target in OPS:
            tensors = [a for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, fx.Node)]
            kept = [a for a in tensors if a in self.kept]
            if kept and _rank(n) is not None and all(_rank(a) >= 2 for a in kept) and \
                    all(a in self.kept or _side_operand(a) for a in list(n.args) + tensors):
                return "pointwise"
        return ""

    def region(self, start: fx.Node) -> list:
        """The kept nodes connected to ``start`` through kept nodes (reader or operand), in graph order."""
        seen, todo = {start}, [start]
        while todo:
            n = todo.pop()
            near = [u for u in n.users if u in self.kept]
            if self.kept[n] != "source":  # (a source's input is in the caller's order)
                near += [a for a in n.all_input_nodes if a in self.kept]
            for m in near:
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return sorted(seen, key=self.order.__getitem__)

    def leak(self, nodes: list) -> str:
        """'' when nothing outside ``nodes`` reads one of their values except a transpose back (or,
        for a source, the caller's-order readers of that transpose), else why not."""
        inside = set(nodes)
        for n in nodes:
            if self.kept[n] == "split":
                continue  # read by its items only (checked as the items)
            for u in n.users:
                if u in inside or _swaps_last_two(u) or self.kept[n] == "source" and u not in self.kept:
                    continue
                if u.op == "output":
                    return f"not rewritten: {n.name} would be returned transposed (a graph output)"
                return f"not rewritten: {n.name} would be read transposed by {u.name} ({ir.target_name(u)})"
        return ""


def _z_shape(node: fx.Node) -> list:
    shape = [int(d) for d in ir.info(node).shape]
    return shape[:-2] + [shape[-1], shape[-2]]


def _matmul_time(ctx: PassContext, shape, x_info, w: fx.Node) -> float:
    r = ctx.replacement()
    _left_matmul(r.call, r.input(w), r.tensor(tuple(shape), x_info.dtype, x_info.device), shape)
    return r.time()


def _feature_splits(lin: fx.Node, kept: dict) -> bool:
    """Every reader of ``lin`` is a kept split along its output features (its last dim): the bias
    is then added to each piece, by the elementwise ops reading it."""
    return bool(lin.users) and all(kept.get(u) == "split" and _split_dim(u) == _rank(lin) - 1 for u in lin.users)


def _bias_fuses(lin: fx.Node, kept: dict) -> bool:
    """The readers of ``lin``'s result once rewritten (past a transpose back, or of each piece of a
    split along its features) are elementwise ops."""
    readers = []
    for u in lin.users:
        if _swaps_last_two(u):
            readers.extend(u.users)
        elif kept.get(u) == "split" and _feature_splits(lin, kept):
            readers.extend(r for item in u.users for r in item.users)
        else:
            readers.append(u)
    return bool(readers) and all(r.op == "call_function" and r.target in OPS for r in readers)


def _rewrite(gm: fx.GraphModule, nodes: list, kept: dict, training: bool):
    """Each node of the region computed in the untransposed order; transposes back read those."""
    g = gm.graph
    z: dict = {}
    b = GraphBuilder(g)
    call, made = b.call, b.made
    pending: dict = {}  # linear -> its bias, added per piece of the split reading it

    def side(a):  # an operand beside the kept values, in the untransposed order
        return call(aten.unsqueeze.default, a, -1) if isinstance(a, fx.Node) and _rank(a) == 1 else a

    for n in nodes:
        kind = kept[n]
        if kind == "source":
            z[n] = n.args[0]
            continue
        with g.inserting_before(n):
            if kind == "pointwise":
                z[n] = call(n.target, *[z[a] if a in z else side(a) for a in n.args],
                            **{k: (z[v] if v in z else side(v)) for k, v in n.kwargs.items()})
            elif kind == "split":
                r, d = _rank(n.args[0]), _split_dim(n)
                z[n] = call(n.target, z[n.args[0]], n.args[1], r - 1 if d == r - 2 else r - 2)
            elif kind == "item":
                z[n] = call(operator.getitem, z[n.args[0]], n.args[1])
                lin = n.args[0].args[0]
                if lin in pending:  # this piece's slice of the linear's bias, as a column
                    size = int(ir.info(n).shape[-1])
                    off = sum(int(v.shape[-1]) for v in n.args[0].meta["val"][:n.args[1]])
                    bias = pending[lin]
                    if bias.op == "get_attr" and not training:  # (a stored view has no gradient)
                        col = stored_view(gm, bias, lambda v: v[off:off + size].unsqueeze(-1),
                                          f"{lin.name}_bias_{n.args[1]}")
                        made.append(col)
                    else:
                        col = call(aten.unsqueeze.default, call(aten.slice.Tensor, bias, 0, off, off + size), -1)
                    z[n] = call(aten.add.Tensor, z[n], col)
            else:  # linear
                w, bias = _linear_parts(n)
                y = _left_matmul(call, w, z[n.args[0]], _z_shape(n.args[0]))
                if bias is not None and _feature_splits(n, kept):
                    pending[n] = bias  # added to each piece of the split after it
                elif bias is not None:
                    y = call(aten.add.Tensor, y, call(aten.unsqueeze.default, bias, -1))
                z[n] = y
    set_meta(gm, made)
    bad = next((m for m in made if m.meta.get("val") is None and m.target is not operator.getitem), None)
    wrong = next((n for n in nodes if kept[n] in ("pointwise", "linear") and
                  list(z[n].meta["val"].shape) != _z_shape(n)), None) if bad is None else None
    if bad is not None or wrong is not None:
        for m in reversed(made):
            g.erase_node(m)
        return None
    for n in nodes:
        if kept[n] == "split":
            continue
        for u in list(n.users):
            if _swaps_last_two(u) and u.args[0] is n and u not in kept:
                u.replace_all_uses_with(z[n])
                g.erase_node(u)
    ir.erase_dead(gm, [n for n in reversed(nodes) if kept[n] != "source"] + [n for n in nodes if kept[n] == "source"])
    return True


@register
class LeftMatmulLinears(Pass):
    name = "left_matmul_linears"
    family = "fusion"
    description = "linear(x.transpose(-2, -1)).transpose(-2, -1) -> W @ x + b[:, None]: no transpose copied"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        vals = _Values(gm)
        for lin, why in vals.why.items():
            res.reject(lin.name, why)
        cands, done = [], set()
        for lin in [n for n, k in vals.kept.items() if k == "linear"]:
            if lin in done:
                continue
            nodes = vals.region(lin)
            done.update(nodes)
            linears = [n for n in nodes if vals.kept[n] == "linear"]
            why = vals.leak(nodes)
            if why:
                res.reject(", ".join(n.name for n in linears), why)
                continue
            # aten's linear copies a transposed input to fold it into one GEMM, and the transpose back
            # is read strided; the matmuls read and write in the input's own order
            gain = 0.0
            for n in linears:
                w, b = _linear_parts(n)
                gain += ctx.node_time([n]) - _matmul_time(ctx, _z_shape(n.args[0]), ir.info(n), w)
                if b is not None and not _bias_fuses(n, vals.kept):
                    gain -= ctx.price(aten.add.Tensor, n, b)
            sources = [n.name for n in nodes if vals.kept[n] == "source"]
            cands.append(Candidate(
                "left_matmul", linears, gain, lambda nodes=nodes: _rewrite(gm, nodes, vals.kept, ctx.training),
                label=f"{', '.join(sources)} -> {', '.join(n.name for n in linears)} (matmuls from the left)",
                refusal="not rewritten: a value's shape in the untransposed order did not check out"))
        res.apply_ranked(ctx, cands)
        return res

