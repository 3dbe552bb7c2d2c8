"""assign_precision: a dtype per node — bf16 (fp16 before Ampere) where it pays, fp32 where it
matters — proven against an fp64 reference.

Rules (the ``precision`` option: "auto", "bf16", "fp16" or "fp32"):
- compute-heavy ops (linear, matmul, bmm, conv, SDPA) and the elementwise ops and norms around
  them run in the low dtype; parameters are converted once at optimization time (inference) or
  cast in the graph so gradients reach the fp32 master weights (training);
- sensitive ops — softmax/log_softmax, reductions (mean, sum, var: the statistics of norms),
  exp/log/pow/rsqrt, cumsum, losses — compute in fp32; explicit casts and creation ops keep the
  dtype the model wrote; views follow their input; a softmax whose every reader casts its result
  back to the low dtype reads and writes the low dtype (aten accumulates it in fp32 and rounds once:
  bit for bit the fp32 softmax cast down, without the fp32 probabilities' traffic);
- casts go only at boundaries (each value cast once per dtype, before its first reader), lossless
  round trips (low → fp32 → low) are removed, outputs come back in the caller's dtype;
- integer, bool and complex tensors are never cast; a model that already computes in a low dtype
  is left as it is.
The cost model must predict a gain (on a CPU, bf16 matmuls may be slower than fp32). Then the
accuracy rule (bf16/fp16 tolerance, the hand-converted model as yardstick) is applied on the
example inputs and calibration batches; while it fails, bisection over the topological order
finds the first node whose conversion breaks it and keeps it in fp32.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import copy

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import ATTENTION_OPS, CONV_OPS, MATMUL_OPS, VIEW_OPS
from graphopt.cuda_ext.pointwise import DTYPE_NAMES as POINTWISE_DTYPE_NAMES
from graphopt.cuda_ext.pointwise import parse as parse_pointwise
from graphopt.errors import GraphoptError
from graphopt.pipeline import Pass, PassContext, PassResult, register

aten = torch.ops.aten

SENSITIVE = {
    "softmax", "_softmax", "log_softmax", "_log_softmax", "mean", "sum", "var", "var_mean", "std", "std_mean",
    "pow", "exp", "exp2", "log", "log1p", "log2", "expm1", "rsqrt", "sqrt", "reciprocal", "cumsum", "cumprod",
    "logsumexp", "norm", "linalg_vector_norm", "cross_entropy_loss", "nll_loss", "nll_loss_forward",
    "mse_loss", "l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "prod",
    "erfinv", "lgamma", "digamma",
}
# ops whose output dtype is written in the model (casts, creation): left as they are
PINNED = {
    "_to_copy", "to", "type_as", "arange", "full", "zeros", "ones", "empty", "scalar_tensor", "full_like",
    "zeros_like", "ones_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty", "rand", "randn",
    "rand_like", "randn_like", "linspace", "eye", "tensor", "lift_fresh_copy", "_assert_tensor_metadata",
}
COMPUTE_HEAVY = MATMUL_OPS | CONV_OPS | ATTENTION_OPS | {"conv_bias_relu"}  # and graphopt's fused convolution
MAX_OFFENDERS = 12
MAX_CHECKS = 48  # accuracy checks (each a forward pass) the search may spend
FP32 = torch.float32


def _is_float32(v) -> bool:
    return isinstance(v, fx.Node) and ir.info(v) is not None and ir.info(v).dtype == FP32


@register
class AssignPrecision(Pass):
    name = "assign_precision"
    family = "precision"
    description = "run compute in bf16/fp16 where it pays, sensitive ops in fp32, guarded against fp64"
    changes_dtypes = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        request = ctx.options.precision
        if request == "fp32":
            res.notes.append("precision='fp32': dtypes left as the model has them")
            return res
        low, why = _choose_dtype(request, ctx)
        if low is None:
            res.reject("lower precision", why)
            return res
        fp32_work = [n for n in gm.graph.nodes if n.op == "call_function" and _is_float32(n)
                     and ir.op_name(n) in COMPUTE_HEAVY]
        if not fp32_work:
            dtypes = sorted({str(ir.info(n).dtype).replace("torch.", "") for n in gm.graph.nodes
                             if n.op == "call_function" and ir.op_name(n) in COMPUTE_HEAVY and ir.info(n) is not None})
            res.notes.append(f"the model already computes in {', '.join(dtypes) or 'no float dtype'}; left as it is")
            return res
        if ctx.training and low == torch.float16:
            res.notes.append("fp16 training needs loss scaling: use torch.amp.GradScaler (examples/train_mlp.py shows one)")

        base = copy.deepcopy(gm.graph)
        before_s = ctx.cost.graph_cost(gm, ctx.hints).total_s
        consts: dict = {}
        order = _lower(gm, low, set(), ctx.training, consts, ctx.constants)
        after_s = ctx.cost.graph_cost(gm, ctx.hints).total_s
        if after_s >= before_s and request == "auto":
            _restore(gm, base)
            res.reject(f"{str(low)[6:]} for {len(order)} nodes",
                       f"predicted no gain on {ctx.cost.device_name}: {before_s * 1e3:.3f} ms in fp32 vs "
                       f"{after_s * 1e3:.3f} ms")
            return res

        kept: list[dict] = []
        guard = ctx.accuracy_check
        if guard is not None:
            forced: set = set()
            result = guard(gm, low)
            checks = [1]
            while not result.passed and len(kept) < MAX_OFFENDERS and checks[0] < MAX_CHECKS:
                candidates = [n for n in order if n not in forced]

                def fails(prefix_len: int) -> bool:
                    checks[0] += 1
                    _restore(gm, base)
                    _lower(gm, low, forced | set(candidates[prefix_len:]), ctx.training, consts, ctx.constants)
                    return not guard(gm, low).passed

                lo, hi = 1, len(candidates)
                while lo < hi:  # smallest prefix whose conversion breaks the rule
                    mid = (lo + hi) // 2
                    if fails(mid):
                        hi = mid
                    else:
                        lo = mid + 1
                offender = candidates[lo - 1]
                forced.add(offender)
                kept.append({"node": offender, "reason": f"accuracy rule fails when it runs in {str(low)[6:]}",
                             "error": result.reason})
                _restore(gm, base)
                _lower(gm, low, forced, ctx.training, consts, ctx.constants)
                result = guard(gm, low)
            if not result.passed:
                _restore(gm, base)
                res.reject(f"{str(low)[6:]} assignment", f"still fails the accuracy rule after keeping {len(kept)} "
                                                         f"nodes in fp32 and {checks[0]} checks ({result.reason}); "
                                                         "model left in fp32")
                return res
            if hasattr(guard, "hand_converted_result"):
                lo = str(low)[6:]
                hand = guard.hand_converted_result(low)
                strict_ok, _ = guard.strict_result(gm, low)
                res.details.update({"hand_converted_passes": hand["passes"], "hand_converted_rmse": hand["rmse"],
                                    "hand_converted_passes_strict": hand["passes_strict"],
                                    "matmul_floor_rmse": hand["matmul_floor_rmse"], "rmse": result.worst_rmse,
                                    "passes_strict": strict_ok})
                hand_txt = (f"{hand['rmse']:.3g} ({'passes' if hand['passes'] else 'fails'} the same rule)"
                            if hand["rmse"] is not None else f"does not run ({hand.get('error')})")
                if hand.get("error"):
                    res.details["hand_converted_error"] = hand["error"]
                res.notes.append(f"rmse vs fp64: this assignment {result.worst_rmse:.3g}, {lo} matmuls alone (the "
                                 f"yardstick) {hand['matmul_floor_rmse']:.3g}, the model hand-converted to {lo} "
                                 f"{hand_txt}")
                res.notes.append(f"against the fp32 model as the yardstick (the strict bar) this assignment "
                                 f"{'passes' if strict_ok else 'fails'}, the hand-converted model "
                                 f"{'passes' if hand['passes_strict'] else 'fails'}")
        ctx.low_precision = low
        lowered = [n for n in order if n not in {k["node"] for k in kept}]
        gain = before_s - ctx.cost.graph_cost(gm, ctx.hints).total_s
        res.record(f"{str(low)[6:]} compute", lowered, [f"{len(lowered)} nodes in {str(low)[6:]}"], gain)
        for k in kept:
            res.reject(k["node"], f"kept in fp32: {k['reason']} ({k['error']})")
        refused = consts.get("refused", {})
        if refused:
            res.reject(f"{len(refused)} weight(s) stored in {str(low)[6:]}",
                       f"{next(iter(refused.values()))}; cast in the graph at each call instead")
        res.details.update({"dtype": str(low).replace("torch.", ""), "kept_fp32": kept, **_shares(gm, ctx)})
        sh = res.details
        res.notes.append("share in " + str(low)[6:] + f": {sh['flops_share'].get(str(low)[6:], 0):.0%} of FLOPs, "
                         f"{sh['bytes_share'].get(str(low)[6:], 0):.0%} of bytes")
        return res


def _choose_dtype(request: str, ctx: PassContext):
    cost = ctx.cost
    device = ctx.device
    if request in ("bf16", "fp16"):
        low = torch.bfloat16 if request == "bf16" else torch.float16
        if getattr(device, "type", None) == "cuda" and low == torch.bfloat16 and torch.cuda.is_available() \
                and torch.cuda.get_device_capability(device) < (8, 0):
            raise GraphoptError("precision='bf16' needs an Ampere or newer GPU; use precision='fp16' or 'auto'")
        if low == torch.float16 and getattr(device, "type", None) == "cpu" and not _cpu_supports_fp16():
            raise GraphoptError("precision='fp16' is not supported on this CPU; use precision='bf16' or 'fp32'")
        return low, ""
    # auto
    if cost.device_kind == "cuda":
        if getattr(device, "type", None) == "cuda" and torch.cuda.is_available() \
                and torch.cuda.get_device_capability(device) < (8, 0):
            return torch.float16, ""
        return torch.bfloat16, ""
    bf, f32 = cost.matmul_rate(torch.bfloat16), cost.matmul_rate(FP32)
    if bf <= f32:
        return None, (f"bf16 matmuls measured slower than fp32 on this CPU ({bf / 1e9:.0f} vs {f32 / 1e9:.0f} "
                      "GFLOP/s); pass precision='bf16' to force it")
    if cost.device_kind == "cpu":
        # the profile measures matmuls only; bf16 convolutions and elementwise kernels are often
        # much slower than fp32 on CPUs without AMX, so "auto" does not bet on them
        return None, (f"on the CPU, auto keeps fp32 (bf16 matmul {bf / 1e9:.0f} vs fp32 {f32 / 1e9:.0f} GFLOP/s "
                      "measured, other bf16 kernels not); pass precision='bf16' to force it")
    return torch.bfloat16, ""


def _cpu_supports_fp16() -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.float16)
        torch.mm(a, a)
        return True
    except RuntimeError:
        return False


# single-tensor views whose values a dtype cast commutes with: cast(view(c)) == view(cast(c))
CAST_COMMUTING_VIEWS = {"view", "_unsafe_view", "reshape", "flatten", "permute", "transpose", "t", "expand",
                        "unsqueeze", "squeeze", "select", "slice", "narrow", "alias", "detach", "unflatten"}


def _cast_readers(n: fx.Node, low: torch.dtype):
    """([views], [casts]) where ``n`` is read only through CAST_COMMUTING_VIEWS by casts to ``low``
    (at least one), else None."""
    views, casts, stack = [], [], [n]
    while stack:
        v = stack.pop()
        if not v.users:
            return None  # (a view nobody reads is left to dead-code elimination, not retyped)
        for u in v.users:
            if u.op != "call_function" or not u.args or u.args[0] is not v:
                return None
            if u.target is aten._to_copy.default and u.kwargs == {"dtype": low}:
                casts.append(u)
            elif ir.op_name(u) in CAST_COMMUTING_VIEWS:
                views.append(u)
                stack.append(u)
            else:
                return None
    return (views, casts) if casts else None


def _restore(gm: fx.GraphModule, base: fx.Graph) -> None:
    gm.graph = copy.deepcopy(base)
    gm.recompile()


def _lower(gm: fx.GraphModule, low: torch.dtype, forced: set, training: bool, consts: dict, account=None) -> list[str]:
    """Rewrite gm in place: low-precision compute except ``forced`` node names. Returns the names
    of the compute nodes put in the low dtype (the order bisection walks). Inference weights are
    converted once into constants (kept in ``consts`` across calls) while ``account``
    (graphopt.setup_memory.ConstantAccount) allows; beyond it, a weight is cast in the graph at each
    call and ``consts["refused"]`` says why."""
    g = gm.graph
    cur: dict = {}  # node -> dtype of its tensor output after the rewrite
    casts: dict = {}
    lowered: list[str] = []
    original_out = {}

    def dtype_of(n):
        if n in cur:
            return cur[n]
        t = ir.infos(n)
        return t[0].dtype if t else None

    def cast(arg: fx.Node, dtype, user: fx.Node) -> fx.Node:
        key = (arg, dtype)
        if key in casts:
            return casts[key]
        src, chain = arg, []  # views of a constant: cast the constant, view the cast (the same values)
        while src.op == "call_function" and ir.op_name(src) in CAST_COMMUTING_VIEWS and src.args \
                and isinstance(src.args[0], fx.Node):
            chain.append(src)
            src = src.args[0]
        if chain and src.op == "get_attr":  # (an expanded weight is not copied at its expanded size each call)
            v = cast(src, dtype, user)
            with g.inserting_before(user):
                for n in reversed(chain):
                    v = g.call_function(n.target, (v, *n.args[1:]), dict(n.kwargs))
                    cur[v] = dtype
            casts[key] = v
            return v
        refused = consts.setdefault("refused", {})
        name = None
        if arg.op == "get_attr" and not training and dtype_of(arg) == FP32 and (arg.target, dtype) not in refused:
            name = consts.get((arg.target, dtype))
            if name is None or not hasattr(gm, name):
                value = ir.get_attr_value(gm, arg.target)
                why = account.refusal(value.numel() * dtype.itemsize) if account is not None else ""
                if why:
                    refused[(arg.target, dtype)] = why
                    name = None
                else:
                    name = ir.register_constant(gm, f"{arg.target}_{str(dtype)[6:]}", value.detach().to(dtype))
                    consts[(arg.target, dtype)] = name
        if name is not None:
            with g.inserting_before(user):
                new = g.get_attr(name)
        else:
            # a cast of a cast back to the dtype it came from is the original value (lossless)
            if arg.op == "call_function" and arg.target is aten._to_copy.default and set(arg.kwargs) == {"dtype"} \
                    and isinstance(arg.args[0], fx.Node) and dtype_of(arg.args[0]) == dtype:
                casts[key] = arg.args[0]
                return arg.args[0]
            with g.inserting_before(user):
                new = g.call_function(aten._to_copy.default, (arg,), {"dtype": dtype})
        cur[new] = dtype
        casts[key] = new
        return new

    def convert_inputs(node: fx.Node, src_dtype, dst_dtype):
        def fix(a):
            if isinstance(a, fx.Node) and dtype_of(a) == src_dtype and ir.info(a) is not None:
                return cast(a, dst_dtype, node)
            return a  # (tuple-valued nodes are only read through getitem, which follows them)

        node.args = fx.node.map_arg(node.args, fix)
        node.kwargs = fx.node.map_arg(node.kwargs, fix)

    for node in list(g.nodes):
        if node.op == "output":
            continue
        if node.op != "call_function":
            continue
        outs = ir.infos(node)
        out = outs[0] if outs else None  # tuple outputs (split, fused norms) carry one dtype here
        name = ir.op_name(node)
        ins = [a for a in node.all_input_nodes if ir.infos(a)]
        if name in VIEW_OPS or name == "getitem" or name in ("reshape", "flatten", "contiguous", "clone", "detach",
                                                              "split", "chunk", "unbind", "split_with_sizes"):
            if ins and out is not None and out.dtype.is_floating_point:
                cur[node] = dtype_of(ins[0])
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            # a region export wrapped (wrap_with_set_grad_enabled / autocast: HF's rotary table
            # under transformers 5.17) is opaque here: its inputs stay as they are and its
            # outputs keep the dtypes its body gives them (the readers cast where they lower)
            continue
        if _identity_cast(node):
            # x.to(float32) of a value that is already fp32 in this (fp32) model: in the low-
            # precision graph it follows its input, as a view does. Hugging Face's norms write
            # .to(float32) ... .to(input_dtype); in an fp32 capture both read .to(float32), so
            # keeping them pinned would cast every normalized activation up and down again; the
            # sensitive statistics still compute in fp32 under the rule below.
            d = dtype_of(node.args[0])
            if d != FP32:
                if node.target is aten.to.dtype:
                    node.args = (node.args[0], d)
                else:
                    node.kwargs = {**node.kwargs, "dtype": d}
            cur[node] = d
            continue
        if name in PINNED or name == "fused_pointwise":  # a fused program carries its own dtypes
            continue
        if name in ("softmax", "log_softmax") and node.name not in forced and out is not None \
                and out.dtype == FP32 and ins and dtype_of(ins[0]) == low and len(node.args) >= 2:
            # softmax(x_low, dim, dtype=float32) reads the low-precision input and computes and
            # writes fp32: the same numbers as casting x up first, without the cast's pass
            node.args = node.args[:2]
            node.kwargs = {**node.kwargs, "dtype": FP32}
            cur[node] = FP32
            continue
        if name in SENSITIVE or node.name in forced or _scalar_overflows(node, low):
            convert_inputs(node, low, FP32)
            if out is not None and out.dtype == FP32:
                cur[node] = FP32
            continue
        floats = [a for a in ins if dtype_of(a) in (FP32, low)]
        if floats and name not in COMPUTE_HEAVY and all(dtype_of(a) == FP32 and a in cur for a in floats):
            # every float input is a statistic this pass kept in fp32 (mean + eps before rsqrt):
            # small work between sensitive ops stays with them rather than rounding in between
            continue
        had_fp32 = any(dtype_of(a) == FP32 for a in ins)
        convert_inputs(node, FP32, low)
        if out is not None and out.dtype == FP32 and (had_fp32 or any(dtype_of(a) == low for a in ins)):
            cur[node] = low
            lowered.append(node.name)
    # softmax(x_low, dtype=float32) read only through casts back to the low dtype: aten's softmax on a
    # low-precision tensor already computes in fp32 (its accumulate type) and rounds its output once,
    # so softmax(x_low) in the low dtype gives the same numbers without writing and re-reading fp32
    # probabilities (BERT's attention: 12.5% of its bytes)
    def low_readers(n):
        """The casts to ``low`` that read ``n`` (through fp32 -> fp32 ``to`` nodes that follow their
        input, Hugging Face's ``.to(input_dtype)`` in an fp32 capture), or None if anything else does."""
        found, follow = [], []
        for u in n.users:
            if u.op != "call_function" or u.args[0] is not n:
                return None
            if u.target is aten._to_copy.default and u.kwargs == {"dtype": low}:
                found.append(u)
            elif u.target is aten.to.dtype and len(u.args) == 2 and u.args[1] == FP32 and not u.kwargs:
                deeper = low_readers(u)
                if deeper is None:
                    return None
                follow.append(u)
                found += deeper
            else:
                return None
        return found + follow

    def drop_cast(u: fx.Node) -> None:
        """A cast made unneeded: its readers read its input, and it leaves the graph and the cache."""
        u.replace_all_uses_with(u.args[0])
        for key in [k for k, v in casts.items() if v is u]:
            del casts[key]
        g.erase_node(u)

    for node in list(g.nodes):
        if node.op == "call_function" and node.target is aten.softmax.int and node.kwargs.get("dtype") == FP32 \
                and node.name not in forced and node.args and dtype_of(node.args[0]) == low and node.users:
            readers = low_readers(node)
            if not readers:
                continue
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
            cur[node] = low
            for u in readers:
                if u.target is aten.to.dtype:  # follows its input, now low
                    u.args = (u.args[0], low)
                    cur[u] = low
            for u in readers:
                if u.target is aten._to_copy.default:
                    drop_cast(u)
    # a fused kernel's fp32 output read only through casts to the low dtype: the kernel stores the low
    # dtype (it computes in fp32 and rounds once at its store: the casts' numbers, without their pass)
    for node in list(g.nodes):
        if node.op != "call_function" or ir.op_namespace(node) != "graphopt" or ir.op_name(node) != "fused_pointwise":
            continue
        prog = parse_pointwise(node.args[0])
        outs = list(prog.outputs)
        for gi in [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]:
            i = gi.args[1]
            found = _cast_readers(gi, low)
            if not isinstance(i, int) or outs[i][1] != "f32" or not found:
                continue
            views, readers = found
            outs[i] = (outs[i][0], POINTWISE_DTYPE_NAMES[low])
            for v in [gi, *views]:
                cur[v] = low
            for u in readers:
                drop_cast(u)
        if outs != prog.outputs:
            node.args = (dataclasses.replace(prog, outputs=outs).source, *node.args[1:])
    # outputs in the caller's dtype
    output = next(n for n in g.nodes if n.op == "output")

    def back(a):
        if isinstance(a, fx.Node) and a in cur and ir.info(a) is not None and cur[a] != ir.info(a).dtype:
            original_out[a] = ir.info(a).dtype
            return cast(a, ir.info(a).dtype, output)
        return a

    output.args = fx.node.map_arg(output.args, back)
    ir.erase_dead(gm, [n for n in g.nodes if n.op == "get_attr" and not n.users])
    gm.recompile()
    ir.repropagate(gm)
    return lowered


def _identity_cast(node: fx.Node) -> bool:
    """An fp32 -> fp32 ``to``/``_to_copy`` that changes nothing but the dtype argument (no device,
    layout or memory-format change): a no-op in the captured fp32 graph."""
    if node.target not in (aten.to.dtype, aten._to_copy.default):
        return False
    src = node.args[0] if node.args else None
    if not _is_float32(src) or not _is_float32(node):
        return False
    if node.target is aten.to.dtype:
        return len(node.args) <= 2 and not node.kwargs.get("memory_format") and not node.kwargs.get("copy")
    return set(node.kwargs) <= {"dtype"} and len(node.args) == 1


def _scalar_overflows(node: fx.Node, low: torch.dtype) -> bool:
    """A float literal outside the low dtype's range (Hugging Face's masks fill with
    finfo(float32).min, which bf16 cannot hold): the op stays in fp32."""
    big = torch.finfo(low).max
    vals = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, float)]
    return any(math.isfinite(v) and abs(v) > big for v in vals)


def _shares(gm: fx.GraphModule, ctx: PassContext) -> dict:
    flops: dict = {}
    nbytes: dict = {}
    for n in gm.graph.nodes:
        c = ctx.cost.node_cost(n)
        t = ir.info(n)
        if c.bound == "free" or t is None:
            continue
        key = str(t.dtype).replace("torch.", "")
        flops[key] = flops.get(key, 0.0) + ir.concrete(c.flops, ctx.hints)
        nbytes[key] = nbytes.get(key, 0.0) + ir.concrete(c.bytes, ctx.hints)
    tf, tb = sum(flops.values()) or 1.0, sum(nbytes.values()) or 1.0
    return {"flops_share": {k: v / tf for k, v in flops.items()}, "bytes_share": {k: v / tb for k, v in nbytes.items()}}
