"""align_gemm: pad a 16-bit projection's output features to a multiple of 8 where N is odd.

cuBLAS's tensor-core kernels want 16-byte aligned rows; a projection whose N (or K) is odd runs an
align1 fallback kernel at a fraction of the GEMM rate (the profile's measured ``gemm_align1``:
FocalNet's 195-wide input projections). Where the weight is a constant (inference) and K is a
multiple of 8, the weight's rows and the bias are padded with zeros once, at optimization time, to
N rounded up to 8; the linear writes ``[..., N8]`` and the graph reads ``slice(out, -1, 0, N)``:
the same values, rows N8 apart in memory. Readers that take strided rows (pointwise ops and
reductions, reached through views) read the slice as it is; any other reader is priced as making
its own copy, and a value returned to the caller is copied to the contiguous layout it had.

Refused, with the reason: training graphs (the weight is a parameter), a weight or bias computed
in the graph, K not a multiple of 8 (the input would need a padded copy too), a ``view`` reading
the slice's strides, symbolic sizes, and where the cost model predicts no gain (a profile without
the ``gemm_align1`` measurement prices an odd N like any other, so nothing is padded).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import gemm_align1
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import STRIDE_READERS, set_meta

aten = torch.ops.aten

# ops whose result is a view of their first argument, followed to the readers that compute
_VIEWS = {aten.permute.default, aten.transpose.int, aten.t.default, aten.slice.Tensor, aten.select.int,
          aten.split_with_sizes.default, aten.split.Tensor, operator.getitem, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unflatten.int, aten.alias.default,
          aten.expand.default, aten.narrow.default}
# readers that take any strides without a copy (besides torch's pointwise ops)
_STRIDED_OK = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}


def _readers(lin: fx.Node, limit: int = 512):
    """([(value, reader)] the projection's result reaches through views, "") or ([], why not)."""
    leaves, stack, seen = [], [lin], {lin}
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and u.target in STRIDE_READERS:
                return [], f"{u.name} ({ir.target_name(u)}) reads the strides of the result"
            if u.op == "call_function" and u.target in _VIEWS and u.args and u.args[0] is n:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
                    if len(seen) > limit:
                        return [], f"more than {limit} views of the result to follow"
                continue
            leaves.append((n, u))
    return leaves, ""


def _strided_ok(reader: fx.Node) -> bool:
    return reader.op == "call_function" and (
        reader.target in _STRIDED_OK or torch.Tag.pointwise in getattr(reader.target, "tags", ())
        or (ir.op_namespace(reader) == "graphopt" and ir.op_name(reader) == "fused_pointwise"))


@register
class AlignGemm(Pass):
    name = "align_gemm"
    family = "lower"
    description = "pad an odd-N 16-bit projection's constant weight to a multiple of 8 rows; read a slice of its output"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        lins = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default
                and gemm_align1(n)]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        candidates = []
        for n in lins:  # (aten's linear on a padded weight: no kernel of ours, so any device may take it)
            why, c = self._candidate(gm, ctx, n, output)
            if why:
                res.reject(f"linear {n.name}", why)
            else:
                candidates.append(c)
        res.apply_ranked(ctx, candidates)
        return res

    def _candidate(self, gm, ctx, lin, output):
        x, w, b = get_arg(lin, 0, "input"), get_arg(lin, 1, "weight"), get_arg(lin, 2, "bias")
        for what, t, rank in (("weight", w, 2), ("bias", b, 1)):
            if t is None and what == "bias":
                continue
            if not (isinstance(t, fx.Node) and t.op == "get_attr"):
                return f"its {what} is computed in the graph, not a constant to pad once", None
            ti = ir.info(t)
            if ti is None or len(ti.shape) != rank:
                return f"its {what} has no {rank}-D tensor metadata", None
        N, K = ir.info(w).shape
        if K % 8:
            return f"K={K} is not a multiple of 8: the input would need a padded copy as well", None
        n8 = -(-N // 8) * 8
        leaves, why = _readers(lin)
        if why:
            return why, None
        r = ctx.replacement()
        wi = ir.info(w)
        wp = r.tensor((n8, K), wi.dtype, wi.device)
        bp = r.tensor((n8,), ir.info(b).dtype, ir.info(b).device) if b is not None else None
        out = r.call(aten.linear.default, x, wp, bp)
        r.call(aten.slice.Tensor, out, len(ir.info(lin).shape) - 1, 0, N)
        copies = [v for v, u in leaves if not _strided_ok(u)]
        for v in dict.fromkeys(copies):  # what a reader that wants rows in memory copies (a returned value too)
            r.call(aten.clone.default, v, memory_format=torch.contiguous_format)
        gain = ctx.node_time([lin]) - r.time()
        itemsize = wi.dtype.itemsize
        added = n8 * K * itemsize + (n8 * ir.info(b).dtype.itemsize if b is not None else 0)
        returned = [v for v, u in leaves if u is output]
        return "", Candidate(f"odd N={N} padded to {n8}", [lin], gain,
                             lambda: self._apply(gm, lin, x, w, b, N, n8, returned, output),
                             label=f"linear {lin.name} ({N} -> {n8} output features)", constant_bytes=added)

    @staticmethod
    def _apply(gm, lin, x, w, b, N, n8, returned, output):
        g = gm.graph
        names = []
        for t in (w, b):
            if t is None:
                names.append(None)
                continue
            value = ir.get_attr_value(gm, t.target).detach()
            padded = value.new_zeros((n8,) + tuple(value.shape[1:]))
            padded[:N] = value
            names.append(ir.register_constant(gm, f"{t.target}_pad{n8}", padded))
        with g.inserting_before(lin):
            wn = g.get_attr(names[0])
            bn = g.get_attr(names[1]) if names[1] is not None else None
            new = g.call_function(aten.linear.default, (x, wn, bn))
            sl = g.call_function(aten.slice.Tensor, (new, len(ir.info(lin).shape) - 1, 0, N))
        set_meta(gm, [wn] + ([bn] if bn is not None else []) + [new, sl])
        lin.replace_all_uses_with(sl)
        g.erase_node(lin)
        for v in dict.fromkeys(returned):  # the caller gets the contiguous layout the projection gave it
            with g.inserting_before(output):
                c = g.call_function(aten.clone.default, (v if v is not lin else sl,),
                                    {"memory_format": torch.contiguous_format})
            set_meta(gm, [c])
            output.replace_input_with(v if v is not lin else sl, c)
        ir.erase_dead(gm, [t for t in (w, b) if t is not None and not t.users])
        return True
