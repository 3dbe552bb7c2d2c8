"""merge_sibling_linears: linears that read the same input become one GEMM.

    q = linear(x, Wq, bq); k = linear(x, Wk, bk); v = linear(x, Wv, bv)
 -> qkv = linear(x, cat([Wq, Wk, Wv]), cat([bq, bk, bv]))
    q, k, v = split_with_sizes(qkv, [Nq, Nk, Nv], -1)          # views, no copies

BERT's Q/K/V, GLM-4's Q/K/V (with bias), Llama's gate/up (then fuse_swiglu sees gate and up
as the two halves of one tensor: siblings keep graph order, gate_proj is traced first).
The weights are concatenated once, at optimization time, into new buffers (a copy: the
model's parameters are untouched, so the pass is inference-only; the copy counts against
optimize's ``weight_copies`` limit, graphopt.setup_memory). An aten rewrite: it may
apply on any profile when the cost model predicts a gain (one launch and one read of x
instead of n, against nothing: the FLOPs are the same).

Refused: siblings whose weights differ in dtype or device (grouped by those, a group of one
is reported), some with bias and some without (merged separately), a sibling whose output
feeds a ``view`` that cannot view the strided slice.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Attr, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import nbytes, set_meta

aten = torch.ops.aten

LINEAR = Op(aten.linear.default, Any("x"), Attr("w"), Attr("b", optional=True), name="lin")
_VIEWS = (aten.view.default, aten._unsafe_view.default)


@register
class MergeSiblingLinears(Pass):
    name = "merge_sibling_linears"
    family = "fusion"
    description = "merge linears reading the same input into one GEMM over concatenated weights + views"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        groups: dict = defaultdict(list)
        for m in find(gm, LINEAR):
            groups[m["x"]].append(m)
        candidates = []
        for x, ms in groups.items():
            if len(ms) < 2:
                continue
            # split into mergeable families: same weight dtype/device, all with or all without bias
            fams: dict = defaultdict(list)
            for m in ms:
                wi = ir.info(m["w"])
                fams[(wi.dtype, wi.device, m.get("b") is not None)].append(m)
            if len(fams) > 1:
                keys = list(fams)
                res.reject(", ".join(m["lin"].name for m in ms),
                           "siblings differ in " + _difference(keys) + "; merged only within groups that agree")
            for key, fam in fams.items():
                if len(fam) < 2:
                    if len(fams) > 1:
                        res.reject(fam[0]["lin"].name, "no sibling with the same weight dtype/device and bias presence")
                    continue
                cand = self._candidate(gm, ctx, res, x, fam)
                if cand is not None:
                    candidates.append(cand)
        res.apply_ranked(ctx, candidates)
        return res

    def _candidate(self, gm, ctx, res, x, fam) -> Candidate | None:
        lins = [m["lin"] for m in fam]
        label = f"{' + '.join(n.name for n in lins)} (input {x.name})"
        wis = [ir.info(m["w"]) for m in fam]
        if any(len(w.shape) != 2 for w in wis) or any(not isinstance(w.shape[0], int) for w in wis):
            res.reject(label, "weights are not 2-D with static output features")
            return None
        if any(m.get("b") is not None and len(ir.info(m["b"]).shape) != 1 for m in fam):
            res.reject(label, "a bias is not 1-D")
            return None
        # users that view the output must still be able to view a strided slice of the merged output
        for lin in lins:
            for u in lin.users:
                if u.target in _VIEWS and not _view_ok(lin, u, sum(w.shape[0] for w in wis), ctx.hints):
                    res.reject(label, f"{u.name} views {lin.name} in a way a strided slice cannot be viewed")
                    return None
        gain = ctx.node_time(lins) - _merged_time(ctx, x, fam)
        copied = sum(nbytes(w, ctx.hints) for w in wis)
        copied += sum(nbytes(ir.info(m["b"]), ctx.hints) for m in fam if m.get("b") is not None)
        return Candidate("sibling linears", lins, gain, lambda: _merge(gm, x, fam), label=label,
                         constant_bytes=copied)


def _difference(keys) -> str:
    parts = []
    if len({k[0] for k in keys}) > 1:
        parts.append("weight dtype")
    if len({k[1] for k in keys}) > 1:
        parts.append("device")
    if len({k[2] for k in keys}) > 1:
        parts.append("bias (some have one, some not)")
    return " and ".join(parts)


def _view_ok(lin: fx.Node, view: fx.Node, total_n: int, hints) -> bool:
    """Can ``view`` be applied to lin's output when it becomes a slice of a [.., total_n] tensor?"""
    ti = ir.info(lin)
    try:
        shape = [int(ir.concrete(d, hints)) for d in ti.shape]
        merged = torch.empty(shape[:-1] + [total_n], device="meta")
        part = merged[..., : shape[-1]]
        size = [int(ir.concrete(d, hints)) if not isinstance(d, int) else d
                for d in (s.node.expr if isinstance(s, torch.SymInt) else s for s in view.args[1])]
        part.view(size)
        return True
    except Exception:
        return False


