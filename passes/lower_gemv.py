"""lower_gemv: a projection of at most 16 rows (a decode step's tokens) -> ``graphopt::gemv``, the
split-K Triton GEMV (cuda_ext/gemv_triton.py), where the profile's measurements say it is faster
than cuBLAS.

Legality: ``aten.linear(x, W, b)`` in an inference graph with x ``[..., K]`` of at most
``MAX_M`` rows (static), W ``[N, K]``, b ``[N]`` or none, all fp16/bf16 of one dtype on one device.

Profitability: the op priced by the cost model at the profile's ``op_efficiency["gemv"]``
against the linear at ``op_efficiency["small_m_linear"]`` (cuBLAS at the same M), both fitted by
``benchmarks/diag/diag_decode_gemm.py`` on the device. Without a ``gemv`` entry the op prices
itself as cuBLAS plus its partial sums, so nothing is lowered on a guess. On a CPU profile every
candidate is refused (NO_FUSED_KERNELS).

With the norm after it: a linear whose only user is ``graphopt::add_rms_norm`` (as its x or its
residual; the add is the same either way in one dtype) becomes ``graphopt::gemv_add_rms_norm``,
whose partial-sum kernel also adds the residual and normalizes the row: the norm's launch is
gone. A linear whose only user is ``graphopt::rms_norm_add_rms_norm`` as its normalized input (a
sandwich norm, GLM-4's) folds the same way, the first norm passed as ``pre_weight``. Priced against the linear (cuBLAS) and the norm apart; where it does not pay, the linear
alone is considered as above.

The fits price within a few percent of the measurements they were fitted to (the profile's source
says how well), so a rewrite whose predicted gain is under ``MIN_GAIN`` of the time it replaces is
not applied on that guess (on the H200 a merged gate/up projection is such: cuBLAS and the GEMV
measure within a few percent there).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register


aten = torch.ops.aten
MIN_GAIN = 0.05  # of the replaced nodes' predicted time: below it the fits' error decides, not the device


def _few_rows(n: fx.Node) -> bool:
    """The linear's x has at most MAX_M rows (static): the projections this pass is about."""
    from graphopt.cuda_ext.gemv_triton import MAX_M

    xi = ir.info(n.args[0]) if isinstance(n.args[0], fx.Node) else None
    try:
        return xi is not None and 0 < int(math.prod(xi.shape[:-1])) <= MAX_M
    except TypeError:
        return False


