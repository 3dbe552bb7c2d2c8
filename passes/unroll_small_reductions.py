"""unroll_small_reductions: a sum or mean over one dim of at most UNROLL elements -> the adds of its
slices, so that fuse_elementwise joins them with the pointwise ops around them into one kernel.

Split attention (ResNeSt), selective kernels (SKNet) and a mixture's weighted sum over its top-k
experts reduce over a dim of 2..8 branches, after a pointwise op that weighs them. aten runs the
product and the reduction as two kernels, and its reduction writes a contiguous tensor: inside a
channels_last network everything after it turned NCHW. Unrolled, ``(x * w).sum(1)`` is
``x[:, 0] * w[:, 0] + x[:, 1] * w[:, 1]``: one pointwise kernel over strided slices of ``x`` and
``w`` (views, no copy), writing its result in its inputs' memory order. Inductor unrolls small
reductions the same way (``unroll_reductions_threshold``).

The pointwise ops (fuse_elementwise.OPS) that make the reduced tensor, that nothing else reads and
whose operands nothing writes in place before the reduction, move into the terms: each operand is sliced instead (one of extent 1 there is read once, one
without that dim as is), so no slice of an intermediate is materialized. A slice of a ``stack``
along the reduced dim is the stacked tensor itself (SKNet stacks its branches to sum them): the
terms read those, and a stack left unread is removed. 16-bit values are summed
in float32 and rounded once, as aten's reduction accumulates; a mean divides by the count before
that rounding.

A matmul (``matmul``, ``bmm``, ``linear``) whose contraction has 2..UNROLL elements is such a sum too: ``A @ B`` is
the sum over k of ``A[..., :, k, None] * B[..., None, k, :]``, outer products of strided slices (views):
one pointwise kernel that reads each operand once through its strides, where aten copies an operand
whose batch dims do not fold (CoaT's ``q @ (k_softmax^T v)`` with q a permute of the qkv projection,
8 channels per head) and runs a memory-bound GEMM; the ops after it (a scale, a residual, the copy
that merges the heads) join that kernel in fuse_elementwise. A linear over K inputs is the sum of
its input's columns times its weight's columns, plus its bias (CaiT's talking heads mix 4 heads of a
permuted score tensor, which aten copies first). Products summed in float32, bias included,
rounded once, as cuBLAS accumulates.

Legality: aten.sum.dim_IntList or aten.mean.dim over one dim of static extent 2..UNROLL of a
floating tensor, no dtype argument other than a floating one; a matmul, bmm or linear (a 2-D weight,
its bias of the same dtype) contracting 2..UNROLL elements of static shapes in one floating dtype;
inference graphs; CUDA profiles
(fuse_elementwise fuses only there: unfused, the adds are more kernels than the reduction).
Profitability: the reduction and the ops moved into its terms against one kernel that reads the
terms' inputs once and writes the result (what fuse_elementwise makes of them), plus, where aten's
reduction writes a contiguous result of a tensor laid out otherwise (channels_last), the copy that
would take it back to its input's layout; terms that would
read more than fuse_elementwise.MAX_INPUTS tensors are refused, since it could not fuse them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import NO_FUSED_KERNELS, Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder
from .fuse_elementwise import MAX_INPUTS, OPS, _operands

aten = torch.ops.aten
UNROLL = 8
REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim)
LINEAR = aten.linear.default
MATMULS = (aten.matmul.default, aten.bmm.default, LINEAR)
MAX_DEPTH = 3  # pointwise ops moved into the terms along one operand path
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Leaf:
    """An operand of the terms: ``node`` sliced at ``dim`` per term (``dim`` None: read as is, the
    same tensor in every term; ``index0``: its extent 1 there, read through select(dim, 0))."""

    def __init__(self, node: fx.Node, dim: int | None, index0: bool = False):
        self.node, self.dim, self.index0 = node, dim, index0

    def per_term(self) -> bool:
        return self.dim is not None and not self.index0


class _Op:
    """A pointwise node moved into the terms, its operands as _Leaf/_Op or literals."""

    def __init__(self, node: fx.Node, operands: list):
        self.node, self.operands = node, operands


@register
class UnrollSmallReductions(Pass):
    name = "unroll_small_reductions"
    family = "fusion"
    description = (f"a sum/mean over one dim of 2..{UNROLL} elements -> adds of its slices, with the pointwise "
                   f"ops before it moved into them, and a matmul or linear contracting 2..{UNROLL} -> its outer products "
                   "(fuse_elementwise makes one kernel of them)")
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates = []
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
        writes = [order[m] for m in gm.graph.nodes if ir.written_args(m)]  # in-place ops, in graph order
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or (n.target not in REDUCTIONS and n.target not in MATMULS):
                continue
            why, spec = (_legal if n.target in REDUCTIONS else _legal_matmul)(n)
            if why:
                res.reject(n.name, why)
                continue
            if not ctx.fused_kernels:
                res.reject(n.name, NO_FUSED_KERNELS)
                continue
            if n.target in MATMULS:
                a, b, k, out_dtype, bias = spec
                scratch = ctx.replacement()
                cols, rows = _matmul_slices(scratch.call, a, b, k, n.target is LINEAR)
                ins = cols + rows + ([bias] if bias is not None else [])
                gain = ctx.node_time([n]) - _fused_s(ctx, scratch, ins, out_dtype, n.meta.get("val"))
                candidates.append(Candidate("small matmul -> sum of outer products", [n], gain,
                                            lambda n=n, spec=spec: _apply_matmul(gm, n, spec),
                                            label=f"{n.name} ({ir.op_name(n)}, a contraction over {k})"))
                continue
            x, d, r, keep, out_dtype = spec
            # an op moved down to n reads its operands there: none may be written in between
            movable = lambda v, at=order[n]: not any(order[v] < w < at for w in writes)  # noqa: E731
            tree, moved = _expr(x, d, r, 0, movable)
            leaves = _leaves(tree)
            if _inputs(leaves, r) > MAX_INPUTS:  # the slices of x itself, nothing moved
                tree, moved = _Leaf(x, d), []
                leaves = [tree]
            scratch = ctx.replacement()
            ins = [scratch.call(aten.select.int, lf.node, lf.dim, i) for lf in leaves if lf.per_term() for i in range(r)]
            ins += [scratch.call(aten.select.int, lf.node, lf.dim, 0) for lf in leaves if lf.index0]
            ins += [lf.node for lf in leaves if lf.dim is None]
            out = _unrolled_val(n, keep, d)
            gain = ctx.node_time([n] + moved) - _fused_s(ctx, scratch, ins, out_dtype, out)
            if _reorders(n, ins, out):  # aten's result is contiguous where its input was not: a copy back
                gain += ctx.price(aten.clone.default, n)
            label = f"{n.name} ({ir.op_name(n)} over {r} along dim {d}" + (
                f", with {', '.join(m.name for m in moved)})" if moved else ")")
            candidates.append(Candidate("small reduction -> adds of its slices", [n] + moved, gain,
                                        lambda n=n, tree=tree, moved=moved, spec=spec: _apply(gm, n, tree, moved, spec),
                                        label=label))
        res.apply_ranked(ctx, candidates)
        return res


def _fused_s(ctx, scratch, ins, out_dtype, out) -> float:
    """Predicted seconds of the one kernel fuse_elementwise makes of the terms: it reads ``ins`` (built
    on ``scratch``) and writes ``out``."""
    fused = scratch.call(torch.ops.graphopt.fused_pointwise.default, _sum_program(len(ins), out_dtype), ins, val=[out])
    return ctx.cost.time_of([fused], ctx.hints)


def _accumulate(call, terms, out_dtype):
    """The terms' sum, each converted to the accumulation dtype (float32 for 16-bit values, as aten's
    reductions and cuBLAS accumulate) and added in order; the sum in that dtype."""
    acc_dtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    acc = None
    for t in terms:
        if ir.info(t).dtype != acc_dtype:
            t = call(aten._to_copy.default, t, dtype=acc_dtype)
        acc = t if acc is None else call(aten.add.Tensor, acc, t)
    return acc


def _legal_matmul(n: fx.Node):
    """(why not, (a, b, k, out dtype, bias)) of a matmul/bmm, or of a linear (b its [N, K] weight,
    read one column per term, and its bias)."""
    linear = n.target is LINEAR
    a, b = (n.args[:2] if len(n.args) >= 2 else (None, None))
    bias = n.args[2] if linear and len(n.args) > 2 else None
    ai = ir.info(a) if isinstance(a, fx.Node) else None
    bi = ir.info(b) if isinstance(b, fx.Node) else None
    ci = ir.info(bias) if isinstance(bias, fx.Node) else None
    oi = ir.info(n)
    if ai is None or bi is None or oi is None or n.kwargs or (bias is not None and ci is None):
        return "no tensor metadata", None
    if ai.dtype not in _FLOATS or bi.dtype != ai.dtype or oi.dtype != ai.dtype or (ci is not None and ci.dtype != ai.dtype):
        return f"not floating tensors of one dtype ({ai.dtype}, {bi.dtype})", None
    if ai.symbolic or bi.symbolic:
        return "symbolic shapes", None
    if len(ai.shape) < (1 if linear else 2) or len(bi.shape) < 2 or (linear and len(bi.shape) != 2):
        return "a vector operand", None
    k = ai.shape[-1]
    if k != bi.shape[-1 if linear else -2] or not 2 <= k <= UNROLL:
        return f"a contraction over {k} (unrolled: 2..{UNROLL})", None
    if 2 * k + (bias is not None) > MAX_INPUTS:
        return f"{2 * k} slices: over fuse_elementwise's {MAX_INPUTS} inputs", None
    return "", (a, b, k, oi.dtype, bias)


def _matmul_slices(call, a, b, k, linear: bool):
    """Per term i: a's column i as [.., M, 1] and b's row i as [.., 1, N] (a linear's weight column
    i as [N])."""
    cols = [call(aten.unsqueeze.default, call(aten.select.int, a, -1, i), -1) for i in range(k)]
    if linear:
        return cols, [call(aten.select.int, b, 1, i) for i in range(k)]
    return cols, [call(aten.unsqueeze.default, call(aten.select.int, b, -2, i), -2) for i in range(k)]


def _apply_matmul(gm: fx.GraphModule, n: fx.Node, spec):
    a, b, k, out_dtype, bias = spec
    g = gm.graph
    call = GraphBuilder(g, gm).call  # (metadata as made: the next node's dtype checks read it)
    with g.inserting_before(n):
        cols, rows = _matmul_slices(call, a, b, k, n.target is LINEAR)
        acc = _accumulate(call, [call(aten.mul.Tensor, c, r) for c, r in zip(cols, rows)], out_dtype)
        if bias is not None:  # added to the float32 sum as it is (type promotion: no cast node of a constant)
            acc = call(aten.add.Tensor, acc, bias)
        if ir.info(acc).dtype != out_dtype:
            acc = call(aten._to_copy.default, acc, dtype=out_dtype)
    n.replace_all_uses_with(acc)
    g.erase_node(n)
    return acc


def _legal(n: fx.Node):
    x = n.args[0] if n.args else None
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    oi = ir.info(n)
    if xi is None or oi is None or not xi.shape:
        return "no tensor metadata", None
    if xi.dtype not in _FLOATS or oi.dtype not in _FLOATS:
        return f"not a floating tensor ({xi.dtype})", None
    if xi.symbolic:
        return "symbolic shapes", None
    dims = get_arg(n, 1, "dim", None)
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return "not over exactly one dim", None
    rank = len(xi.shape)
    d = dims[0] % rank
    r = xi.shape[d]
    if not isinstance(r, int) or not 2 <= r <= UNROLL:
        return f"over {r} elements (unrolled: 2..{UNROLL})", None
    keep = bool(get_arg(n, 2, "keepdim", False))
    dtype = n.kwargs.get("dtype")
    if dtype is not None and dtype not in _FLOATS:
        return f"sums into {dtype}", None
    return "", (x, d, r, keep, oi.dtype)


def _expr(v, dv: int, r: int, depth: int, movable):
    """The terms' expression for value ``v`` whose dim ``dv`` is the reduced one (extent r), and the
    nodes moved into it (``movable(node)``: no in-place write between it and the reduction)."""
    if not isinstance(v, fx.Node):
        return v, []
    vi = ir.info(v)
    if (depth >= MAX_DEPTH or v.op != "call_function" or v.target not in OPS or len(v.users) != 1
            or vi is None or vi.dtype not in _FLOATS or len(vi.shape) <= dv or vi.shape[dv] != r
            or not movable(v)):
        return _Leaf(v, dv), []
    operands, moved = [], [v]
    for a in _operands(v):
        if not isinstance(a, fx.Node):
            operands.append(a)
            continue
        ai = ir.info(a)
        if ai is None or ai.symbolic:
            return _Leaf(v, dv), []
        da = dv - (len(vi.shape) - len(ai.shape))  # right-aligned broadcasting
        if da < 0:
            operands.append(_Leaf(a, None))
        elif ai.shape[da] == 1:
            operands.append(_Leaf(a, da, index0=True))
        else:
            sub, more = _expr(a, da, r, depth + 1, movable)
            operands.append(sub)
            moved += more
    return _Op(v, operands), moved


def _leaves(tree) -> list:
    if isinstance(tree, _Leaf):
        return [tree]
    if isinstance(tree, _Op):
        return [lf for o in tree.operands for lf in _leaves(o)]
    return []


def _inputs(leaves, r: int) -> int:
    """Tensors the fused kernel would read: r slices of each per-term leaf, one of each other."""
    return sum(r if lf.per_term() else 1 for lf in leaves)


def _sum_program(n_inputs: int, dtype) -> str:
    """A program of n inputs' sum (its price is one kernel's reads and write, whatever it computes)."""
    from graphopt.cuda_ext.pointwise import Program

    p = Program()
    acc = p.input(0)
    for i in range(1, n_inputs):
        acc = acc + p.input(i)
    p.output(acc, dtype)
    return p.source


def _reorders(n: fx.Node, ins, out) -> bool:
    """Is the reduction's result contiguous (aten's reductions write it so) where the unrolled one
    (``out``, without a kept dim) would keep its input's non-contiguous memory order
    (fused_pointwise's layout rule)?"""
    from graphopt.cuda_ext.pointwise import dense_order

    val = n.meta.get("val")
    vals = [i.meta.get("val") for i in ins]
    if not isinstance(val, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    return val.is_contiguous() and dense_order(vals, tuple(out.shape)) is not None


def _unrolled_val(n: fx.Node, keep: bool, d: int):
    """The fused kernel's output value: the reduction's, without the kept dim."""
    val = n.meta.get("val")
    return val.squeeze(d) if keep else val


def _apply(gm: fx.GraphModule, n: fx.Node, tree, moved, spec):
    x, d, r, keep, out_dtype = spec
    g = gm.graph
    call = GraphBuilder(g, gm).call  # (metadata as made: the next node's dtype checks read it)

    once: dict = {}  # a leaf read the same in every term: one select

    def build(e, i):
        if isinstance(e, _Leaf):
            if e.dim is None:
                return e.node
            if e.index0:
                if id(e) not in once:
                    once[id(e)] = call(aten.select.int, e.node, e.dim, 0)
                return once[id(e)]
            parts = _stacked(e.node, e.dim)
            if parts is not None:  # select(stack(xs, d), d, i) is xs[i]: the stack is not read
                return parts[i]
            return call(aten.select.int, e.node, e.dim, i)
        if isinstance(e, _Op):
            args = [build(o, i) for o in e.operands]
            rest = list(e.node.args[len(args):])
            return call(e.node.target, *args, *rest, **e.node.kwargs)
        return e

    with g.inserting_before(n):
        acc = _accumulate(call, [build(tree, i) for i in range(r)], out_dtype)
        if n.target is aten.mean.dim:
            acc = call(aten.div.Tensor, acc, float(r))
        if ir.info(acc).dtype != out_dtype:
            acc = call(aten._to_copy.default, acc, dtype=out_dtype)
        if keep:
            acc = call(aten.unsqueeze.default, acc, d)
    n.replace_all_uses_with(acc)
    g.erase_node(n)
    for m in moved:  # each had one user: the next one out, now gone
        g.erase_node(m)
    for lf in _leaves(tree):  # a stack every term read past and nothing else reads
        if lf.node.graph is g and not lf.node.users and _stacked(lf.node, lf.dim) is not None:
            g.erase_node(lf.node)
    return acc


def _stacked(node: fx.Node, dim) -> list | None:
    """The tensors ``node`` stacks along ``dim`` (aten.stack, each of one shape), or None."""
    if dim is None or node.op != "call_function" or node.target is not aten.stack.default:
        return None
    parts = node.args[0]
    d = get_arg(node, 1, "dim", 0)
    rank = len(ir.info(node).shape) if ir.info(node) is not None else 0
    if not rank or not isinstance(d, int) or d % rank != dim or not all(isinstance(t, fx.Node) for t in parts):
        return None
    return list(parts)
