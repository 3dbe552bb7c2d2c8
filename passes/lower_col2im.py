"""lower_col2im: ``aten.col2im`` (``F.fold``, ``nn.Fold``) -> ``graphopt::col2im`` reading its
windows where they are and writing the layout its readers want.

aten's CUDA col2im reads a contiguous [N, C*kh*kw, L] tensor, so a fold of a permuted product is
preceded by a copy (``reshape``/``clone`` of the permute: VOLO's outlooker folds
``(attn @ v).permute(...).reshape(...)``), and writes NCHW, which a reader that permutes to
channels-last and multiplies (``proj(x.permute(0, 2, 3, 1))``) copies again. The rewrite follows
the fold's input back through the copies and views that keep its elements' order (``reshape``,
``view``, ``_unsafe_view``, ``clone``; not past a tensor something writes in place) to the earliest
tensor that is a strided 7-D view
[N, C1, C2, kh, kw, lh, lw] of the same elements (channels as two dims where a permute split
them; torch's own view rule on a meta tensor decides), and hands that view to one Triton kernel;
the copies it no longer needs are dead. The output is channels_last where a reader of the fold
reads it through views that end in a row-major tensor only then (``permute(0, 2, 3, 1)``, or
``flatten(2).transpose(1, 2)`` into tokens) and none reads the NCHW tensor as it is; contiguous otherwise.

Sums in fp32 where aten sums in its accumulation type: values within the accuracy rule, not
bitwise. Differentiable (the op's gradient is ``F.unfold``). Applies to a batched (3-D) input of
static shape in fp32, fp16 or bf16 on a GPU profile; cost-gated against aten's col2im and the
copies that die.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_ext.ops.col2im import windows
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, int_pairs, set_meta
from ._reprice import reader_chains, row_major_after

aten = torch.ops.aten
COL2IM = aten.col2im.default
# ops whose output holds their input's elements in the same (row-major) order
_ORDER_KEEPING = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.clone.default,
                  aten.alias.default}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def spec(node: fx.Node):
    """(why not, (output_size, kernel, dilation, padding, stride), (N, C, lh, lw): the batch, the channels
    and the grid of windows) for an aten.col2im node."""
    args = int_pairs(node, ((1, "output_size"), (2, "kernel_size"), (3, "dilation"), (4, "padding"), (5, "stride")))
    if args is None:
        return "output size, kernel, dilation, padding or stride not two integers", None, None
    xi, oi = ir.info(node.args[0]), ir.info(node)
    if xi is None or oi is None:
        return "no tensor metadata", None, None
    if xi.symbolic:
        return "symbolic shapes", None, None
    if len(xi.shape) != 3:
        return f"a {len(xi.shape)}-D input (an unbatched fold is left to aten)", None, None
    if xi.dtype not in _FLOATS:
        return f"{xi.dtype} (the kernel takes fp32, fp16 and bf16)", None, None
    out_size, (kh, kw), dil, pad, stride = args
    n, ckk, L = xi.shape
    lh, lw = (windows(out_size[i], (kh, kw)[i], dil[i], pad[i], stride[i]) for i in range(2))
    if ckk % (kh * kw) or L != lh * lw or lh < 1 or lw < 1:
        return f"input {tuple(xi.shape)} is not a fold's [N, C*{kh * kw}, {lh * lw}]", None, None
    return "", tuple(args), (n, ckk // (kh * kw), lh, lw)


def _seven_d(info: ir.TensorInfo, shape: tuple, k: list) -> int | None:
    """The least C2 for which a tensor with ``info``'s shape and strides is viewable as
    [N, C // C2, C2, kh, kw, lh, lw] (None: for none)."""
    if info is None or info.symbolic or info.stride is None:
        return None
    n, c, lh, lw = shape
    t = torch.empty_strided(tuple(info.shape), tuple(info.stride), device="meta")
    for c2 in [d for d in range(1, c + 1) if c % d == 0]:
        try:
            t.view(n, c // c2, c2, *k, lh, lw)
        except RuntimeError:
            continue
        return c2
    return None


def source(node: fx.Node, k: list, shape: tuple, storages=None) -> tuple[fx.Node, int, list[fx.Node]]:
    """(the earliest tensor the fold can read as a 7-D view, its C2, the copies and views between
    it and the fold that are read by nothing else) for kernel ``k`` and ``shape`` (:func:`spec`'s).
    ``storages``: ``ir.storages`` of the graph; the walk stops before a tensor whose storage
    something writes in place (read later, at the fold, it could hold other values than the copy took)."""
    storage, writes = storages if storages is not None else ({}, {})
    chain = [node.args[0]]
    cur = chain[0]
    while (isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target in _ORDER_KEEPING
           and isinstance(cur.args[0], fx.Node) and ir.info(cur.args[0]) is not None
           and ir.info(cur.args[0]).numel == ir.info(cur).numel
           and not writes.get(storage.get(cur.args[0], cur.args[0]))):
        cur = cur.args[0]
        chain.append(cur)
    for i in range(len(chain) - 1, -1, -1):
        c2 = _seven_d(ir.info(chain[i]), shape, k)
        if c2 is None:
            continue
        dead, readers = [], {node}
        for m in chain[:i]:  # from the fold's input back: each dies once its only readers have
            if set(m.users) <= readers:
                dead.append(m)
                readers.add(m)
            else:
                break
        return chain[i], c2, dead
    raise AssertionError("a contiguous [N, C*kh*kw, L] input is always viewable")  # chain[0] at worst


def _channels_last_readers(node: fx.Node, shape: tuple) -> bool:
    """channels_last where some reader's views end in a row-major tensor only if the fold is written
    channels_last (VOLO's ``proj(y.permute(0, 2, 3, 1))``, tokens read as ``y.flatten(2).transpose(1, 2)``)
    and none only if it is written NCHW (a reader of the NCHW tensor itself)."""
    nchw = torch.empty(shape, device="meta")
    nhwc = nchw.contiguous(memory_format=torch.channels_last)
    wants = [(row_major_after(nchw, c), row_major_after(nhwc, c)) for c in reader_chains(node)]
    return any(cl and not ct for ct, cl in wants) and not any(ct and not cl for ct, cl in wants)


def _build(call, src, c2, args, shape, channels_last):
    (H, W), (kh, kw), dil, pad, stride = args
    n, c, lh, lw = shape
    v = call(aten.view.default, src, [n, c // c2, c2, kh, kw, lh, lw])
    return call(torch.ops.graphopt.col2im.default, v, [H, W], [kh, kw], list(dil), list(pad), list(stride),
                channels_last)


@register
class LowerCol2im(Pass):
    name = "lower_col2im"
    family = "fusion"
    description = ("col2im (F.fold) -> one Triton kernel reading the windows through their strides (no copy "
                   "first) and writing channels_last where the readers permute to it")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        cands = []
        folds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is COL2IM]
        storages = ir.storages(gm) if folds else None  # (a walk of the graph: only where there is a fold)
        for node in folds:
            why, args, shape = spec(node)
            if why:
                res.reject(node.name, why)
                continue
            (H, W), (kh, kw), dil, pad, stride = args
            src, c2, dead = source(node, [kh, kw], shape, storages)
            n = shape[0]
            cl = _channels_last_readers(node, (n, shape[1], H, W))
            r = ctx.cost.replacement(ctx.hints)
            _build(r.call, src, c2, args, shape, cl)
            old, new = ctx.node_time([node, *dead]), r.time()
            gone = f", {len(dead)} copy or view node{'s' if len(dead) > 1 else ''} before it gone" if dead else ""
            what = (f"fold {kh}x{kw}/{stride[0]}x{stride[1]} of {n}x{shape[1]} channels{gone}"
                    f"{', channels_last out' if cl else ''}")
            cands.append(Candidate(what, [node, *dead], old - new,
                                   lambda node=node, src=src, c2=c2, args=args, shape=shape, cl=cl, dead=dead:
                                   self._apply(gm, node, src, c2, args, shape, cl, dead),
                                   label=node.name))
        res.apply_ranked(ctx, cands, fused_kernels=True)
        return res

    @staticmethod
    def _apply(gm, node, src, c2, args, shape, cl, dead):
        g = gm.graph
        b = GraphBuilder(g)
        with g.inserting_before(node):
            out = _build(b.call, src, c2, args, shape, cl)
        set_meta(gm, b.made)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        for m in dead:  # from the fold's input back
            if not m.users:
                g.erase_node(m)
        return out
