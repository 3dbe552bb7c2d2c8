"""align_gemm: give 16-bit GEMMs rows that are 16-byte aligned where a constant operand can.

cuBLAS's tensor-core kernels want every matrix's rows 16-byte aligned (a leading dimension of 8
elements' multiple); a GEMM with a row of odd length runs an align1 fallback kernel, and one whose rows
are only 4- or 8-byte aligned (K = 196, an MLP-Mixer's tokens) a slower kernel too (the profile's
measured ``gemm_align1`` and ``gemm_align_partial``; cost.model.gemm_row_alignment). Two rewrites,
each on constants (inference), each where the cost model predicts a gain:

- **A projection's features.** A projection whose N is not a multiple of 8: the weight's rows and the
  bias are padded with zeros once, at optimization time, to N rounded up to 8; the linear writes
  ``[..., N8]`` and the graph reads ``slice(out, -1, 0, N)``: the same values, rows N8 apart in
  memory. Readers that take strided rows (pointwise ops and reductions, reached through views) read
  the slice as it is; any other reader is priced as making its own copy, and a value returned to the
  caller is copied to the contiguous layout it had. One whose input rows are not 8 elements' multiple
  apart: the input is copied into rows of K rounded up to 8 (``constant_pad_nd``, zeros), the weight's
  columns padded with zeros to match; priced with that copy, so it is taken where the GEMM gains more.
- **A constant's rows.** A constant matrix a GEMM reads (through views: a weight expanded over a
  batch, transposed) whose rows are not 16-byte aligned is stored with its rows a multiple of 8
  elements apart: the same shape and values, only the stride between rows changes, so every reader
  computes what it did.

Refused, with the reason: training graphs (the weights are parameters), a weight or bias computed in
the graph, a ``view`` or any reader other than a GEMM or a strided-input op reaching the strides,
symbolic row lengths (a symbolic batch is fine: alignment does not depend on it), and where the cost
model predicts no gain (a profile without the alignment measurements prices every GEMM alike,
so nothing is padded).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import gemm_alignment_key, projection_input_ld
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
# the GEMMs cost.model.gemm_row_alignment prices (they read an operand's rows at any stride)
_GEMMS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_HALF = (torch.float16, torch.bfloat16)


def _readers(lin: fx.Node, limit: int = 512):
    """([(value, reader)] the projection's result reaches through views, [the views], "") or
    ([], [], why not)."""
    leaves, views, stack = [], [], [lin]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and u.target in STRIDE_READERS:
                return [], [], f"{u.name} ({ir.target_name(u)}) reads the strides of the result"
            if u.op == "call_function" and u.target in _VIEWS and u.args and u.args[0] is n:
                if u not in views:
                    views.append(u)
                    stack.append(u)
                    if len(views) > limit:
                        return [], [], f"more than {limit} views of the result to follow"
                continue
            leaves.append((n, u))
    return leaves, views, ""


def _constant_source(n: fx.Node):
    """The get_attr constant ``n`` views (through _VIEWS of the first argument), or None."""
    while n.op == "call_function" and n.target in _VIEWS and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n if n.op == "get_attr" else None


def _padded_strides(shape, c8) -> tuple:
    """Row-major strides of ``shape`` whose last dim is stored ``c8`` wide."""
    strides, step = [], 1
    for i, d in enumerate(reversed(shape)):
        strides.append(step)
        step *= c8 if i == 0 else d
    return tuple(reversed(strides))


def _strided_ok(reader: fx.Node) -> bool:
    return reader.op == "call_function" and (
        reader.target in _STRIDED_OK or torch.Tag.pointwise in getattr(reader.target, "tags", ())
        or (ir.op_namespace(reader) == "graphopt" and ir.op_name(reader) == "fused_pointwise"))


@register
class AlignGemm(Pass):
    name = "align_gemm"
    family = "lower"
    description = ("pad a 16-bit projection's constant weight to a multiple of 8 output rows (read a slice of its "
                   "output) or input columns (its input copied into padded rows), or store a constant GEMM operand's "
                   "rows a multiple of 8 elements apart")
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        unaligned = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _GEMMS
                     and gemm_alignment_key(n) is not None]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        # (aten's GEMMs on padded constants: no kernel of ours, so any device may take them)
        self._rank(res, ctx, [(f"linear {n.name}", n) for n in unaligned if n.target is aten.linear.default],
                   lambda lin: self._candidate(gm, ctx, lin, output))
        live = set(gm.graph.nodes)
        constants: dict = {}
        for n in unaligned:
            if n not in live or gemm_alignment_key(n) is None:
                continue  # padded above, or aligned since
            for a in n.all_input_nodes:
                c = _constant_source(a)
                if c is not None and len(getattr(ir.info(c), "shape", ())) >= 2:  # a matrix, not a bias
                    constants.setdefault(c, n)
        self._rank(res, ctx, [(f"{c.target} (read by {gemm.name})", c) for c, gemm in constants.items()],
                   lambda c: self._rows_candidate(gm, ctx, c, output))
        return res

    @staticmethod
    def _rank(res, ctx, items, make):
        """Each (label, node)'s candidate from ``make(node)`` -> (why not, Candidate); the refused
        reported, the rest applied best first."""
        candidates = []
        for label, n in items:
            why, c = make(n)
            if why:
                res.reject(label, why)
            else:
                candidates.append(c)
        res.apply_ranked(ctx, candidates)

    def _rows_candidate(self, gm, ctx, c, output):
        ti = ir.info(c)
        if ti is None or len(ti.shape) < 2 or ti.dtype not in _HALF:
            return "not a 16-bit matrix", None
        if not all(isinstance(d, int) for d in ti.shape) or not ir.is_contiguous(ti):
            return "its sizes are symbolic or its rows already strided", None
        cols = ti.shape[-1]
        if cols % 8 == 0:
            return f"its rows ({cols}) are already a multiple of 8 long: another operand is not aligned", None
        leaves, views, why = _readers(c)
        if why:
            return why, None
        for _, u in leaves:
            if u is output:
                return "it is returned to the caller", None
            if not (u.op == "call_function" and u.target in _GEMMS) and not _strided_ok(u):
                return f"{u.name} ({ir.target_name(u)}) reads it and may want rows in memory", None
        c8 = -(-cols // 8) * 8
        stride = _padded_strides(ti.shape, c8)
        readers = list(dict.fromkeys(u for _, u in leaves))
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        r = ctx.replacement()
        new = {c: r.tensor(ti.shape, ti.dtype, ti.device, stride=stride)}
        for n in sorted(views + readers, key=order.__getitem__):
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: new.get(a, a))
            new[n] = r.call(n.target, *args, **kwargs)
        gain = ctx.node_time(views + readers) - r.time()
        added = (c8 - cols) * (ti.numel // cols) * ti.dtype.itemsize
        return "", Candidate(f"rows of {cols} stored {c8} apart", [c, *readers], gain,
                             lambda: self._apply_rows(gm, c, c8, views, readers),
                             label=f"{c.target} (rows {cols} -> {c8} apart)", constant_bytes=added)

    @staticmethod
    def _apply_rows(gm, c, c8, views, readers):
        g = gm.graph
        value = ir.get_attr_value(gm, c.target).detach()
        cols = value.shape[-1]
        padded = value.new_zeros(tuple(value.shape[:-1]) + (c8,))[..., :cols]
        padded.copy_(value)
        name = ir.register_constant(gm, f"{c.target}_rows{c8}", padded)
        with g.inserting_before(c):
            new = g.get_attr(name)
        c.replace_all_uses_with(new)
        order = {n: i for i, n in enumerate(g.nodes)}
        set_meta(gm, [new] + sorted(views + readers, key=order.__getitem__))
        ir.erase_dead(gm, [c])
        return new

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
        xi = ir.info(x) if isinstance(x, fx.Node) else None
        if xi is None or xi.dtype not in _HALF:
            return "its input has no 16-bit tensor metadata", None
        # an input whose rows are not 8 elements' multiple apart is copied into zero-padded rows
        k8 = K if projection_input_ld(xi) % 8 == 0 else -(-K // 8) * 8
        n8 = -(-N // 8) * 8
        if (k8, n8) == (K, N):
            return "its input and output rows are aligned: another operand is not", None
        leaves, _, why = _readers(lin) if n8 != N else ([], [], "")
        if why:
            return why, None
        r = ctx.replacement()
        wi = ir.info(w)
        wp = r.tensor((n8, k8), wi.dtype, wi.device) if (n8, k8) != (N, K) else w
        bp = r.tensor((n8,), ir.info(b).dtype, ir.info(b).device) if b is not None and n8 != N else b
        xp = r.call(aten.constant_pad_nd.default, x, [0, k8 - K], 0.0) if k8 != K else x
        out = r.call(aten.linear.default, xp, wp, bp)
        if n8 != N:
            r.call(aten.slice.Tensor, out, len(ir.info(lin).shape) - 1, 0, N)
        copies = [v for v, u in leaves if not _strided_ok(u)]
        for v in dict.fromkeys(copies):  # what a reader that wants rows in memory copies (a returned value too)
            r.call(aten.clone.default, v, memory_format=torch.contiguous_format)
        gain = ctx.node_time([lin]) - r.time()
        itemsize = wi.dtype.itemsize
        added = n8 * k8 * itemsize + (n8 * ir.info(b).dtype.itemsize if b is not None and n8 != N else 0)
        returned = [v for v, u in leaves if u is output]
        what = " and ".join(f"{d}={v} padded to {v8}" for d, v, v8 in (("K", K, k8), ("N", N, n8)) if v != v8)
        return "", Candidate(what, [lin], gain,
                             lambda: self._apply(gm, lin, x, w, b, (N, K), (n8, k8), returned, output),
                             label=f"linear {lin.name} ({what})", constant_bytes=added)

    @staticmethod
    def _apply(gm, lin, x, w, b, size, padded_size, returned, output):
        g = gm.graph
        (N, K), (n8, k8) = size, padded_size
        names = [None, None]
        if (n8, k8) != (N, K):
            value = ir.get_attr_value(gm, w.target).detach()
            pw = value.new_zeros((n8, k8))
            pw[:N, :K] = value
            names[0] = ir.register_constant(gm, f"{w.target}_pad{n8}x{k8}", pw)
        if b is not None and n8 != N:
            value = ir.get_attr_value(gm, b.target).detach()
            pb = value.new_zeros((n8,))
            pb[:N] = value
            names[1] = ir.register_constant(gm, f"{b.target}_pad{n8}", pb)
        new_nodes = []
        with g.inserting_before(lin):
            wn = g.get_attr(names[0]) if names[0] is not None else w
            bn = g.get_attr(names[1]) if names[1] is not None else b
            new_nodes += [n for n in (wn, bn) if n is not None and n is not w and n is not b]
            xp = x
            if k8 != K:
                xp = g.call_function(aten.constant_pad_nd.default, (x, [0, k8 - K], 0.0))
                new_nodes.append(xp)
            new = g.call_function(aten.linear.default, (xp, wn, bn))
            new_nodes.append(new)
            res = new
            if n8 != N:
                res = g.call_function(aten.slice.Tensor, (new, len(ir.info(lin).shape) - 1, 0, N))
                new_nodes.append(res)
        set_meta(gm, new_nodes)
        lin.replace_all_uses_with(res)
        g.erase_node(lin)
        for v in dict.fromkeys(returned):  # the caller gets the contiguous layout the projection gave it
            with g.inserting_before(output):
                c = g.call_function(aten.clone.default, (v if v is not lin else res,),
                                    {"memory_format": torch.contiguous_format})
            set_meta(gm, [c])
            output.replace_input_with(v if v is not lin else res, c)
        ir.erase_dead(gm, [t for t in (w, b) if t is not None and not t.users])
        return True
