"""eliminate_permutes: remove layout traffic (copies and redundant view chains), proven safe
from the shape/stride metadata.

Rewrites, each checked on ``ir.info(n).shape/.stride`` and never changing a value:

* ``drop_strided_contiguous``: ``contiguous(x)`` whose every reader, through chains of pure views
  (select/view/transpose/permute/unsqueeze/squeeze/unflatten/slice), is an operand that takes
  strided input (SDPA q/k/v with a unit last stride; mm/bmm operands with a unit stride in one of
  the last two dims). Each reader's view of the contiguous copy is re-expressed as a view chain
  of ``x`` (select / slice / unflatten / permute / unsqueeze) computed from the strides, and the
  copy disappears. This is torchvision's nn.MultiheadAttention QKV copy (``unflatten →
  unsqueeze → transpose → squeeze → contiguous → select → view → transpose → view → SDPA``).
* ``drop_noop_contiguous``: ``contiguous`` / ``clone(memory_format=contiguous)`` of a tensor that
  is already contiguous per metadata (aliasing is safe where nothing writes either tensor in place:
  a copy whose storage or whose source's storage an in-place op writes is kept, as is a clone
  whose result is a graph output, so that the caller never gets an alias of an input/output).
* ``cancel_permute_pair``: permute/transpose p then permute/transpose q with q∘p = identity.
* ``sink_transpose_below_linear``: ``linear(transpose(x, i, j))`` with neither i nor j the last
  dim -> ``transpose(linear(x), i, j)``. A linear acts on each row (the last dim) alone, so the
  rows can be multiplied in x's own order; at::linear would otherwise copy the strided 3-D input
  to fold it into a GEMM. Applied only when every view reading the result is still a view on the
  new strides (checked on the FakeTensors). nn.MultiheadAttention(batch_first=True)'s input.
* ``hoist_transpose_above_linear``: ``transpose(view(linear(reshape(X, [L*B, E])), [L, B, E]), 0, 1)``
  with X = [L, B, ...] -> ``linear(reshape(transpose(X, 0, 1), [B, L, E]))``: the same rows in the
  caller's order, so the attention output (which SDPA's CUDA kernels write as [B, L, H, D]) needs
  no copy before the output projection, and the residual/norm after it reads a contiguous tensor.
* ``merge_view_chain``: consecutive view/reshape/unsqueeze/squeeze/flatten/unflatten nodes become
  one ``view`` when that view is valid on the chain's input strides (checked on a meta tensor),
  else one ``reshape`` when the chain contained a reshape already.

Gains come from the cost model: a removed copy saves its bytes; rewrites among pure views are
free in the cost model (gain 0) and are applied as cleanups (``allow_zero_gain``) since they only
remove nodes. Copies the pass must keep are reported as refusals with the reason.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.ir import GETITEM
from graphopt.matcher import Any, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

aten = torch.ops.aten

PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
# ops whose output is always a view of their first argument (never a copy)
PURE_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.select.int, aten.transpose.int,
              aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
              aten.squeeze.default, aten.unflatten.int, aten.t.default, aten.alias.default,
              aten.slice.Tensor}
# chains merged into one view/reshape
SHAPE_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
             aten.unflatten.int}
SDPA = {aten.scaled_dot_product_attention.default}
GEMMS = {aten.mm.default, aten.bmm.default}

CONTIGUOUS = Op(aten.contiguous.default, Any("x"), name="c")
CLONE = Op(aten.clone.default, Any("x"), name="c")
PAIR = Op(PERMUTES, Op(PERMUTES, Any("x"), name="p", single_use=False), name="q")


# ops whose meta function gives a contiguous result where the eager kernel keeps a non-contiguous
# input's memory format (GroupNorm over a channels_last tensor: strides (60, 1, 20, 4) on the CPU,
# (60, 15, 5, 1) as recorded)
META_LAYOUT_DIFFERS = {"group_norm", "native_group_norm"}


def _layout_unstable(node, limit: int = 256) -> str:
    """Name of the producer if ``node``'s strides come from an op whose output layout depends on
    the backend chosen at run time (SDPA variants, graphopt kernels) or differs from the recorded
    one (META_LAYOUT_DIFFERS over a non-contiguous input), else ''. The layout is followed back
    through views and shape ops, and through pointwise ops (torch's ``pointwise`` tag: their output
    takes their inputs' layout) to each of their inputs; past ``limit`` nodes it counts as unstable."""
    from graphopt.cost.model import ATTENTION_OPS
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        while isinstance(node, fx.Node) and node.op == "call_function" and (
                node.target in PURE_VIEWS or node.target in SHAPE_OPS or node.target is aten.contiguous.default):
            node = node.args[0]
        if not isinstance(node, fx.Node) or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if len(seen) > limit:
            return node.name
        if node.target is GETITEM:
            node = node.args[0]
        if ir.op_name(node) in ATTENTION_OPS or ir.op_namespace(node) == "graphopt":
            return node.name
        if ir.op_name(node) in META_LAYOUT_DIFFERS and node.args and isinstance(node.args[0], fx.Node) \
                and not ir.is_contiguous(ir.info(node.args[0])):
            return node.name
        if torch.Tag.pointwise in getattr(node.target, "tags", ()):
            stack.extend(a for a in node.all_input_nodes if ir.info(a) is not None)
    return ""


def _view_readers(node) -> list:
    """``view`` nodes reading node directly or through pure views (they need a viewable layout)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.target in (aten.view.default, aten._unsafe_view.default):
                out.append(u)
            if u.target in PURE_VIEWS:
                stack.append(u)
    return out


def _written_copy(c, x, storage, writes) -> str:
    """Why the copy ``c`` of ``x`` must stay because something writes in place into the copy or into
    the tensor it copies (without the copy the write would reach the other), or ""."""
    for node, what in ((c, "the copy"), (x, "its source")):
        w = writes.get(storage.get(node, node))
        if w:
            return f"kept: {w[0].name} writes {what} {node.name} in place"
    return ""


def concrete_layout(ti) -> bool:
    return ti is not None and not ti.symbolic and ti.stride is not None and all(isinstance(s, int) for s in ti.stride)


def perm_of(node: fx.Node, rank: int) -> list[int] | None:
    """The dims permutation a permute/transpose/t node applies (output dim i = input dim perm[i])."""
    if node.target is aten.permute.default:
        return [d % rank for d in node.args[1]]
    perm = list(range(rank))
    if node.target is aten.t.default:
        if rank < 2:
            return perm
        a, b = 0, 1
    else:
        a, b = node.args[1] % rank, node.args[2] % rank
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _fake(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception:
        return None


class _Builder:
    """Inserts view nodes after ``anchor`` with their FakeTensor metadata."""

    def __init__(self, gm, anchor):
        self.g, self.anchor = gm.graph, anchor

    def call(self, target, args):
        with self.g.inserting_before(self.anchor):
            n = self.g.call_function(target, args)
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
        n.meta["val"] = _fake(target, *vals)
        return n


def express_view(x_info, v_shape, v_stride, offset):
    """A view V of contiguous(x) (shape/strides relative to the contiguous copy, storage offset)
    as a list of view steps on x, or (None, reason). Steps: ("select", dim, idx), ("slice", dim,
    start, end), ("unflatten", dim, sizes), ("permute", perm), ("unsqueeze", dim)."""
    xs = list(x_info.shape)
    n = len(xs)
    cst = [1] * n
    for j in range(n - 2, -1, -1):
        cst[j] = cst[j + 1] * xs[j + 1]
    total = cst[0] * xs[0] if n else 1
    if offset < 0 or offset >= max(total, 1):
        return None, "view offset outside the tensor"
    o, rem = [], offset
    for j in range(n):
        o.append(rem // cst[j])
        rem -= o[-1] * cst[j]
    assign: dict[int, list] = {j: [] for j in range(n)}
    kept = []
    for k, (size, s) in enumerate(zip(v_shape, v_stride)):
        if size == 1:
            continue
        j = next((j for j in range(n) if xs[j] > 1 and cst[j] <= s < cst[j] * xs[j]), None)
        if j is None or s % cst[j]:
            return None, f"view dim {k} (stride {s}) does not step along one dimension of the input"
        assign[j].append((s // cst[j], size, k))
        kept.append(k)
    steps = []
    labels: list = [None] * n  # per current dim: list of V dims it holds
    for j in range(n - 1, -1, -1):
        dims = sorted(assign[j], reverse=True)
        if not dims:
            steps.append(("select", j, o[j]))
            labels[j] = []
            continue
        if dims[-1][0] != 1 or any(dims[i][0] != dims[i + 1][0] * dims[i + 1][1] for i in range(len(dims) - 1)):
            return None, f"view dims on input dim {j} are not a dense split of it"
        span = dims[0][0] * dims[0][1]
        if o[j] + span > xs[j]:
            return None, f"view runs past input dim {j}"
        if o[j] != 0 or span != xs[j]:
            steps.append(("slice", j, o[j], o[j] + span))
        if len(dims) > 1:
            steps.append(("unflatten", j, [d[1] for d in dims]))
        labels[j] = [d[2] for d in dims]
    order = [k for lab in labels for k in lab]
    perm = [order.index(k) for k in sorted(kept)]
    if perm != list(range(len(perm))):
        steps.append(("permute", perm))
    for k, size in enumerate(v_shape):
        if size == 1:
            steps.append(("unsqueeze", k))
    return steps, ""


def _apply_steps(t, steps):
    """Apply express_view's steps to a tensor (meta or fake)."""
    for st in steps:
        if st[0] == "select":
            t = t.select(st[1], st[2])
        elif st[0] == "slice":
            t = t.narrow(st[1], st[2], st[3] - st[2])
        elif st[0] == "unflatten":
            t = t.unflatten(st[1], st[2])
        elif st[0] == "permute":
            t = t.permute(st[1])
        else:
            t = t.unsqueeze(st[1])
    return t


def _strides_after(x_info, steps):
    return _apply_steps(torch.empty_strided(x_info.shape, x_info.stride, device="meta"), steps)


def _same_layout(a, b) -> bool:
    vals = lambda v: list(v) if isinstance(v, (tuple, list)) else [v]  # noqa: E731
    pa, pb = vals(a), vals(b)
    return len(pa) == len(pb) and all(
        not isinstance(x, torch.Tensor) or (isinstance(y, torch.Tensor) and x.shape == y.shape and x.stride() == y.stride())
        for x, y in zip(pa, pb))


def _accepts_strided(consumer: fx.Node, arg: fx.Node, t: torch.Tensor) -> str:
    """'' if ``consumer`` reads ``arg`` (a strided view t) without copying it, else why not."""
    def last_unit(dims):
        return any(t.dim() >= d and (t.stride(-d) == 1 or t.shape[-d] == 1) for d in dims)
    if consumer.target in SDPA:
        if any(a is arg for a in consumer.args[3:]) or any(v is arg for v in consumer.kwargs.values()):
            return f"{arg.name} is also an attention mask/extra argument of {consumer.name}"
        return "" if last_unit([1]) else f"SDPA needs a unit last stride for {arg.name}"
    if consumer.target in GEMMS:
        return "" if last_unit([1, 2]) else f"{consumer.name} needs a unit stride in one of its last two dims"
    return f"read by {ir.target_name(consumer)} ({consumer.name}), which wants a contiguous input"


@register
class EliminatePermutes(Pass):
    name = "eliminate_permutes"
    family = "layout"
    description = "remove copies and view chains that layout metadata proves unnecessary"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        for _ in range(4):  # each round can enable the next (a cancelled pair makes a copy a no-op)
            n_before = len(res.rewrites)
            res.apply_ranked(ctx, self._noop_copies(gm, ctx, res), allow_zero_gain=True)
            res.apply_ranked(ctx, self._pairs(gm, ctx), allow_zero_gain=True)
            res.apply_ranked(ctx, self._strided_contiguous(gm, ctx, res, final=False))
            res.apply_ranked(ctx, self._rowwise_transposes(gm, ctx, res))
            res.apply_ranked(ctx, self._view_chains(gm, ctx, res), allow_zero_gain=True)
            if len(res.rewrites) == n_before:
                break
        self._report_kept_copies(gm, ctx, res)
        uniq = {}
        for r in res.rejected:  # rounds re-propose the same refusals
            uniq.setdefault((r.candidate, r.reason), r)
        res.rejected = list(uniq.values())
        res.details["removed"] = {p: sum(1 for r in res.rewrites if r.pattern == p) for p in
                                  ("drop_noop_contiguous", "cancel_permute_pair", "drop_strided_contiguous",
                                   "sink_transpose_below_linear", "hoist_transpose_above_linear",
                                   "merge_view_chain")}
        return res

    # ------------------------------------------------------------------ no-op copies

    def _noop_copies(self, gm, ctx, res):
        cands = []
        storage, writes = ir.storages(gm)
        outputs = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
        for pat in (CONTIGUOUS, CLONE):
            for m in find(gm, pat):
                c, x = m["c"], m["x"]
                ci, xi = ir.info(c), ir.info(x) if isinstance(x, fx.Node) else None
                if ci is None or xi is None:
                    continue
                if c.target is aten.clone.default:
                    fmt = c.kwargs.get("memory_format", None)
                    if fmt not in (None, torch.contiguous_format, torch.preserve_format):
                        continue
                    if c in outputs:
                        res.reject(c.name, "kept: a clone returned to the caller must not alias another tensor")
                        continue
                else:
                    fmt = c.kwargs.get("memory_format", torch.contiguous_format)
                    if fmt is not torch.contiguous_format:
                        continue
                if ci.dtype != xi.dtype or ci.device != xi.device or not ir.is_contiguous(xi):
                    continue
                why = _written_copy(c, x, storage, writes)
                if why:
                    res.reject(c.name, why)
                    continue
                unstable, views = _layout_unstable(x), _view_readers(c)
                if unstable and views:
                    res.reject(c.name, f"kept: {x.name} is contiguous here, but the layout of {unstable}'s output "
                                       f"depends on the backend at run time and {views[0].name} needs a viewable input")
                    continue
                cands.append(Candidate("drop_noop_contiguous", [c], ctx.node_time([c]),
                                       lambda c=c, x=x: self._bypass(gm, c, x),
                                       label=f"{c.name}: {ir.target_name(c)} of the contiguous {x.name}"))
        return cands

    @staticmethod
    def _bypass(gm, node, src):
        node.replace_all_uses_with(src)
        ir.erase_dead(gm, [node])
        return True

    # ------------------------------------------------------------------ inverse permutes

    def _pairs(self, gm, ctx):
        cands = []
        for m in find(gm, PAIR):
            p, q, x = m["p"], m["q"], m["x"]
            xi = ir.info(x) if isinstance(x, fx.Node) else None
            if xi is None:
                continue
            rank = len(xi.shape)
            pp, qq = perm_of(p, rank), perm_of(q, rank)
            if [pp[i] for i in qq] != list(range(rank)):
                continue
            qi = ir.info(q)
            if qi is None or qi.shape != xi.shape or qi.stride != xi.stride:
                continue
            # q's result has x's layout (checked above): readers cost the same; the pair is free views
            gain = ctx.node_time([q, p])
            # p and x belong to the candidate too: in a chain of three permutes the two pairs
            # share a node, and cancelling one must not leave the other pointing at an erased p
            cands.append(Candidate("cancel_permute_pair", [q, p, x], gain,
                                   lambda p=p, q=q, x=x: self._cancel(gm, p, q, x),
                                   label=f"{p.name} then {q.name} (inverse permutations)"))
        return cands

    @staticmethod
    def _cancel(gm, p, q, x):
        q.replace_all_uses_with(x)
        ir.erase_dead(gm, [q, p])
        return True

    # ------------------------------------------------------------------ contiguous before strided readers

    def _closure(self, c):
        """(view nodes, [(leaf, consumer)]) reading c through pure view chains."""
        views, leaves, stack = [], [], [c]
        while stack:
            n = stack.pop()
            for u in list(n.users):
                if u.op == "call_function" and u.target in PURE_VIEWS and u.args and u.args[0] is n \
                        and n not in u.args[1:]:
                    views.append(u)
                    stack.append(u)
                else:
                    leaves.append((n, u))
        return views, leaves

    def _strided_contiguous(self, gm, ctx, res, final):
        cands = []
        storage, writes = ir.storages(gm)
        for m in find(gm, CONTIGUOUS):
            c, x = m["c"], m["x"]
            xi, ci = (ir.info(x) if isinstance(x, fx.Node) else None), ir.info(c)
            if xi is None or ci is None or ir.is_contiguous(xi):
                continue
            if c.kwargs.get("memory_format", torch.contiguous_format) is not torch.contiguous_format:
                continue
            why = _written_copy(c, x, storage, writes)
            if why:
                res.reject(f"{c.name} (copy of the strided {x.name})", why)
                continue
            gain = ctx.node_time([c])
            plan, why = self._plan(c, x, xi)
            if plan is None:
                res.reject(f"{c.name} (copy of the strided {x.name})", f"kept: {why}")
                continue
            cands.append(Candidate("drop_strided_contiguous", [c], gain,
                                   lambda c=c, x=x, plan=plan: self._apply_strided(gm, c, x, plan),
                                   label=f"{c.name}: copy of {x.name} read only by strided-capable operands"))
        return cands

    def _plan(self, c, x, xi):
        if not concrete_layout(xi) or not concrete_layout(ir.info(c)):
            return None, "symbolic shapes or strides"
        views, leaves = self._closure(c)
        if not leaves:
            return None, "no readers"
        c_off = c.meta["val"].storage_offset()
        plan = []
        for leaf, consumer in leaves:
            li = ir.info(leaf)
            if not concrete_layout(li):
                return None, f"{leaf.name} has symbolic shape"
            if consumer.op == "output":
                return None, f"{leaf.name} is a graph output (callers may expect it contiguous)"
            off = leaf.meta["val"].storage_offset() - c_off
            steps, why = express_view(xi, list(li.shape), list(li.stride), off)
            if steps is None:
                return None, f"{leaf.name}: {why}"
            t = _strides_after(xi, steps)
            if list(t.shape) != list(li.shape):
                return None, f"{leaf.name}: re-expressed view has shape {list(t.shape)}"
            why = _accepts_strided(consumer, leaf, t)
            if why:
                return None, why
            plan.append((leaf, consumer, steps))
        # the readers' outputs must keep their layout, or copies could appear downstream
        for consumer in {cons for _, cons, _ in plan}:
            fakes = {leaf: _apply_steps(x.meta["val"], steps) for leaf, cons, steps in plan if cons is consumer}
            sub = lambda a: fakes[a] if a in fakes else (a.meta.get("val") if isinstance(a, fx.Node) else a)  # noqa: E731
            new_out = _fake(consumer.target, *[fx.node.map_aggregate(a, sub) for a in consumer.args],
                            **{k: fx.node.map_aggregate(v, sub) for k, v in consumer.kwargs.items()})
            if new_out is None or not _same_layout(new_out, consumer.meta.get("val")):
                return None, f"{consumer.name}'s output layout would change (copies could move downstream)"
        return plan, ""

    def _apply_strided(self, gm, c, x, plan):
        made = {}
        for leaf, consumer, steps in plan:
            if leaf not in made:
                b = _Builder(gm, consumer)
                cur = x
                for st in steps:
                    if st[0] == "select":
                        cur = b.call(aten.select.int, (cur, st[1], st[2]))
                    elif st[0] == "slice":
                        cur = b.call(aten.slice.Tensor, (cur, st[1], st[2], st[3]))
                    elif st[0] == "unflatten":
                        cur = b.call(aten.unflatten.int, (cur, st[1], st[2]))
                    elif st[0] == "permute":
                        cur = b.call(aten.permute.default, (cur, st[1]))
                    else:
                        cur = b.call(aten.unsqueeze.default, (cur, st[1]))
                made[leaf] = cur
            consumer.replace_input_with(leaf, made[leaf])
        views, _ = self._closure(c)
        ir.erase_dead(gm, list(reversed(views)) + [c])
        return True

    # ------------------------------------------------------------------ transposes around linears

    @staticmethod
    def _flatten_time(ctx, t, k) -> float:
        """The copy linear makes of a strided input: aten flattens it with ``reshape(t, [-1, k])``."""
        return ctx.price(aten.reshape.default, t, [-1, k])

    @staticmethod
    def _sdpa_rows_time(ctx, src, perm, chain) -> float:
        """``chain`` (pairs of view/reshape targets and arguments) applied to ``permute(src, perm)``,
        with ``src`` (an attention output [B, H, L, D]) laid out as SDPA's CUDA kernels write it,
        [B, L, H, D] in memory: the meta strides (from the CPU's kernels) cannot say so."""
        si = ir.info(src)
        B, H, L, D = (int(d) for d in si.shape)
        r = ctx.replacement()
        t = r.call(aten.permute.default, r.tensor((B, H, L, D), si.dtype, si.device, stride=(L * H * D, D, H * D, 1)),
                   perm)
        for target, args in chain:
            # a view the graph made on the CPU's strides may not apply to SDPA's layout: priced as the
            # reshape it stands for (the copy is what this price is for); torch 2.11 captures view here
            if target in (aten.view.default, aten._unsafe_view.default):
                target = aten.reshape.default
            t = r.call(target, t, *args)
        return r.time()

    def _rowwise_transposes(self, gm, ctx, res):
        cands = []
        for lin in list(gm.graph.nodes):
            if lin.op != "call_function" or lin.target is not aten.linear.default:
                continue
            li = ir.info(lin)
            if li is None or not concrete_layout(li):
                continue
            t = lin.args[0]
            # sink: linear(transpose(x, i, j)), the last dim untouched
            if isinstance(t, fx.Node) and t.target is aten.transpose.int and len(t.users) == 1:
                x, ti = t.args[0], ir.info(t)
                xi = ir.info(x) if isinstance(x, fx.Node) else None
                if xi is not None and ti is not None and len(xi.shape) >= 3 and concrete_layout(xi):
                    r = len(xi.shape)
                    i, j = (d % r for d in t.args[1:3])
                    if r - 1 not in (i, j) and ir.is_contiguous(xi) and not ir.is_contiguous(ti):
                        # linear(x) and transpose (a view) replace linear(transpose), which flattens its
                        # strided input with a copy first
                        cands.append(Candidate(
                            "sink_transpose_below_linear", [lin, t, x], self._flatten_time(ctx, t, ti.shape[-1]),
                            lambda lin=lin, t=t, x=x, i=i, j=j: self._sink(gm, lin, t, x, i, j),
                            label=f"{t.name} -> {lin.name} (linear on the rows in {x.name}'s order)",
                            refusal="kept: a view of the linear's result would need a copy on the new strides"))
            # hoist: transpose(view(linear(reshape(X, [L*B, E])), [L, B, E]), 0, 1)
            if len(lin.users) != 1:
                continue
            v = next(iter(lin.users))
            if v.target not in (aten.view.default, aten.reshape.default) or len(v.users) != 1:
                continue
            tr = next(iter(v.users))
            if tr.target is not aten.transpose.int or not isinstance(t, fx.Node) or \
                    t.target not in (aten.reshape.default, aten.view.default) or len(t.users) != 1:
                continue
            X = t.args[0]
            Xi, vi, tri = ir.info(X) if isinstance(X, fx.Node) else None, ir.info(v), ir.info(tr)
            if Xi is None or vi is None or tri is None or not concrete_layout(Xi) or len(vi.shape) != 3 \
                    or len(Xi.shape) < 3 or len(li.shape) != 2:
                continue
            L, B = vi.shape[0], vi.shape[1]
            if sorted(d % 3 for d in tr.args[1:3]) != [0, 1] or list(Xi.shape[:2]) != [L, B] \
                    or li.shape[0] != L * B:
                continue
            src = X.args[0] if X.target is aten.permute.default else None
            if isinstance(src, fx.Node) and _layout_unstable(src) and list(X.args[1]) == [2, 0, 1, 3]:
                # attention output [B, H, L, D] read as [L, B, H, D]: SDPA's CUDA kernels (flash,
                # efficient, cuDNN) write it as [B, L, H, D], so the caller's row order is free
                # and the sequence-first one a copy; the meta strides (from the CPU) can't say so
                gain = 0.0
                if ctx.cost.device_kind == "cuda":
                    gain = (self._sdpa_rows_time(ctx, src, X.args[1], [(t.target, t.args[1:])])
                            - self._sdpa_rows_time(ctx, src, X.args[1], [(aten.transpose.int, (0, 1)),
                                                                           (aten.reshape.default, ([B, L, -1],))]))
            else:
                new_view = _fake(lambda a: a.transpose(0, 1).view(B, L, -1), X.meta["val"]) is not None
                # the rows in the caller's order: a view of X where reshape(X) copied
                gain = ctx.node_time([t]) if not ir.is_contiguous(Xi) and new_view else 0.0
            if gain <= 0 and not ctx.ignore_cost:
                continue
            cands.append(Candidate(
                "hoist_transpose_above_linear", [tr, v, lin, t, X], gain,
                lambda tr=tr, v=v, lin=lin, t=t, X=X, L=L, B=B: self._hoist(gm, tr, v, lin, t, X, L, B),
                label=f"{t.name} -> {lin.name} -> {tr.name} (rows in the caller's order)"))
        return cands

    @staticmethod
    def _revalidate_views(start: fx.Node) -> dict | None:
        """New FakeTensor values for the pure views reading ``start`` (transitively), or None if
        one of them is no longer a valid view on ``start``'s new strides."""
        new, todo = {}, [start]
        while todo:
            n = todo.pop()
            for u in n.users:
                if u.op != "call_function" or u.target not in PURE_VIEWS:
                    continue
                vals = [new.get(a, a.meta.get("val")) if isinstance(a, fx.Node) else a for a in u.args]
                val = _fake(u.target, *vals, **u.kwargs)
                if val is None:
                    return None
                new[u] = val
                todo.append(u)
        return new

    def _sink(self, gm, lin, t, x, i, j):
        b = _Builder(gm, lin)
        new_lin = b.call(aten.linear.default, (x,) + tuple(lin.args[1:]))
        new_t = b.call(aten.transpose.int, (new_lin, i, j))
        if new_lin.meta["val"] is None or new_t.meta["val"] is None:
            gm.graph.erase_node(new_t)
            gm.graph.erase_node(new_lin)
            return None
        lin.replace_all_uses_with(new_t)
        vals = self._revalidate_views(new_t)
        if vals is None:  # a reader's view would need a copy on the new strides: undo
            new_t.replace_all_uses_with(lin)
            gm.graph.erase_node(new_t)
            gm.graph.erase_node(new_lin)
            return None
        for n, val in vals.items():
            n.meta["val"] = val
        ir.erase_dead(gm, [lin, t])
        return new_t

    def _hoist(self, gm, tr, v, lin, t, X, L, B):
        b = _Builder(gm, lin)
        xt = b.call(aten.transpose.int, (X, 0, 1))
        flat = b.call(aten.reshape.default, (xt, [B, L, -1]))
        new_lin = b.call(aten.linear.default, (flat,) + tuple(lin.args[1:]))
        if new_lin.meta["val"] is None or tuple(new_lin.meta["val"].shape) != tuple(tr.meta["val"].shape):
            for n in (new_lin, flat, xt):
                gm.graph.erase_node(n)
            return None
        tr.replace_all_uses_with(new_lin)
        ir.erase_dead(gm, [tr, v, lin, t])
        return new_lin

    # ------------------------------------------------------------------ view chains

    def _view_chains(self, gm, ctx, res):
        cands = []
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or n.target not in SHAPE_OPS:
                continue
            # n is the end of a chain: no single reader continues it
            if len(n.users) == 1 and next(iter(n.users)).target in SHAPE_OPS:
                continue
            chain = [n]
            while True:
                src = chain[-1].args[0]
                if isinstance(src, fx.Node) and src.op == "call_function" and src.target in SHAPE_OPS \
                        and len(src.users) == 1:
                    chain.append(src)
                else:
                    break
            if len(chain) < 2:
                continue
            x = chain[-1].args[0]
            xi, ni = ir.info(x) if isinstance(x, fx.Node) else None, ir.info(n)
            if xi is None or ni is None:
                continue
            if not (concrete_layout(xi) and concrete_layout(ni)):
                res.reject(n.name, "view chain not merged: symbolic shapes")
                continue
            shape = list(ni.shape)
            copies = any(c.target in (aten.reshape.default, aten.flatten.using_ints) for c in chain)
            try:
                torch.empty_strided(xi.shape, xi.stride, device="meta").view(shape)
                if copies and _layout_unstable(x):  # a view would trust strides only known at run time
                    raise RuntimeError
                target = aten.view.default
            except RuntimeError:
                if not copies:
                    res.reject(f"{chain[-1].name}..{n.name}",
                               "view chain not merged: one view is invalid on the strided input")
                    continue
                target = aten.reshape.default
            old = ctx.node_time(chain)
            with gm.graph.inserting_before(n):
                probe = gm.graph.create_node("call_function", target, (x, shape))
            probe.meta["val"] = _fake(target, x.meta["val"], shape)
            new = ctx.node_time([probe])
            gm.graph.erase_node(probe)
            # the chain's input is part of the candidate: a merge that rewrites it (an
            # overlapping chain) must not leave this one pointing at an erased node
            cands.append(Candidate("merge_view_chain", list(chain) + [x], old - new,
                                   lambda chain=chain, x=x, shape=shape, target=target: self._merge(gm, chain, x, shape, target),
                                   label=f"{chain[-1].name}..{n.name} ({len(chain)} shape ops)"))
        return cands

    @staticmethod
    def _merge(gm, chain, x, shape, target):
        n = chain[0]
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(target, (x, shape))
        new.meta["val"] = _fake(target, x.meta["val"], shape)
        n.replace_all_uses_with(new)
        ir.erase_dead(gm, chain)
        return new

    # ------------------------------------------------------------------ report

    def _report_kept_copies(self, gm, ctx, res):
        seen = {r.candidate.split(" ")[0] for r in res.rejected}
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.name in seen:
                continue
            if n.target in (aten.reshape.default, aten.flatten.using_ints) and ctx.node_time([n]) > 0:
                readers = ", ".join(f"{ir.target_name(u)} {u.name}" for u in n.users)
                res.reject(n.name, f"kept: {n.args[0].name} is not viewable as {list(ir.info(n).shape)} (its strides "
                                   f"cannot be merged), so the reshape copies; its readers ({readers}) take the "
                                   "dense result")