@register
class LowerGemv(Pass):
    name = "lower_gemv"
    family = "lower"
    description = "linear of <= 16 rows (decode) -> graphopt::gemv (split-K Triton GEMV), where measured faster"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        linears = [(n, n.name) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is aten.linear.default and _few_rows(n)]
        res.consider(ctx, linears, lambda n, label: self._candidate(gm, ctx, n))
        return res

    def _candidate(self, gm, ctx, n):
        from graphopt.cuda_ext.gemv_triton import DTYPES

        x, w = n.args[0], n.args[1]
        b = get_arg(n, 2, "bias")
        infos = [ir.info(a) if isinstance(a, fx.Node) else None for a in (x, w)]
        if any(i is None for i in infos) or (b is not None and not isinstance(b, fx.Node)):
            return "an operand is not a tensor with metadata", None
        xi, wi = infos
        if len(wi.shape) != 2:
            return f"the weight is {len(wi.shape)}-D", None
        M = int(math.prod(xi.shape[:-1]))  # static and <= MAX_M (_few_rows)
        dtypes = {xi.dtype, wi.dtype} | ({ir.info(b).dtype} if b is not None else set())
        if len(dtypes) != 1 or xi.dtype not in DTYPES:
            return f"dtypes {sorted(map(str, dtypes))}: fp16 or bf16, one dtype", None
        if not ctx.cost.fit_covers("gemv", wi.nbytes):
            return (f"a {wi.nbytes / 1e6:.1f} MB weight: below the sizes graphopt::gemv was measured at on this "
                    "device (op_efficiency 'gemv' min_bytes), its price there a guess"), None
        why_not_fused, fused = self._with_norm(ctx, n, x, w, b, xi.dtype)
        if fused is not None:
            return "", fused
        new = ctx.price(torch.ops.graphopt.gemv.default, x, w, b, val=n.meta["val"])
        old = ctx.node_time([n])
        N, K = wi.shape
        if new >= old * (1 - MIN_GAIN):
            return (f"{why_not_fused}predicted {new * 1e6:.1f} us against cuBLAS's {old * 1e6:.1f} us, not "
                    f"{MIN_GAIN:.0%} faster (op_efficiency 'gemv' measured by benchmarks/diag/diag_decode_gemm.py "
                    "prices it; unmeasured it is priced as cuBLAS plus its partial sums)"), None
        return "", Candidate(f"linear {M}x{N}x{K} -> gemv", [n], old - new, lambda: self._apply(n, x, w, b),
                             label=f"{n.name} ({M}x{N}x{K})")

    def _with_norm(self, ctx, n, x, w, b, dtype):
        """("", the candidate) folding the add_rms_norm that alone reads this linear into the
        GEMV's second kernel; ("why not; ", None) when such a norm follows but the fold is illegal
        or not priced faster; ("", None) when no norm follows."""
        users = list(n.users)
        u = users[0] if len(users) == 1 else None
        pre = ()  # a sandwich norm's first norm: (its weight, its eps)
        if u is not None and u.op == "call_function" and u.target is torch.ops.graphopt.rms_norm_add_rms_norm.default:
            y, residual, pw, nw, pre_eps, eps = (list(u.args) + [None] * 6)[:6]
            if y is not n:
                return "", None  # the linear is the residual: it is not normalized first
            pi = ir.info(pw) if isinstance(pw, fx.Node) else None
            if pi is None or pi.dtype != dtype or not isinstance(pre_eps, float):
                return f"with {u.name}: its first norm's weight is not a {dtype} tensor; ", None
            pre = (pw, pre_eps)
        elif u is None or u.op != "call_function" or u.target is not torch.ops.graphopt.add_rms_norm.default:
            return "", None
        else:
            y, residual, nw, eps = (list(u.args) + [None] * 4)[:4]
            if y is not n:
                y, residual = residual, y  # the linear is the residual: the add is the same sum
        yi = ir.info(n)
        ri = ir.info(residual) if isinstance(residual, fx.Node) else None
        ni = ir.info(nw) if isinstance(nw, fx.Node) else None
        if residual is not None and (ri is None or tuple(ri.shape) != tuple(yi.shape) or ri.dtype != dtype):
            return f"with {u.name}: its residual is not a {dtype} tensor of the linear's shape; ", None
        if ni is None or ni.dtype != dtype or not isinstance(eps, float):
            return f"with {u.name}: its weight is not a {dtype} tensor; ", None
        if not ctx.cost.measured("gemv"):
            return (f"with {u.name}: graphopt::gemv is not measured on this device (op_efficiency 'gemv', "
                    "benchmarks/diag/diag_decode_gemm.py); "), None
        op = torch.ops.graphopt.gemv_add_rms_norm.default
        new = ctx.price(op, x, w, b, residual, nw, eps, *pre, val=u.meta["val"])
        old = ctx.node_time([n, u])
        if new >= old * (1 - MIN_GAIN):
            return (f"with {u.name}: predicted {new * 1e6:.1f} us against {old * 1e6:.1f} us apart, not "
                    f"{MIN_GAIN:.0%} faster; "), None
        N, K = ir.info(w).shape
        M = int(math.prod(yi.shape[:-1]))
        norm = ir.op_name(u)
        return "", Candidate(f"linear {M}x{N}x{K} + {norm} -> gemv_add_rms_norm", [n, u], old - new,
                             lambda: self._apply_norm(n, u, x, w, b, residual, nw, eps, pre),
                             label=f"{n.name} + {u.name} ({M}x{N}x{K})")

    @staticmethod
    def _apply_norm(n, u, x, w, b, residual, nw, eps, pre=()):
        g = n.graph
        with g.inserting_before(u):
            new = g.call_function(torch.ops.graphopt.gemv_add_rms_norm.default, (x, w, b, residual, nw, eps, *pre))
        new.meta["val"] = u.meta.get("val")
        u.replace_all_uses_with(new)
        g.erase_node(u)
        g.erase_node(n)
        return new

    @staticmethod
    def _apply(n, x, w, b):
        g = n.graph
        with g.inserting_before(n):
            new = g.call_function(torch.ops.graphopt.gemv.default, (x, w, b))
        new.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(new)
        g.erase_node(n)
        return new
