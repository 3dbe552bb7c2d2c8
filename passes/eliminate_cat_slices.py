"""eliminate_cat_slices: a slice, select or split piece of a concatenation that lies inside one of
the concatenated tensors reads that tensor instead; a concatenation whose every reader is such a
piece is then dead.

``x = torch.cat((cls, tokens), 1)`` followed by ``x[:, :1]`` and ``x[:, 1:]`` (a class token split
off again, as vision transformers with a class token do around each convolutional position
encoding) copies both pieces into a new tensor only to read them back as they were: the slices
are ``cls`` and ``tokens`` themselves. Read from the pieces, the concatenation goes, and the
readers see the pieces' own layout: a depthwise convolution over ``x[:, 1:]`` reshaped to an
image reads a dense channels_last tensor, where the slice of the concatenation (a batch stride
one token longer) made cuDNN's caller copy it first.

Legality, per reader of ``cat(pieces, d)``:
* ``slice(x, d, start, end, 1)``, ``narrow``, ``select(x, d, i)`` or an item of ``split``/``split_with_sizes``
  along ``d``, whose range (static sizes) lies inside one piece; it becomes that piece (the whole
  piece) or the same slice/select of the piece at the piece's offset.
* Every piece has the concatenation's dtype (``cat`` promotes) and rank.
* Nothing writes the concatenation's memory or the piece's in place (the slice is a view of the
  concatenation's own copy: a write to either would reach the other once they are one).
* The views reading the slice are still views on the piece's strides (replayed on fake tensors),
  and none of them is returned by the graph (the caller would get an alias of the piece).

Profitability: the concatenation's time when it dies, plus the difference in the readers' predicted
times with the piece's strides instead of the slice's (a convolution or GEMM that no longer copies
its input, or one that now would).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._reprice import closure, reprice
from ._slices import RANGES, SPLITS, arg, node_range, split_bounds

aten = torch.ops.aten

CAT = aten.cat.default


def _static(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def _reads(cat: fx.Node, dim: int, size: int) -> tuple[list, list]:
    """(readers, refused): each reader of ``cat`` as (node to replace, kind, start, stop) with kind
    "slice" or "select" (stop = start + 1), a split's items as slices; refused as (node, reason)."""
    out, refused = [], []
    rank = len(ir.info(cat).shape)
    for u in cat.users:
        if u.op != "call_function":
            refused.append((u, "read by something other than a slice, select or split"))
        elif u.target in RANGES and u.args[0] is cat:
            what, kind, d, start, stop = node_range(u, size)
            if not isinstance(d, int) or d % rank != dim:
                refused.append((u, f"a {what} along another dim than the concatenation's"))
            elif start is None:
                refused.append((u, f"a {what} with symbolic bounds or a step"))
            else:
                out.append((u, kind, start, stop))
        elif u.target in SPLITS and u.args[0] is cat:
            d = arg(u, 2, "dim", 0)
            if not isinstance(d, int) or d % rank != dim:
                refused.append((u, "a split along another dim than the concatenation's"))
                continue
            bounds = split_bounds(u, size)
            if bounds is None:
                refused.append((u, "a split with symbolic sizes"))
                continue
            for item in list(u.users):
                if item.target is not operator.getitem or not isinstance(item.args[1], int):
                    refused.append((item, "a split's result read whole"))
                    continue
                k = item.args[1]
                out.append((item, "slice", bounds[k], bounds[k + 1]))
        else:
            refused.append((u, f"read by {ir.op_name(u)}"))
    return out, refused


