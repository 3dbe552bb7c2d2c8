"""lower_strided_bmm: a batched ``matmul``/``bmm`` that aten would run around copies -> one
``graphopt::strided_bmm`` that reads its operands where they are and writes the layout its readers
read.

cuBLAS's strided-batched GEMM takes one batch stride per operand, so aten's matmul copies an
operand whose batch dims do not fold into one (heads split out of a fused projection:
``qkv.reshape(B, N, 3, h, d).permute(2, 0, 3, 1, 4)`` gives q, k, v with batch strides N*3*h*d and d),
and writes a contiguous result that a head merge (``transpose(1, 2).reshape(B, N, h * d)``) copies
again. CoaT's factorized attention runs two such products a block (``k.softmax(2).transpose(-1, -2)
@ v``, then ``q @ kv``), each with its copies.

Legality: ``matmul``/``bmm`` of static shapes, both operands fp32, fp16 or bf16 of one dtype, one
of at least three dims and both at most five (a 2-D operand is broadcast over the other's batch
dims by a zero-stride ``expand``, as are size-1 batch dims), inference or a training graph (the op
has a backward). Small matrices only (M*N*K <= ``MAX_MNK``): the kernel's tiles are plain
``tl.dot`` loops, no match for cuBLAS on large products, and a copy costs as much as a small
product. There must be a copy to remove: an operand aten copies (``matmul_copy_bytes``) or a
reader that reads the result only through a copy.

The output's layout: among the dim orders that keep its last dim innermost, the one that lets the
most of its readers' view chains end in a row-major tensor (replayed on meta tensors; ties keep
the contiguous layout). Profitability: aten's product (its copies included) and its readers
against the op and the readers replayed on its layout (``_reprice``).
"""
from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import matmul_copy_bytes
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, set_meta
from ._reprice import closure, reader_chains, reprice, row_major_after

aten = torch.ops.aten
PRODUCTS = (aten.matmul.default, aten.bmm.default)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MAX_MNK = 2 ** 22


def best_order(node: fx.Node, shape: tuple) -> list[int]:
    """The output's dim order (outermost first; [] for contiguous) that the most reader chains read
    as a row-major tensor, the last dim kept innermost; ties keep contiguous."""
    chains = [c for c in reader_chains(node) if c]
    if not chains:
        return []
    rank = len(shape)
    best, best_n = [], sum(row_major_after(torch.empty(shape, device="meta"), c) for c in chains)
    for perm in itertools.permutations(range(rank - 1)):
        order = list(perm) + [rank - 1]
        if order == list(range(rank)):
            continue
        t = torch.empty_permuted(shape, order, device="meta")
        n = sum(row_major_after(t, c) for c in chains)
        if n > best_n:
            best, best_n = order, n
    return best


def spec(node: fx.Node):
    """(why not, (a, b, batch shape, M, N, K))."""
    a, b = node.args[0], node.args[1]
    ai, bi, oi = ir.info(a), ir.info(b), ir.info(node)
    if ai is None or bi is None or oi is None:
        return "no tensor metadata", None
    if ai.symbolic or bi.symbolic:
        return "symbolic shapes", None
    if ai.dtype not in FLOATS or bi.dtype != ai.dtype:
        return f"{ai.dtype} x {bi.dtype} (one of fp32, fp16, bf16 for both)", None
    ra, rb = len(ai.shape), len(bi.shape)
    if max(ra, rb) < 3:
        return "not batched", None
    if min(ra, rb) < 2 or max(ra, rb) > 5:
        return f"operands of {ra} and {rb} dims (2 to 5, one batched)", None
    batch = tuple(oi.shape[:-2])
    M, K, N = ai.shape[-2], ai.shape[-1], bi.shape[-1]
    if M * N * K > MAX_MNK:
        return f"{M}x{N}x{K} per matrix (over {MAX_MNK}: cuBLAS's)", None
    return "", (a, b, batch, M, N, K)


def _build(call, a, b, batch, order, ai, bi):
    """The op's nodes: each operand expanded to the batch shape where it is not already."""
    ops = []
    for x, xi in ((a, ai), (b, bi)):
        want = list(batch) + list(xi.shape[-2:])
        if tuple(xi.shape) != tuple(want):
            x = call(aten.expand.default, x, want)
        ops.append(x)
    return call(torch.ops.graphopt.strided_bmm.default, ops[0], ops[1], order)


@register
class LowerStridedBmm(Pass):
    name = "lower_strided_bmm"
    family = "lower"
    description = ("batched products aten runs around copies (operands whose batch dims do not fold, results "
                   "a head merge copies) -> one Triton kernel reading and writing through strides")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in PRODUCTS]
        if not nodes:
            return res
        why_train = ctx.untrainable(torch.ops.graphopt.strided_bmm.default)
        cands = []
        for node in nodes:
            if why_train:
                res.reject(node.name, why_train)
                continue
            why, s = spec(node)
            if why:
                res.reject(node.name, why)
                continue
            a, b, batch, M, N, K = s
            oi = ir.info(node)
            order = best_order(node, tuple(oi.shape))
            copies = matmul_copy_bytes(node)
            views, consumers = closure(node)
            if any(c.op == "output" for c in consumers) and order:
                order = []  # (the caller gets the layout aten gives)
            if copies <= 0 and not order:
                res.reject(node.name, "aten copies no operand and every reader reads the contiguous result")
                continue
            r = ctx.replacement()
            try:
                new = _build(r.call, a, b, batch, order, ir.info(a), ir.info(b))
                before, _ = reprice(ctx, r, node, new, views, consumers)
            except Exception as e:  # noqa: BLE001 - a reader's view the new layout does not allow
                res.reject(node.name, f"a reader does not take the layout {order} ({type(e).__name__})")
                continue
            gain = ctx.node_time([node]) + before - r.time()
            what = (f"{'x'.join(map(str, batch))} products of {M}x{K} by {K}x{N}"
                    + (f", written in dim order {order}" if order else "")
                    + (f", {copies / 1e6:.1f} MB of operand copies gone" if copies > 0 else ""))
            cands.append(Candidate(what, [node], gain,
                                   lambda node=node, s=s, order=order: self._apply(gm, node, s, order),
                                   label=node.name))
        res.apply_ranked(ctx, cands, fused_kernels=True)
        return res

    @staticmethod
    def _apply(gm, node, s, order):
        a, b, batch, *_ = s
        g = gm.graph
        bld = GraphBuilder(g)
        with g.inserting_before(node):
            out = _build(bld.call, a, b, batch, order, ir.info(a), ir.info(b))
        set_meta(gm, bld.made)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        return out
