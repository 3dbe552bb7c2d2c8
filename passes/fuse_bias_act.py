"""fuse_bias_act: GEMM/conv + bias + activation (+ residual add) -> GEMM without bias + one
``torch.ops.graphopt.bias_act(y, bias, act, residual, bias_dim)`` epilogue kernel, or, for
linear + bias + ReLU, torch's own fused path ``aten._addmm_activation`` (cuBLASLt's
RELU_BIAS epilogue on CUDA: one kernel instead of two, and addmm + in-place relu on the CPU).

Producers: ``linear(x, W, b)`` (bias_dim -1), ``conv1d/2d/3d(x, W, b)`` (NC.. layout, bias_dim 1),
``addmm(b, x, W)`` (beta = alpha = 1), and an explicit ``matmul/mm/bmm(x, W) + b`` with a 1-D
bias along the last dim. Activations: relu, gelu (exact and tanh), silu, sigmoid, tanh,
hardswish, leaky_relu with any numeric slope (``leaky_relu:<slope>``), or none when a residual follows. Residual: ``act(..) + r`` / ``r + act(..)`` with
r of the output's exact shape and dtype.

``_addmm_activation`` for GELU only in bf16 on a CUDA profile: its GELU is the tanh
approximation on CUDA (cuBLASLt's GELU_BIAS epilogue) but the exact erf GELU on the CPU. The two
differ by at most 4.8e-4 (near |x| = 2.2), below half a bf16 ulp of the value there (3.9e-3), so
in bf16 both spellings round to the same function within one ulp; in fp16/fp32 they do not, and
GELU goes to bias_act, whose ``gelu`` / ``gelu_tanh`` follow the model's spelling exactly. ReLU
is the same everywhere. The epilogue saves the GELU kernel's read and write of the activation
(BERT/ViT's 4x-wide MLP, ConvNeXt's pointwise convolutions).

The cost model decides: the time of the matched nodes against that of the nodes the rewrite
makes (the GEMM without its bias and the bias_act kernel, or the _addmm_activation call), each
built before the rewrite and priced by the cost model. What it knows: a linear/addmm bias is
applied in the cuBLASLt epilogue at no cost, so a bias + activation with nothing else to absorb
saves no kernel and is refused with that reason; a *convolution's* bias is a separate ``add_``
kernel in aten's cuDNN path (cudnn_convolution takes no bias). A conv2d + bias (+ residual) +
ReLU epilogue is left to fuse_conv_relu when that pass runs later (one cuDNN call with the bias,
residual and ReLU in its epilogue, where bias_act would leave two kernels), as fuse_elementwise
leaves it. A convolution's bias alone (no activation, no residual) goes to bias_act too where
the cost model prices aten's broadcast add above it. Where the epilogue's readers are all elementwise
ops fuse_elementwise fuses (an inference BatchNorm, a residual add: ConvMixer's depthwise half), the
convolution gives its bias to them instead, as an explicit add that their fused kernel takes in: one
pass over the output after the convolution where bias_act would leave two. (Not a depthwise convolution
where lower_depthwise_conv runs: its kernel takes the bias and activation of bias_act's epilogue.) bias_act keeps a channels_last input's layout,
so on a GPU where convert_channels_last runs the convolutions on NHWC tensors the epilogue stays
inside that region. Refused on a CPU profile (bias_act is a CUDA kernel) except the aten ReLU path.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cuda_ext.ops.bias_act import leaky_act
from graphopt.matcher import Alt, Any, Const, Op, find
from graphopt.pipeline import NO_FUSED_KERNELS, Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, inference_affine, set_meta, stored_view
from .fuse_elementwise import OPS
from .lower_depthwise_conv import depthwise

aten = torch.ops.aten
CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
MATMULS = (aten.matmul.default, aten.mm.default, aten.bmm.default)
ACTS = {
    aten.relu.default: "relu", aten.gelu.default: "gelu", aten.silu.default: "silu",
    aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh", aten.hardswish.default: "hardswish",
    aten.leaky_relu.default: "leaky_relu",
}


def _not_none(v):
    return v is not None


GEMM = Alt(
    Op(aten.linear.default, Any("x"), Any("w"), Any("b", pred=_not_none), name="gemm"),
    Op(CONVS, Any("x"), Any("w"), Any("b", pred=_not_none), name="gemm"),
    Op(aten.addmm.default, Any("b"), Any("x"), Any("w"), kwargs={"beta": Const(value=1), "alpha": Const(value=1)},
       name="gemm"),
    Op(aten.add.Tensor, Op(MATMULS, Any("x"), Any("w"), name="gemm"), Any("b"), Const("alpha", 1),
       name="badd", commutative=True),
)


def _act(inner, single_use=True):
    return Op(tuple(ACTS), inner, name="act", single_use=single_use)


def _res(inner):
    return Op(aten.add.Tensor, inner, Any("res"), Const("alpha", 1), name="resadd", commutative=True)


# most nodes first: act + residual, then act alone, then bias + residual (act "none"), then a
# convolution's bias alone (aten adds it in a broadcast kernel of its own; a GEMM's is free)
PATTERNS = (("act+residual", _res(_act(GEMM))), ("act", _act(GEMM)), ("residual", _res(GEMM)),
            ("bias", Op(CONVS, Any("x"), Any("w"), Any("b", pred=_not_none), name="gemm")))
# GEMM + activation where the GEMM output is read elsewhere (to report why it does not fuse)
# (one pattern per producer: the matcher's single_use=False is not seen through an Alt)
LOOSE = tuple(Op(tuple(ACTS), Op(p.targets, *p.args, name=p.name, single_use=False, kwargs=p.kwargs,
                                 commutative=p.commutative), name="act") for p in GEMM.alternatives)


def _fused_readers(gm: fx.GraphModule, top: fx.Node) -> bool:
    """Every reader of ``top`` is an elementwise op fuse_elementwise takes into a kernel (an op of
    its table, or an inference BatchNorm it applies as a per-channel scale and shift)."""
    return bool(top.users) and all(
        u.op == "call_function" and (u.target in OPS or inference_affine(gm, u) is not None) for u in top.users)


def act_name(node: fx.Node) -> str | None:
    """bias_act's name for the activation ``node`` applies (``leaky_relu:<slope>`` with its slope);
    None where it has none (another gelu approximation, a slope that is not a number)."""
    a = ACTS.get(node.target)
    if a == "gelu":
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
    if a == "leaky_relu":
        slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        return leaky_act(slope) if type(slope) in (int, float) else None
    return a


@register
class FuseBiasAct(Pass):
    name = "fuse_bias_act"
    family = "fusion"
    description = "GEMM/conv + bias + activation (+ residual) -> GEMM without bias + graphopt.bias_act (or aten._addmm_activation for ReLU)"
    requires = ("merge_sibling_linears", "fuse_swiglu")
    inference_only = True  # graphopt's kernels have no autograd formulas

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        candidates, claimed = [], set()
        self._reserved = set()
        if "fuse_conv_relu" in ctx.scheduled and ctx.fused_kernels and not ctx.training:
            from .fuse_conv_relu import epilogue_nodes

            self._reserved = epilogue_nodes(gm)
        for kind, pat in PATTERNS:
            for m in find(gm, pat):
                gemm = m["gemm"]
                if gemm in claimed:
                    continue
                cand = self._candidate(gm, ctx, res, kind, m)
                if cand is not None:
                    claimed.add(gemm)
                    candidates.append(cand)
        for m in (m for loose in LOOSE for m in find(gm, loose)):
            if m["gemm"] not in claimed and len((m.get("badd") or m["gemm"]).users) > 1:
                src = m.get("badd") or m["gemm"]
                res.reject(f"{m['gemm'].name} + {m['act'].name}",
                           f"{src.name} (the GEMM output before the activation) is also read elsewhere; "
                           "the bias cannot move into the epilogue")
        res.apply_ranked(ctx, candidates)
        return res

    # ------------------------------------------------------------------ candidates

    def _candidate(self, gm, ctx, res, kind, m) -> Candidate | None:
        gemm, badd, act, radd = m["gemm"], m.get("badd"), m.get("act"), m.get("resadd")
        top = radd or act or gemm
        label = " + ".join(n.name for n in (gemm, badd, act, radd) if n is not None)
        if kind == "bias" and (ctx.cost.device_kind != "cuda" or not gemm.users
                               or any(u in self._reserved for u in gemm.users)):
            # off CUDA the convolution applies its bias itself; fuse_conv_relu moves a residual
            # convolution's bias into its fused call
            return None
        a = act_name(act) if act is not None else "none"
        if a is None:
            res.reject(label, f"{act.name}: unsupported gelu approximation or a leaky_relu slope that is no number")
            return None
        bias, y = m["b"], badd or gemm
        yi, bi, ti = ir.info(y), ir.info(bias) if isinstance(bias, fx.Node) else None, ir.info(top)
        if bi is None or len(bi.shape) != 1:
            res.reject(label, "the bias is not a 1-D tensor")
            return None
        bias_dim = 1 if gemm.target in CONVS else -1
        if len(yi.shape) < 2 or bi.shape[0] != yi.shape[bias_dim]:
            res.reject(label, f"the bias does not run along dim {bias_dim} of the output")
            return None
        if gemm.target in CONVS and len(ir.info(gemm).shape) != len(ir.info(m["x"]).shape):
            res.reject(label, "unbatched convolution")
            return None
        if {act, radd} & self._reserved:
            res.reject(label, "left to fuse_conv_relu: one cuDNN call with the bias, residual and ReLU in its "
                              "epilogue (bias_act would leave two kernels)")
            return None
        if any(ir.info(n).dtype != yi.dtype or tuple(ir.info(n).shape) != tuple(yi.shape)
               for n in (act, radd) if n is not None):
            res.reject(label, "the epilogue broadcasts or changes dtype")
            return None
        r = m.get("res")
        if radd is not None:
            ri = ir.info(r) if isinstance(r, fx.Node) else None
            if ri is None or tuple(ri.shape) != tuple(yi.shape) or ri.dtype != yi.dtype:
                res.reject(label, "the residual does not have the output's shape and dtype")
                return None
            if r is gemm or r is act or r is badd:
                res.reject(label, "the residual is the GEMM's own output")
                return None
        nodes = [n for n in (radd, act, badd, gemm) if n is not None]
        old = ctx.node_time(nodes)
        # aten path: linear/addmm + bias + relu (+ gelu in bf16 on CUDA) -> _addmm_activation
        gelu_ok = a in ("gelu", "gelu_tanh") and yi.dtype == torch.bfloat16 and ctx.cost.device_kind == "cuda"
        if (a == "relu" or gelu_ok) and radd is None and gemm.target in (aten.linear.default, aten.addmm.default):
            xi = ir.info(m["x"])
            # a strided input (ConvNeXt's permuted NHWC view before the layout pass makes it
            # contiguous) is flattened by reshape, which copies only where linear would have too
            if len(xi.shape) == 2 or ir.is_contiguous(xi) or gelu_ok:
                use_gelu = a != "relu"
                gain = old - self._addmm_act_time(ctx, m, use_gelu)
                return Candidate(f"linear + bias + {'gelu' if use_gelu else 'relu'} -> _addmm_activation"
                                 + (" (cuBLASLt GELU epilogue, tanh form: within a bf16 ulp)" if use_gelu else ""),
                                 [act, gemm], gain, lambda: self._apply_addmm_act(gm, m, use_gelu), label=label)
        if not ctx.fused_kernels:
            res.reject(label, NO_FUSED_KERNELS)
            return None
        if gemm.target in CONVS and "fuse_elementwise" in ctx.scheduled and _fused_readers(gm, top) and not (
                "lower_depthwise_conv" in ctx.scheduled and depthwise(gemm)):
            # the epilogue's readers are elementwise ops fuse_elementwise fuses into one kernel: the
            # bias added there (an explicit add it takes in) saves bias_act's pass over the output
            # (a depthwise convolution's bias and activation go into lower_depthwise_conv's kernel
            # with bias_act's epilogue instead, where that pass runs)
            gain = ctx.node_time([gemm]) - self._conv_time(ctx, m)
            return Candidate(f"{ir.target_name(gemm)} + bias (+ {a}) read by elementwise ops -> the bias as an add "
                             "for fuse_elementwise", [gemm], gain, lambda: self._split_conv_bias(gm, m, bias_dim),
                             label=label)
        gain = old - self._bias_act_time(ctx, m, a, bias_dim)
        if gain <= 0.05 * ctx.cost.launch_overhead_s and not ctx.ignore_cost:  # rounding noise is not a gain
            why = (f"bias + {a} after {ir.target_name(gemm)}: the GEMM applies its bias in the cuBLASLt epilogue, so "
                   f"bias_act would only replace the {a} kernel one for one (predicted {gain * 1e6:+.2f} us)"
                   if radd is None and badd is None and gemm.target not in CONVS else
                   f"predicted no gain ({gain * 1e6:+.3f} us)")
            res.reject(label, why)
            return None
        return Candidate(f"{ir.target_name(gemm)} + bias + {a}{' + residual' if radd is not None else ''}", nodes,
                         gain, lambda: self._apply_bias_act(gm, m, a, bias_dim), label=label)

    # ------------------------------------------------------------------ prices (the nodes each rewrite makes)

    @staticmethod
    def _addmm_act_time(ctx, m, use_gelu: bool) -> float:
        r = ctx.replacement()
        _addmm_act_nodes(r, m["gemm"], *_live_inputs(m), use_gelu)
        return r.time()

    @staticmethod
    def _bias_act_time(ctx, m, a: str, bias_dim: int) -> float:
        r = ctx.replacement()
        _bias_act_nodes(r, m, a, bias_dim)
        kept = [m["gemm"]] if m.get("badd") is not None else []  # matmul + b: the matmul stays
        return r.time() + ctx.node_time(kept)

    @staticmethod
    def _conv_time(ctx, m) -> float:
        """The convolution without its bias."""
        gemm = m["gemm"]
        r = ctx.replacement()
        r.call(gemm.target, r.input(m["x"]), r.input(m["w"]), None, *gemm.args[3:])
        return r.time()

    # ------------------------------------------------------------------ rewrites

    @staticmethod
    def _split_conv_bias(gm, m, bias_dim) -> fx.Node:
        """conv(x, w, b) -> conv(x, w, None) + b viewed along the channels (dim 1)."""
        g = gm.graph
        gemm = m["gemm"]
        rank = len(ir.info(gemm).shape)
        shape = [-1] + [1] * (rank - 2)
        with g.inserting_before(gemm):
            conv = g.call_function(gemm.target, (m["x"], m["w"], None) + tuple(gemm.args[3:]), dict(gemm.kwargs))
            if m["b"].op == "get_attr":  # a constant bias: its column is a view of it, stored (no node to run)
                col = stored_view(gm, m["b"], lambda v: v.view(shape), f"{gemm.name}_bias_column")
            else:
                col = g.call_function(aten.view.default, (m["b"], shape))
            add = g.call_function(aten.add.Tensor, (conv, col))
        set_meta(gm, [conv, col, add])
        if add.meta.get("val") is None or tuple(add.meta["val"].shape) != tuple(ir.info(gemm).shape):
            for n in (add, col, conv):
                g.erase_node(n)
            return None
        bias = m["b"]
        gemm.replace_all_uses_with(add)
        g.erase_node(gemm)
        if bias.op == "get_attr" and not bias.users:
            g.erase_node(bias)
        return add

    @staticmethod
    def _apply_addmm_act(gm, m, use_gelu: bool = False) -> fx.Node:
        g = gm.graph
        gemm, act = m["gemm"], m["act"]
        with g.inserting_before(act):
            made, fused = _addmm_act_nodes(GraphBuilder(g), gemm, *_live_inputs(m), use_gelu)
        out = made[-1]
        set_meta(gm, [n for n in g.nodes if n in set(made)])
        act.replace_all_uses_with(out)
        ir.erase_dead(gm, [act, gemm])
        return fused

    @staticmethod
    def _apply_bias_act(gm, m, a, bias_dim) -> fx.Node:
        g = gm.graph
        gemm, badd, act, radd = m["gemm"], m.get("badd"), m.get("act"), m.get("resadd")
        top = radd or act or gemm
        with g.inserting_before(top):
            made = _bias_act_nodes(GraphBuilder(g), m, a, bias_dim)
        set_meta(gm, made)
        new = made[-1]
        top.replace_all_uses_with(new)
        ir.erase_dead(gm, [n for n in (radd, act, badd, gemm) if n is not None])
        return new


def _addmm_act_nodes(b, gemm, x, w, bias, use_gelu: bool) -> tuple[list, fx.Node]:
    """linear/addmm(x, w, bias) + act -> [flatten x, w.t(),] _addmm_activation [, view back]:
    (the nodes made, in order; the _addmm_activation node)."""
    made = []
    if gemm.target is aten.linear.default:
        k = ir.info(w).shape[-1]
        flat = aten.view.default if ir.is_contiguous(ir.info(x)) else aten.reshape.default
        if len(ir.info(x).shape) != 2:
            x = b.call(flat, x, [-1, k])
            made.append(x)
        w = b.call(aten.t.default, w)
        made.append(w)
    fused = b.call(aten._addmm_activation.default, bias, x, w, use_gelu=use_gelu)
    made.append(fused)
    out_shape = list(ir.info(gemm).shape)
    if len(out_shape) != 2:
        made.append(b.call(aten.view.default, fused, out_shape))
    return made, fused


def _bias_act_nodes(b, m, a: str, bias_dim: int) -> list:
    """GEMM + bias + act (+ residual) -> [the GEMM without its bias,] bias_act: the nodes made."""
    gemm, badd, act, radd = m["gemm"], m.get("badd"), m.get("act"), m.get("resadd")
    # earlier rewrites of this pass may have replaced our inputs: read them from the live nodes
    x, w, bias = _live_inputs(m)
    inner = act or badd or gemm
    res = None
    if radd is not None:
        res = radd.args[1] if radd.args[0] is inner else radd.args[0]
    made = []
    if badd is not None:  # matmul + b: the matmul stays
        y = gemm
    elif gemm.target is aten.addmm.default:
        y = b.call(aten.mm.default, x, w, val=gemm.meta.get("val"))
        made.append(y)
    else:
        args = list(gemm.args)
        while len(args) < 3:
            args.append(None)
        args[0], args[1], args[2] = x, w, None
        kwargs = {k: v for k, v in gemm.kwargs.items() if k != "bias"}
        if gemm.target is aten.linear.default:
            args = args[:2]
        y = b.call(gemm.target, *args, val=gemm.meta.get("val"), **kwargs)  # the same output, without the bias
        made.append(y)
    made.append(b.call(torch.ops.graphopt.bias_act.default, y, bias, a, res, bias_dim,
                       val=(radd or act or gemm).meta.get("val")))
    return made


def _live_inputs(m):
    """(x, w, bias) read from the matched nodes as they are now."""
    gemm, badd = m["gemm"], m.get("badd")
    if gemm.target is aten.addmm.default:
        return gemm.args[1], gemm.args[2], gemm.args[0]
    x, w = gemm.args[0], gemm.args[1]
    if badd is not None:
        return x, w, (badd.args[1] if badd.args[0] is gemm else badd.args[0])
    from graphopt.matcher import get_arg
    return x, w, get_arg(gemm, 2)