def _merged_time(ctx, x, fam) -> float:
    """Predicted time of what the merge makes: one GEMM over the concatenated weights (x read
    once, one launch) and the split of its output into views."""
    r = ctx.replacement()
    wis = [ir.info(m["w"]) for m in fam]
    sizes = [int(w.shape[0]) for w in wis]
    w = r.tensor((sum(sizes), wis[0].shape[1]), wis[0].dtype, wis[0].device)
    args = (x, w)
    if fam[0].get("b") is not None:
        bi = ir.info(fam[0]["b"])
        args += (r.tensor((sum(sizes),), bi.dtype, bi.device),)
    r.call(aten.split_with_sizes.default, r.call(aten.linear.default, *args), sizes, -1)
    return r.time()


def _merge(gm: fx.GraphModule, x: fx.Node, fam) -> fx.Node:
    g = gm.graph
    lins = [m["lin"] for m in fam]
    x = lins[0].args[0]  # live: an earlier merge in this pass may have replaced the input node
    first = _first(g, lins)
    with torch.no_grad():
        ws = [ir.get_attr_value(gm, m["w"].target) for m in fam]
        w = torch.cat([t.detach() for t in ws], 0).contiguous()
        bs = None
        if fam[0].get("b") is not None:
            bs = torch.cat([ir.get_attr_value(gm, m["b"].target).detach() for m in fam], 0).contiguous()
    base = lins[0].name
    w_name = ir.register_constant(gm, f"{base}_merged_weight", w)
    b_name = ir.register_constant(gm, f"{base}_merged_bias", bs) if bs is not None else None
    sizes = [t.shape[0] for t in ws]
    with g.inserting_before(first):
        w_node = g.get_attr(w_name)
        b_node = g.get_attr(b_name) if b_name else None
        args = (x, w_node, b_node) if b_node is not None else (x, w_node)
        merged = g.call_function(aten.linear.default, args)
        split = g.call_function(aten.split_with_sizes.default, (merged, sizes, -1))
        outs = [g.call_function(ir.GETITEM, (split, i)) for i in range(len(lins))]
    set_meta(gm, [w_node] + ([b_node] if b_node is not None else []) + [merged, split] + outs)
    for lin, out in zip(lins, outs):
        lin.replace_all_uses_with(out)
    attrs = [m["w"] for m in fam] + [m["b"] for m in fam if m.get("b") is not None]
    ir.erase_dead(gm, lins)
    for a in attrs:
        if not a.users:
            g.erase_node(a)
    return merged


def _first(g: fx.Graph, nodes) -> fx.Node:
    want = set(nodes)
    for n in g.nodes:
        if n in want:
            return n
    raise AssertionError("sibling not in graph")
