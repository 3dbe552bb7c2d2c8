"""fuse_gemv_swiglu: a SwiGLU MLP's gate and up projections of at most 16 rows (a decode step's
tokens) and ``silu(gate) * up`` -> ``graphopt::gemv_swiglu``, one weight stream whose kernel applies
the activation, where the profile's measurements say it is faster.

Two spellings, both matched before merge_sibling_linears and fuse_swiglu see them:

* ``silu(linear(x, Wg)) * linear(x, Wu)`` (Llama, Qwen2, Mistral): the two weights are passed as
  they are, so, unlike merging them for one cuBLAS call, no concatenated copy of the weights is
  made (no weight-copy budget is spent);
* ``gate, up = linear(x, W).chunk(2, -1)`` (or split/slices of the last dim; GLM-4's merged
  gate_up_proj) with ``silu(gate) * up``: W passed whole.

Legality: inference; no bias; x fp16/bf16 with at most ``MAX_M`` rows (static) and the weights of
its dtype on its device; gate and up of one shape, the product neither broadcasting nor promoting;
the projections, their pieces and the silu read by nothing else (the kernel produces none of them).

Profitability: priced by the cost model (the op at the profile's ``op_efficiency["gemv"]``, the
linears at ``["small_m_linear"]``, both measured by ``benchmarks/diag/diag_decode_gemm.py``) against
the nodes it replaces; under ``lower_gemv.MIN_GAIN`` of their time it is not applied on that guess.
Where ``gemv`` is not measured on the device, nothing is applied. On a CPU profile every candidate is
refused (NO_FUSED_KERNELS). A model still in fp32 here (bf16 only after assign_precision) is
refused with its dtype: merge_sibling_linears and fuse_swiglu then take the MLP as before.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Op, find, get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from .fuse_swiglu import piece
from .lower_gemv import MIN_GAIN

aten = torch.ops.aten
PATTERN = Op(aten.mul.Tensor, Op(aten.silu.default, Any("gate"), name="silu", single_use=False), Any("up"),
             name="mul", commutative=True)


def _linear(n) -> fx.Node | None:
    return n if isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.linear.default else None


@register
class FuseGemvSwiglu(Pass):
    name = "fuse_gemv_swiglu"
    family = "fusion"
    description = "gate/up projections of <= 16 rows + silu(gate) * up -> graphopt::gemv_swiglu, where measured faster"
    inference_only = True  # graphopt's kernels have no autograd formulas

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        found = [((m, ops), f"{m['silu'].name} * {getattr(m['up'], 'name', m['up'])}")
                 for m in find(gm, PATTERN) if (ops := self._operands(m)) is not None]
        res.consider(ctx, found, lambda found, label: self._candidate(ctx, *found, label))
        return res

    @staticmethod
    def _operands(m):
        """(x, weight, up_weight or None, the projections, the nodes between them and the silu/mul,
        the gate's and the up's column ranges of a merged projection or None) when gate and up are
        projections of one x (two linears, or two pieces of one), else None: not this pass's pattern."""
        g, u = _linear(m["gate"]), _linear(m["up"])
        if g is not None and u is not None:
            if g.args[0] is not u.args[0] or g is u:
                return None
            return g.args[0], g.args[1], u.args[1], [g, u], [g, u], None
        pg, pu = piece(m["gate"]), piece(m["up"])
        if isinstance(pg, str) or isinstance(pu, str) or pg[0] is not pu[0] or _linear(pg[0]) is None:
            return None
        base = pg[0]
        inner = [m["gate"], m["up"]]
        inner += [p.args[0] for p in inner if isinstance(p.args[0], fx.Node) and p.args[0] is not base]
        return base.args[0], base.args[1], None, [base], [base, *dict.fromkeys(inner)], (pg[1:], pu[1:])

    def _candidate(self, ctx, m, operands, label):
        from graphopt.cuda_ext.gemv_triton import DTYPES, MAX_M

        x, w, uw, lins, between, ranges = operands
        silu, mul = m["silu"], m["mul"]
        if any(get_arg(n, 2, "bias") is not None for n in lins):
            return "a projection has a bias (the kernel adds none)", None
        if any(not isinstance(a, fx.Node) or ir.info(a) is None for a in (x, w, uw) if a is not None):
            return "an operand is not a tensor with metadata", None
        xi, wi, ui = ir.info(x), ir.info(w), ir.info(uw) if uw is not None else None
        try:
            M = int(math.prod(xi.shape[:-1]))
        except TypeError:
            return "x's rows are symbolic", None
        if not 0 < M <= MAX_M:
            return f"{M} rows of x: graphopt::gemv_swiglu takes at most {MAX_M} (a decode step's tokens)", None
        if len(wi.shape) != 2 or (ui is not None and tuple(ui.shape) != tuple(wi.shape)):
            return "gate and up weights are not two [n, K] matrices of one shape", None
        if ranges is not None and ranges != ((0, wi.shape[0] // 2), (wi.shape[0] // 2, wi.shape[0])):
            (g0, g1), (u0, u1) = ranges
            return (f"gate is [{g0}, {g1}) and up [{u0}, {u1}) of {wi.shape[0]} columns: the kernel needs the "
                    "first and the second half"), None
        dtypes = {i.dtype for i in (xi, wi, ui) if i is not None}
        if len(dtypes) != 1 or xi.dtype not in DTYPES:
            return f"dtypes {sorted(map(str, dtypes))}: fp16 or bf16, one dtype", None
        n = wi.shape[0] if ui is not None else wi.shape[0] // 2
        oi = ir.info(mul)
        if oi is None or tuple(oi.shape) != tuple(xi.shape[:-1]) + (n,) or oi.dtype != xi.dtype \
                or ir.info(silu).dtype != xi.dtype:
            return "the product broadcasts or promotes (its shape or dtype is not the projections')", None
        inside = set(between) | {silu}
        for node in inside:
            if any(user not in inside and user is not mul for user in node.users):
                return f"{node.name} is also read elsewhere; gemv_swiglu does not produce it", None
        if not ctx.cost.measured("gemv"):
            return ("graphopt::gemv is not measured on this device (op_efficiency 'gemv', "
                    "benchmarks/diag/diag_decode_gemm.py): its kernel is not chosen on a guess"), None
        nbytes = wi.nbytes * (2 if ui is not None else 1)
        if not ctx.cost.fit_covers("gemv", nbytes):
            return (f"{nbytes / 1e6:.1f} MB of weights: below the sizes graphopt::gemv was measured at on this "
                    "device (op_efficiency 'gemv' min_bytes), its price there a guess"), None
        new = ctx.price(torch.ops.graphopt.gemv_swiglu.default, x, w, uw, val=mul.meta.get("val"))
        old = ctx.node_time([*inside, mul])
        K = wi.shape[1]
        if new >= old * (1 - MIN_GAIN):
            return (f"predicted {new * 1e6:.1f} us against {old * 1e6:.1f} us for the projections and the "
                    f"activation, not {MIN_GAIN:.0%} faster (op_efficiency 'gemv', measured by "
                    "benchmarks/diag/diag_decode_gemm.py, prices it)"), None
        form = "two weights" if ui is not None else "merged weight"
        return "", Candidate(f"gate/up {M}x{n}x{K} ({form}) + swiglu -> gemv_swiglu", [*inside, mul], old - new,
                             lambda: self._apply(m, x, w, uw, [*inside, mul]), label=label)

    @staticmethod
    def _apply(m, x, w, uw, replaced):
        mul = m["mul"]
        g = mul.graph
        with g.inserting_before(mul):
            new = g.call_function(torch.ops.graphopt.gemv_swiglu.default, (x, w, uw))
        new.meta["val"] = mul.meta.get("val")
        mul.replace_all_uses_with(new)
        ir.erase_dead(mul.graph.owning_module, replaced)
        return new