@register
class EliminateCatSlices(Pass):
    name = "eliminate_cat_slices"
    family = "cleanup"
    description = "a slice, select or split item of a concatenation inside one of its pieces reads that piece"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        storage, writes = ir.storages(gm)
        candidates = []
        for cat in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CAT]:
            why, plan = self._plan(cat, storage, writes)
            if why:
                res.reject(cat.name, why)
                continue
            dim, size, pieces, offsets = plan
            reads, refused = _reads(cat, dim, size)
            if not reads:  # no slice, select or split reads it: nothing to consider
                continue
            for u, reason in refused:
                res.reject(f"{cat.name} -> {u.name}", reason)
            rewrites = []
            for node, kind, start, stop in reads:
                why, rw = self._read(ctx, node, kind, start, stop, dim, pieces, offsets, storage, writes)
                if why:
                    res.reject(f"{cat.name} -> {node.name}", why)
                else:
                    rewrites.append(rw)
            if not rewrites:
                continue
            dies = not refused and len(rewrites) == len(reads)
            gain = sum(rw["gain"] for rw in rewrites) + (ctx.node_time([cat]) if dies else 0.0)
            matched = [cat] + [rw["node"] for rw in rewrites]
            candidates.append(Candidate(
                "slice of a concatenation -> its piece", matched, gain,
                lambda gm=gm, cat=cat, rewrites=rewrites: self._apply(gm, cat, rewrites),
                label=f"{cat.name}: {', '.join(rw['node'].name for rw in rewrites)}"
                      + (" (the concatenation dies)" if dies else "")))
        res.apply_ranked(ctx, candidates)
        return res

    @staticmethod
    def _plan(cat, storage, writes):
        ci = ir.info(cat)
        pieces = cat.args[0] if cat.args else cat.kwargs.get("tensors")
        dim = arg(cat, 1, "dim", 0)
        if ci is None or not isinstance(pieces, (list, tuple)) or not isinstance(dim, int):
            return "no static metadata", None
        if not _static(ci.shape):
            return "symbolic shapes", None
        dim %= len(ci.shape)
        infos = [ir.info(p) if isinstance(p, fx.Node) else None for p in pieces]
        if any(i is None or len(i.shape) != len(ci.shape) for i in infos):
            return "a piece of another rank (or not a tensor node)", None
        if any(i.dtype != ci.dtype for i in infos):
            return "the concatenation promotes a piece's dtype", None
        if writes.get(storage.get(cat, cat)):
            return f"{writes[storage.get(cat, cat)][0].name} writes the concatenation in place", None
        offsets = [0]
        for i in infos:
            offsets.append(offsets[-1] + i.shape[dim])
        return "", (dim, ci.shape[dim], list(pieces), offsets)

    @staticmethod
    def _read(ctx, node, kind, start, stop, dim, pieces, offsets, storage, writes):
        """Why ``node`` (a read of [start, stop) along ``dim``) cannot read a piece, or ("", the
        rewrite: the piece, its local bounds, the views' new values and the gain)."""
        if stop <= start:
            return "an empty range", None
        k = next((k for k in range(len(pieces)) if offsets[k] <= start and stop <= offsets[k + 1]), None)
        if k is None:
            return f"[{start}, {stop}) spans more than one piece", None
        piece = pieces[k]
        w = writes.get(storage.get(piece, piece))
        if w:
            return f"{w[0].name} writes the piece {piece.name} in place", None
        lo, hi = start - offsets[k], stop - offsets[k]
        whole = kind == "slice" and lo == 0 and hi == offsets[k + 1] - offsets[k]
        views, consumers = closure(node)
        if any(c.op == "output" for c in consumers):
            return "the graph returns it (the caller would get an alias of the piece)", None
        r = ctx.replacement()
        try:
            if whole:
                new = r.input(piece)
            elif kind == "select":
                new = r.call(aten.select.int, piece, dim, lo)
            else:
                new = r.call(aten.slice.Tensor, piece, dim, lo, hi)
            before, vals = reprice(ctx, r, node, new, views, consumers)
        except Exception as e:  # noqa: BLE001 - a view the piece's strides do not allow
            return f"a reader does not take the piece's strides ({type(e).__name__})", None
        gain = ctx.node_time([node]) + before - r.time()
        return "", {"node": node, "kind": kind, "piece": piece, "dim": dim, "lo": lo, "hi": hi,
                    "whole": whole, "vals": vals, "gain": gain}

    @staticmethod
    def _apply(gm, cat, rewrites):
        g = gm.graph
        made, dead = [], [cat]
        for rw in rewrites:
            node, piece = rw["node"], rw["piece"]
            if rw["whole"]:
                new = piece
            else:
                with g.inserting_before(node):
                    if rw["kind"] == "select":
                        new = g.call_function(aten.select.int, (piece, rw["dim"], rw["lo"]))
                    else:
                        new = g.call_function(aten.slice.Tensor, (piece, rw["dim"], rw["lo"], rw["hi"]))
                pv = piece.meta["val"]
                new.meta["val"] = pv.select(rw["dim"], rw["lo"]) if rw["kind"] == "select" \
                    else pv.narrow(rw["dim"], rw["lo"], rw["hi"] - rw["lo"])
                made.append(new)
            node.replace_all_uses_with(new)
            for v, val in rw["vals"].items():
                v.meta["val"] = val
            dead.append(node)
            if node.target is operator.getitem:
                dead.append(node.args[0])
        ir.erase_dead(gm, dead)
        return made or True
