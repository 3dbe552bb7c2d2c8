"""fuse_elementwise: connected groups of pointwise ops -> one generated kernel,
``torch.ops.graphopt.fused_pointwise(program, inputs)`` (program built with
cuda_ext.pointwise.Program; Triton on the GPU, its torch evaluation elsewhere).

What joins a group: aten pointwise ops the program language can express — add/sub/rsub/mul/div
(Tensor and Scalar forms, alpha), neg abs exp log sqrt rsqrt reciprocal tanh sigmoid relu
gelu(both) silu hardswish erf cos sin, pow(x, literal), clamp/clamp_min/clamp_max with literal bounds,
maximum minimum, where (all forms), eq ne lt le gt ge, and dtype casts (``to``/``_to_copy``;
kept in the program as ``cast`` so HF's deliberate fp32 round trips round where eager did).
Every op of a group has the group's output shape (inputs may broadcast into it: a smaller
input is read through stride 0; a smaller *intermediate* would be recomputed per output
element, so it starts its own group). Values read outside the group become extra outputs
(multiple consumers), the group's external tensors its inputs (at most MAX_INPUTS). Groups that
read a common tensor, of one shape and with no path between them, merge into one (horizontal
fusion: the cos and sin of a rotary angle table are one kernel reading the angles once; inference
graphs only).

Row reductions join too, with their prologue and epilogue (inference graphs): a sum, mean, amax,
variance, 2-norm (``linalg_vector_norm``) over one dim, keepdim (or without it, where the result is read
only through an ``unsqueeze`` at that dim: ConViT's ``attn / attn.sum(-1).unsqueeze(-1)``), or a softmax
or log-softmax, becomes ``rsum``/``rmax`` in the program, and its per-row result (the dim kept as 1) joins
the ops that broadcast it back along the row (through ``expand``/``expand_as``, no copy): F.normalize, a
softmax with its scale and mask, a hand-written norm are one kernel that reads each row once. The row
may be any one dim (the program's ``reduce D``: CoaT's softmax over tokens, a LayerNorm over the channels
of an NCHW or channels_last tensor); every reduction of a group runs along the same dim. Such a group's
outputs are full rows (a per-row value read outside the group keeps it unfused), laid out as eager
laid them out (where the program cannot write that layout the group stays unfused); a row longer than
cuda_ext.pointwise_triton.MAX_ROW, or strided, is looped over (one pass per reduction, then one that
writes).

An inference BatchNorm (constant statistics and affine; fold_conv_bn folded those after a convolution)
joins as the per-channel affine ``x * s + t``, ``s`` and ``t`` computed once in float64 and stored in
float32 (as aten's kernel computes): a BatchNorm after a concatenation, an add or an activation is no
kernel of its own. Its constants are made before the groups are and dropped again where it stays unfused.

A concatenation joins the pointwise ops that read it (inference graphs): ``torch.cat`` of two or more
tensors becomes a ``catin`` of the program, which reads each piece where the output's index along the
dim falls in its range; the concatenated tensor is never written (MetaFormer-style gates reading a split
and a convolved part, a concatenation before a normalization's affine).

A copy after the group joins it (inference graphs): where the group's one value is read only
through views (permute, transpose, view, a reshape that is a view; each read once) ending in a copy
that makes it row-major (``clone``, ``contiguous``, a ``reshape`` its input cannot be viewed as),
the group runs in the index space that copy writes: each input is broadcast to the group's shape and
seen through the same views, the program is marked ``layout row_major``, and the copy's readers read
the fused result (a view of it where the copy was a reshape). CoaT's factorized attention output
``(scale * f + crpe).transpose(1, 2).reshape(B, N, C)`` is one kernel. Where a view would need a copy
of an input, or the cost model predicts less than the group alone, the group fuses without it.

Views between two pointwise ops (inference graphs): ``y = f(x, ...); g(views(y), ...)`` with y read only by
the views (each read once) becomes ``g(f(views(x), ...), ...)``, each operand of f broadcast to y's
shape and seen through the same views (``sink_views``), so f and g are one group; not where a view of
an operand would need a copy.

A constant pad of one dim joins the group of its operand (inference graphs): ``pad(f(x, ...), v)`` is
``where(mask, f(catin(0, x, 0), ...), v)``: each input the operand is computed from, where it varies
along the padded dim, is read through a ``catin`` between zero pieces (a 0-d constant expanded, no
memory), so the operand's values land at their padded index, and a boolean constant along the
padded dim says where they are (CoaT's ``F.pad(q * conv(v), (0, 0, 1, 0))``). One pad a group, not
with a row reduction or a concatenation; the pad's operand and what it is computed from must be
read only through the pad; pads of more than one dim stay.

Never joined: other reductions, GEMMs, other views, graphopt ops (this pass runs last among the fusions
and leaves the specific kernels alone), integer tensors, no-op casts (they are aliases). A
group that would depend on itself through an outside node (``a = exp(x); b = a / sum(a)``)
is cut before the node that closes the loop. Groups of fewer than two kernels are not
candidates, except a lone op aten runs in its strided unvectorized kernel (a broadcast into a
channels_last tensor: squeeze-and-excitation's scale, ``cost.model.broadcast_channels_last``);
the cost model decides the rest (the group's nodes against the one fused_pointwise
node, which reads the inputs once and writes the outputs once). Refused on a CPU profile.

Training graphs too: fused_pointwise is differentiable (its backward is one more fused_pointwise
running the program's derivative, which rereads the forward inputs it needs and recomputes the
rest). There a group's gain adds the backward's: eager's derivative kernels of the group's nodes
(one elementwise kernel per operand that takes a gradient, add's pass-through excepted, plus one
add per extra use of a value inside the group) against the backward program's one kernel.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.model import broadcast_channels_last
from graphopt.cost.replacement import Replacement
from graphopt.matcher import get_arg
from graphopt.pipeline import NO_FUSED_KERNELS, Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import GraphBuilder, inference_affine, requires_grad, set_meta
from .eliminate_permutes import concrete_layout, perm_of

aten = torch.ops.aten
MAX_INPUTS = 24
MAX_OUTPUTS = 4
MERGE_SPAN = 128  # graph positions two sibling groups may be apart to be tried for one kernel


def _dtypes():
    from graphopt.cuda_ext.pointwise import DTYPES

    return set(DTYPES.values())


def _gelu(p, node, a):
    approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    if approx == "none":
        return p.gelu(a[0])
    if approx == "tanh":
        return p.gelu_tanh(a[0])
    raise _NotExpressible(f"gelu approximate={approx!r}")


class _NotExpressible(Exception):
    pass


def _alpha(node):
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if isinstance(alpha, fx.Node):
        raise _NotExpressible("alpha is a tensor")
    return alpha


def _num(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _NotExpressible(f"{v!r} is not a literal number")
    return float(v)


def _bounds(node):
    lo = node.kwargs.get("min", node.args[1] if len(node.args) > 1 else None)
    hi = node.kwargs.get("max", node.args[2] if len(node.args) > 2 else None)
    return (None if lo is None else _num(lo)), (None if hi is None else _num(hi))


def _scaled(p, b, alpha):
    return b if alpha == 1 else b * _num(alpha)


def _lit(node, i, name, default):
    """A literal argument of ``node`` (positional ``i`` or keyword ``name``); a tensor is refused."""
    v = node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
    if isinstance(v, fx.Node):
        raise _NotExpressible(f"{name} is a tensor")
    return v


def _softplus(p, x, beta: float, threshold: float):
    """aten's: x where beta * x > threshold, else log(1 + exp(beta * x)) / beta."""
    bx = x if beta == 1 else p.mul(x, beta)
    soft = p.log(p.add(p.exp(bx), 1.0))
    return p.where(p.gt(bx, threshold), x, soft if beta == 1 else p.div(soft, beta))


def _elu(p, node, x):
    """aten's: scale * x where x > 0, else scale * alpha * (exp(x * input_scale) - 1)."""
    alpha, scale, in_scale = (_num(_lit(node, i, k, 1.0)) for i, k in ((1, "alpha"), (2, "scale"), (3, "input_scale")))
    neg = p.mul(p.sub(p.exp(x if in_scale == 1 else p.mul(x, in_scale)), 1.0), alpha * scale)
    return p.where(p.gt(x, 0.0), x if scale == 1 else p.mul(x, scale), neg)


def _lerp(p, a, b, w):
    """aten's: a + w * (b - a) where |w| < 0.5, else b - (b - a) * (1 - w)."""
    d = p.sub(b, a)
    if not hasattr(w, "id"):  # a literal weight: aten's branch chosen here
        return p.add(a, p.mul(d, w)) if abs(w) < 0.5 else p.sub(b, p.mul(d, 1.0 - w))
    return p.where(p.lt(p.abs(w), 0.5), p.add(a, p.mul(d, w)), p.sub(b, p.mul(d, p.sub(1.0, w))))


SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946  # aten's
# op -> builder(program, node, operand values) ; operands: Values or python numbers
OPS = {
    aten.add.Tensor: lambda p, n, a: p.add(a[0], _scaled(p, a[1], _alpha(n))),
    aten.add.Scalar: lambda p, n, a: p.add(a[0], _scaled(p, a[1], _alpha(n))),
    aten.sub.Tensor: lambda p, n, a: p.sub(a[0], _scaled(p, a[1], _alpha(n))),
    aten.sub.Scalar: lambda p, n, a: p.sub(a[0], _scaled(p, a[1], _alpha(n))),
    aten.rsub.Scalar: lambda p, n, a: p.sub(a[1], _scaled(p, a[0], _alpha(n))),
    aten.rsub.Tensor: lambda p, n, a: p.sub(a[1], _scaled(p, a[0], _alpha(n))),
    aten.mul.Tensor: lambda p, n, a: p.mul(a[0], a[1]),
    aten.mul.Scalar: lambda p, n, a: p.mul(a[0], a[1]),
    aten.div.Tensor: lambda p, n, a: p.div(a[0], a[1]),
    aten.div.Scalar: lambda p, n, a: p.div(a[0], a[1]),
    aten.maximum.default: lambda p, n, a: p.maximum(a[0], a[1]),
    aten.minimum.default: lambda p, n, a: p.minimum(a[0], a[1]),
    aten.reciprocal.default: lambda p, n, a: p.div(1.0, a[0]),
    aten.gelu.default: _gelu,
    aten.pow.Tensor_Scalar: lambda p, n, a: p.pow(a[0], _num(a[1])),
    aten.clamp.default: lambda p, n, a: p.clamp(a[0], *_bounds(n)),
    aten.clamp_min.default: lambda p, n, a: p.clamp(a[0], _num(a[1]), None),
    aten.clamp_max.default: lambda p, n, a: p.clamp(a[0], None, _num(a[1])),
    aten.where.self: lambda p, n, a: p.where(a[0], a[1], a[2]),
    aten.where.ScalarOther: lambda p, n, a: p.where(a[0], a[1], a[2]),
    aten.where.ScalarSelf: lambda p, n, a: p.where(a[0], a[1], a[2]),
    aten.where.Scalar: lambda p, n, a: p.where(a[0], a[1], a[2]),
    # masked_fill(x, mask, v) = where(mask, v, x); operands in builder order (x, mask, v)
    aten.masked_fill.Scalar: lambda p, n, a: p.where(a[1], a[2], a[0]),
    aten.masked_fill.Tensor: lambda p, n, a: p.where(a[1], a[2], a[0]),
    # written with the program's ops, as aten's kernels compute them (in the compute dtype)
    aten.addcmul.default: lambda p, n, a: p.add(a[0], _scaled(p, p.mul(a[1], a[2]), _lit(n, 3, "value", 1))),
    aten.addcdiv.default: lambda p, n, a: p.add(a[0], _scaled(p, p.div(a[1], a[2]), _lit(n, 3, "value", 1))),
    aten.hardtanh.default: lambda p, n, a: p.clamp(a[0], _num(_lit(n, 1, "min_val", -1.0)),
                                                   _num(_lit(n, 2, "max_val", 1.0))),
    aten.relu6.default: lambda p, n, a: p.clamp(a[0], 0.0, 6.0),
    aten.selu.default: lambda p, n, a: p.where(p.gt(a[0], 0.0), p.mul(a[0], SELU_SCALE),
                                               p.mul(p.sub(p.exp(a[0]), 1.0), SELU_ALPHA * SELU_SCALE)),
    aten.hardsigmoid.default: lambda p, n, a: p.div(p.clamp(p.add(a[0], 3.0), 0.0, 6.0), 6.0),
    aten.leaky_relu.default: lambda p, n, a: p.where(p.gt(a[0], 0.0), a[0],
                                                     p.mul(a[0], _num(_lit(n, 1, "negative_slope", 0.01)))),
    aten.elu.default: lambda p, n, a: _elu(p, n, a[0]),
    aten.softplus.default: lambda p, n, a: _softplus(p, a[0], _num(_lit(n, 1, "beta", 1.0)),
                                                     _num(_lit(n, 2, "threshold", 20.0))),
    aten.mish.default: lambda p, n, a: p.mul(a[0], p.tanh(_softplus(p, a[0], 1.0, 20.0))),
    aten.lerp.Scalar: lambda p, n, a: _lerp(p, a[0], a[1], _num(a[2])),
    aten.lerp.Tensor: lambda p, n, a: _lerp(p, a[0], a[1], a[2]),
}
for _u in ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "silu", "hardswish", "erf", "cos",
           "sin"):
    OPS[getattr(aten, _u).default] = (lambda name: lambda p, n, a: getattr(p, name)(a[0]))(_u)
for _c in ("eq", "ne", "lt", "le", "gt", "ge"):
    for _ov in ("Tensor", "Scalar"):
        OPS[getattr(getattr(aten, _c), _ov)] = (lambda name: lambda p, n, a: getattr(p, name)(a[0], a[1]))(_c)
CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
         aten.type_as.default}  # (type_as's second argument gives only the dtype)


_WHERES = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
MASKED_FILLS = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_UNARY_ARGS = (aten.gelu.default, aten.clamp.default, aten.reciprocal.default, aten.hardtanh.default,
               aten.hardsigmoid.default, aten.leaky_relu.default, aten.elu.default, aten.softplus.default,
               aten.mish.default)
_TERNARY = (aten.addcmul.default, aten.addcdiv.default, aten.lerp.Tensor, aten.lerp.Scalar)  # (lerp's weight may be a literal)
# over the last dim, keepdim: one value per row ([..., 1]); softmax keeps the row
ROW_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.linalg_vector_norm.default,
                  aten.var.dim, aten.var.correction)
SOFTMAXES = (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
_LOG_SOFTMAXES = (aten.log_softmax.int, aten._log_softmax.default)
EXPANDS = (aten.expand.default, aten.expand_as.default)
# the row's dim put back after a reduction without keepdim (``x / x.sum(-1).unsqueeze(-1)``)
ROW_UNSQUEEZE = aten.unsqueeze.default


def row_reduction(node: fx.Node) -> str:
    """'' when ``node`` reduces its input over one dim (its *row*: :func:`row_dim`) the way a
    program's rsum/rmax can (a row reduction, keepdim, or a softmax), else why not."""
    x = node.args[0] if node.args else None
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    if xi is None or not xi.shape:
        return "no input shape"
    rank = len(xi.shape)
    dim = row_dim(node)
    if dim is None:
        return "not over one literal dim"
    row = xi.shape[dim]
    if not isinstance(row, int) or row < 1:
        return f"rows of {row} elements"
    if node.target in SOFTMAXES:
        if node.target in (aten._softmax.default, aten._log_softmax.default) and node.args[2]:
            return "a softmax from half to float"
    else:
        if node.target is aten.linalg_vector_norm.default and get_arg(node, 1, "ord", 2) != 2:
            return "a norm other than the 2-norm"
        keep = _dims_keep(node)[1]
        if node.target in (aten.var.dim, aten.var.correction) and row - _correction(node) <= 0:
            return f"a variance of {row} values with correction {_correction(node)}"
        if "dtype" in node.kwargs or \
                not (keep or (node.users and all(_unsqueezes_at(u, dim, rank) for u in node.users))):
            return "not one dim kept (keepdim=True, or the reduced value read only unsqueezed there; no dtype)"
    return ""


def row_dim(node: fx.Node) -> int | None:
    """The dim (>= 0) a row reduction or softmax ``node`` reduces its input over, or None where that is
    not one literal dim."""
    x = node.args[0] if node.args else None
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    if xi is None or not xi.shape:
        return None
    if node.target in SOFTMAXES:
        dim = node.args[1] if len(node.args) > 1 else None
    else:
        dims = _dims_keep(node)[0]
        dim = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else None
    return dim % len(xi.shape) if isinstance(dim, int) else None


def _dims_keep(node: fx.Node) -> tuple:
    """A reduction's (dim argument, keepdim), wherever its overload puts them."""
    if node.target is aten.linalg_vector_norm.default:
        return get_arg(node, 2, "dim", None), get_arg(node, 3, "keepdim", False)
    if node.target is aten.var.dim:
        return get_arg(node, 1, "dim", None), get_arg(node, 3, "keepdim", False)
    if node.target is aten.var.correction:
        return get_arg(node, 1, "dim", None), node.kwargs.get("keepdim", False)
    return get_arg(node, 1, "dim", None), get_arg(node, 2, "keepdim", False)


def _unsqueezes_at(u: fx.Node, dim: int, rank: int) -> bool:
    """``u`` puts a size-1 dim back as dim ``dim`` of ``rank`` dims."""
    return (u.op == "call_function" and u.target is ROW_UNSQUEEZE and isinstance(get_arg(u, 1, "dim", None), int)
            and get_arg(u, 1, "dim", None) % rank == dim)


def cat_reason(node: fx.Node, dtypes) -> str:
    """'' when ``node`` is a concatenation a program can read in place (``catin``): two or more
    distinct floating tensors of its dtype, nonempty along the dim, on its device; else why not."""
    pieces, dim = node.args[0], get_arg(node, 1, "dim", 0)
    ti = ir.info(node)
    if not isinstance(pieces, (list, tuple)) or len(pieces) < 2 or not isinstance(dim, int):
        return "not a concatenation of two or more tensors along a literal dim"
    if len(set(pieces)) != len(pieces) or not all(isinstance(a, fx.Node) for a in pieces):
        return "a tensor concatenated twice"
    infos = [ir.info(a) for a in pieces]
    if any(i is None or i.dtype != ti.dtype or i.dtype == torch.bool or i.device != ti.device
           or len(i.shape) != len(ti.shape) for i in infos):
        return "pieces of another dtype, rank or device"
    d = dim % len(ti.shape)
    if not all(isinstance(i.shape[d], int) and i.shape[d] > 0 for i in infos):
        return "a piece empty (or symbolic) along the dim"
    return ""


PADS = (aten.constant_pad_nd.default, aten.pad.default)


def pad_args(node: fx.Node):
    """(dim, before, after, fill value) of a constant pad of one dim, or a str saying why it is not one."""
    x = node.args[0] if node.args else None
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    pad = get_arg(node, 1, "pad", None)
    if node.target is aten.pad.default:
        if get_arg(node, 2, "mode", "constant") != "constant":
            return "a pad other than a constant one"
        value = get_arg(node, 3, "value", None)
    else:
        value = get_arg(node, 2, "value", 0)
    value = 0.0 if value is None else value
    if xi is None or not xi.shape or not all(type(d) is int for d in xi.shape):
        return "no static input shape"
    if not isinstance(pad, (list, tuple)) or len(pad) % 2 or not all(type(v) is int for v in pad):
        return "pad widths not literal"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "a fill value that is not a literal number"
    widths = [(len(xi.shape) - 1 - i, pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]
    if any(lo < 0 or hi < 0 for _, lo, hi in widths):
        return "a negative pad (a crop)"
    padded = [(d, lo, hi) for d, lo, hi in widths if lo or hi]
    if len(padded) != 1:
        return "pads more than one dim" if padded else "pads nothing"
    return (*padded[0], float(value))


def pad_reason(node: fx.Node) -> str:
    """'' when ``node`` is a constant pad of one dim a program can compute (its operand's values read
    through a ``catin`` of zero pieces around them, the pad's fill where the mask says so)."""
    a = pad_args(node)
    return a if isinstance(a, str) else ""


BN_AFFINE = "graphopt_bn_affine"  # node.meta key: a BatchNorm's (scale, shift) get_attr nodes while the pass runs


def _affine_batch_norms(gm: fx.GraphModule) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Give each inference BatchNorm with constant statistics and affine its per-channel (scale, shift)
    constants, shaped to broadcast over its input's channel dim 1 (``node.meta[BN_AFFINE]``); returns
    (BatchNorm, the get_attr nodes it reads) pairs (an erased node's arguments are cleared)."""
    out = []
    for n in list(gm.graph.nodes):
        affine = inference_affine(gm, n)
        x = n.args[0] if affine is not None else None
        xi = ir.info(x) if isinstance(x, fx.Node) else None
        if xi is None or len(xi.shape) < 2:
            continue
        scale, shift, params = affine
        dtype = torch.float64 if xi.dtype == torch.float64 else torch.float32
        shape = [-1] + [1] * (len(xi.shape) - 2)
        nodes = []
        with gm.graph.inserting_before(n):
            for what, v in (("scale", scale), ("shift", shift)):
                a = gm.graph.get_attr(ir.register_constant(gm, f"{n.name}_{what}", v.to(dtype).reshape(shape)))
                a.meta["val"] = ir.get_attr_value(gm, a.target)
                nodes.append(a)
        n.meta[BN_AFFINE] = tuple(nodes)
        out.append((n, params))
    return out


def _drop_affines(gm: fx.GraphModule, bns: list[tuple[fx.Node, list[fx.Node]]]) -> None:
    """The constants of the BatchNorms left unfused go again; a fused one's statistics too."""
    alive = set(gm.graph.nodes)
    for n, stats in bns:
        for a in list(n.meta.pop(BN_AFFINE)) + stats:
            if not a.users and a in alive:
                gm.graph.erase_node(a)
                alive.discard(a)
    ir.remove_unused_attributes(gm)


def _operands(node: fx.Node) -> list:
    """The value operands of a pointwise node (tensor nodes or literals), in builder order."""
    t = node.target
    if t is aten.cat.default:
        return list(node.args[0])
    if t in PADS:
        return [node.args[0]]
    if t is aten.batch_norm.default:
        return [node.args[0], *node.meta[BN_AFFINE]]
    if t in CASTS or t in _UNARY_ARGS or t in ROW_REDUCTIONS or t in SOFTMAXES or t in EXPANDS or t is ROW_UNSQUEEZE:
        return [node.args[0]]  # (expand_as's second argument gives only the shape)
    if t in _WHERES or t in MASKED_FILLS or t in _TERNARY:
        return list(node.args[:3])
    positional = [a for a in t._schema.arguments if not a.kwarg_only]
    return list(node.args[: min(2, len(positional))])


def fusible(node: fx.Node, dtypes) -> str:
    """'' if ``node`` can join a group, else why not."""
    if node.op != "call_function":
        return "not a call"
    ti = ir.info(node)
    if ti is None or ti.dtype not in dtypes:
        return "output is not a floating/bool tensor"
    if node.target in CASTS:
        src = node.args[0]
        si = ir.info(src) if isinstance(src, fx.Node) else None
        if si is None or si.dtype not in dtypes or si.device != ti.device or si.dtype == ti.dtype:
            return "no-op or cross-device cast"
        extra = set(node.kwargs) - {"dtype", "layout", "device", "memory_format", "non_blocking", "copy"}
        if extra or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            return "cast with a layout change"
        return ""
    if node.target in ROW_REDUCTIONS or node.target in SOFTMAXES:
        return row_reduction(node)
    if node.target in EXPANDS:
        src = node.args[0]
        if not isinstance(src, fx.Node) or ir.info(src) is None or ir.info(src).dtype not in dtypes:
            return "expands no floating tensor"
        return ""
    if node.target is ROW_UNSQUEEZE:
        src = node.args[0]
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target in ROW_REDUCTIONS \
                and not _dims_keep(src)[1] and row_reduction(src) == "" \
                and _unsqueezes_at(node, row_dim(src), len(ir.info(node).shape)):
            return ""
        return "an unsqueeze other than of a row reduction's result"
    if node.target is aten.cat.default:
        return cat_reason(node, dtypes)
    if node.target in PADS:
        return pad_reason(node)
    if node.target is aten.batch_norm.default:
        return "" if BN_AFFINE in node.meta else "a BatchNorm in training mode or with statistics not constant"
    if node.target not in OPS:
        return "not a pointwise op the program language has"
    if node.target in MASKED_FILLS:
        x, value = node.args[0], node.args[2]
        if not isinstance(x, fx.Node) or ir.info(x) is None or not ir.info(x).dtype.is_floating_point:
            return "a masked_fill of a tensor that is not floating"
        if isinstance(value, fx.Node) and (ir.info(value) is None or len(ir.info(value).shape) != 0
                                           or not ir.info(value).dtype.is_floating_point):
            return "a masked_fill whose value is not a floating 0-dim tensor"
    for a in _operands(node):
        if isinstance(a, fx.Node):
            ai = ir.info(a)
            if ai is None or ai.dtype not in dtypes:
                return f"operand {a.name} is not a floating/bool tensor"
        elif not isinstance(a, (int, float)) or isinstance(a, bool):
            return f"operand {a!r} is not a number"
    for a in node.args[len(_operands(node)):]:
        if isinstance(a, fx.Node):
            return "a non-value argument is a tensor"
    return ""


def toposort_stable(g: fx.Graph) -> None:
    """Reorder ``g`` topologically, keeping the current order wherever it is already legal."""
    order, seen = [], set()
    for root in list(g.nodes):
        stack = [(root, iter(root.all_input_nodes))]
        if root in seen:
            continue
        seen.add(root)
        while stack:
            n, it = stack[-1]
            nxt = next((a for a in it if a not in seen), None)
            if nxt is None:
                order.append(n)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(nxt.all_input_nodes)))
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n


@register
class FuseElementwise(Pass):
    name = "fuse_elementwise"
    family = "fusion"
    description = "connected groups of pointwise ops -> one generated kernel (graphopt.fused_pointwise)"
    requires = ("fuse_swiglu", "fuse_bias_act")
    affine_batch_norms = True  # inference BatchNorms join groups as per-channel affines

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        bns = _affine_batch_norms(gm) if self.affine_batch_norms and not ctx.training and ctx.fused_kernels else []
        try:
            return self._run(gm, ctx)
        finally:
            _drop_affines(gm, bns)

    def _run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        dtypes = _dtypes()
        if not ctx.training and ctx.fused_kernels:
            moved = sink_views(gm, dtypes)
            if moved:
                res.notes.append(f"{moved} pointwise ops moved after the views between them and the pointwise ops "
                                 "reading them (their operands seen through those views), so one kernel can hold both")
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        ok = self._eligible({n for n in gm.graph.nodes if not fusible(n, dtypes)
                             and (not _is_free(ctx, n) or n.target in EXPANDS or n.target is ROW_UNSQUEEZE)})
        # (an expand, or an unsqueeze after a reduction, joins a row reduction's group)
        if ctx.training:  # a program reading a concatenation in place has no generated backward
            ok = {n for n in ok if n.target is not aten.cat.default and n.target not in PADS}
        batched = ok & ir.batched_nodes(gm)
        if batched:  # inside a torch.vmap: fused_pointwise has no batching rule
            ok -= batched
            res.notes.append(f"{len(batched)} pointwise nodes inside a torch.vmap left as they are (the fused kernel "
                             "has no batching rule)")
        if "fuse_conv_relu" in ctx.scheduled and ctx.fused_kernels and not ctx.training:
            # conv + bias (+ residual) + ReLU becomes one cuDNN call in the lowering step: a
            # pointwise kernel here would take its add/ReLU and leave the convolution two kernels
            from .fuse_conv_relu import epilogue_nodes

            reserved = epilogue_nodes(gm)
            if reserved:
                ok -= reserved
                res.notes.append(f"{len(reserved)} add/ReLU nodes of convolution epilogues left to fuse_conv_relu")
        candidates = []
        grad = requires_grad(gm) if ctx.training else {}
        has_conv2d = ctx.fused_kernels and ctx.cost.conv_nchw_slowdown > 1.0 and any(
            n.op == "call_function" and n.target is torch.ops.aten.conv2d.default for n in gm.graph.nodes)
        feeds_conv = _feeding_convolutions(gm) if has_conv2d else set()
        groups = self._groups(gm, ok, order, merge=not ctx.training)

        def refuse(group, label, why):
            res.reject(label, why)
            if why.endswith(ROWS_AND_CAT):  # the row program without the concatenations
                groups.extend(self._groups(gm, {n for n in group if n.target is not aten.cat.default}, order,
                                           merge=False))
            elif why == ROWS_ALONG_DIMS:
                # the reductions along the dim of the last one stay; the others (and the views serving them) leave
                reducing = [n for n in group if n.target in ROW_REDUCTIONS or n.target in SOFTMAXES]
                keep = row_dim(reducing[-1])
                drop = {n for n in reducing if row_dim(n) != keep}
                drop |= {n for n in group if (n.target in EXPANDS or n.target is ROW_UNSQUEEZE)
                         and any(a in drop for a in n.all_input_nodes)}
                groups.extend(self._groups(gm, set(group) - drop, order, merge=False))
            elif any(n.target in ROW_REDUCTIONS or n.target in SOFTMAXES for n in group):
                # without its row reductions (and the expands serving them): the pointwise groups it held
                rest = {n for n in group if n.target not in ROW_REDUCTIONS and n.target not in SOFTMAXES
                        and n.target not in EXPANDS and n.target is not ROW_UNSQUEEZE}
                groups.extend(self._groups(gm, rest, order, merge=False))
            elif any(n.target in PADS for n in group):
                # without its pads: the pointwise groups on either side
                rest = {n for n in group if n.target not in PADS}
                groups.extend(self._groups(gm, rest, order, merge=False))
            elif any(n.target is aten.cat.default for n in group):
                # without its concatenations (DenseNet's of more pieces than a program reads): the rest
                rest = {n for n in group if n.target is not aten.cat.default}
                groups.extend(self._groups(gm, rest, order, merge=False))

        while groups:
            group = groups.pop(0)
            real = [n for n in group if not _is_free(ctx, n)]
            # a lone op is a candidate only where aten runs it in its slow strided kernel or copies first
            # (an out-of-place masked_fill is aten's clone, then masked_fill_ on the clone), or where the
            # device measured aten's kernel below the copy rate (BatchNorm in inference)
            if len(real) < 2 and not (len(group) == 1 and real and (broadcast_channels_last(real[0])
                                                                    or _strided_row(real[0])
                                                                    or real[0].target in MASKED_FILLS
                                                                    or ctx.cost.slow_aten_batch_norm(real[0]))):
                continue
            label = f"{len(group)} pointwise ops {group[0].name} .. {group[-1].name}"
            ins, outs = _boundary(group)
            rows = _row_group(group, outs, ctx, grad)
            if rows:
                refuse(group, label, rows)
                continue
            if not outs:  # nothing reads the group (dead code): eliminate_dead_code's to remove
                refuse(group, label, "nothing reads its values (dead code)")
                continue
            hazard = _write_between(group, ins, outs, order, nodes)
            if hazard:
                refuse(group, label, hazard)
                continue
            r = ctx.replacement()  # the fused node as the rewrite would make it (rebuilt at apply time)
            try:
                args, pad = _fused_inputs(r, group, ins, lambda t: r.constant(t.shape, t.dtype, ir.info(outs[0]).device))
                program = _program(group, ins, outs, pad)  # expressible?
            except _NotExpressible as e:
                refuse(group, label, f"not expressible as a pointwise program: {e}")
                continue
            if len(args) > MAX_INPUTS or len(outs) > MAX_OUTPUTS:
                refuse(group, label, f"{len(args)} inputs / {len(outs)} outputs: over the program limit "
                                     f"({MAX_INPUTS} / {MAX_OUTPUTS})")
                continue
            if any(ir.info(n).dtype == torch.float64 for n in group) and \
                    not any(ir.info(a).dtype == torch.float64 for a in ins):
                refuse(group, label, "fp64 intermediates from lower-precision inputs (the program would compute them "
                                     "in fp32)")
                continue
            if not ctx.fused_kernels:
                res.reject(label, NO_FUSED_KERNELS)
                continue
            full = {tuple(ir.info(a).shape) for a in ins if ir.info(a) is not None}
            if program.concatenates:  # the outputs take the layout the pieces agree on (contiguous ones: none)
                from graphopt.cuda_ext.pointwise import broadcast_somewhere, stride_order

                pieces = [args[i].meta["val"] for i in program.cat_inputs()]
                orders = [stride_order(t) for t in pieces if not broadcast_somewhere(t)]
                if None not in orders and all(o == orders[0] for o in orders):
                    full.add(tuple(ir.info(outs[0]).shape))
            if program.reduces:  # the layout eager wrote, where one of the program's spellings writes it
                program = _eager_layout(program, args, outs)
                if program is None:
                    refuse(group, label, "its outputs' layout (eager's strides "
                                         f"{tuple(ir.info(outs[0]).stride or ())}) is none a reducing program writes")
                    continue
            if has_conv2d and any(len(ir.info(o).shape) == 4 and tuple(ir.info(o).shape) not in full
                                  and o in feeds_conv for o in outs):
                # the kernel's outputs take the layout of its full-size inputs (channels_last in,
                # channels_last out); an output no input has the shape of is written contiguous,
                # and inside the channels_last region convert_channels_last builds on this device
                # the next convolution would get NCHW again, at the profile's NCHW slowdown (a 4-D
                # tensor no convolution reads through 4-D values, CaiT's attention scores, is outside it)
                refuse(group, label, "writes NCHW outputs and would break the channels_last region "
                                     f"(NCHW convolutions measured {ctx.cost.conv_nchw_slowdown:g}x slower on "
                                     f"{ctx.cost.device_name})")
                continue
            r.call(torch.ops.graphopt.fused_pointwise.default, program.source, args, val=[o.meta.get("val") for o in outs])
            gain = ctx.node_time(group) - r.time()
            if program.reduces and gain <= 0:  # (its pointwise parts alone may still pay)
                refuse(group, label, f"predicted no gain ({gain * 1e6:+.2f} us)")
                continue
            if ctx.training and not program.reduces:  # (a reducing group takes no gradient: _row_group)
                gain += _backward_gain(ctx, group, ins, outs, program, grad)
            after = None if ctx.training or program.reduces else copy_after(group, outs)
            if after is not None:  # run in the index space of the copy after it, which then goes
                g_after = _gain_writing_copy(ctx, group, args, outs, program, *after)
                if g_after is not None and g_after > gain:
                    chain, copy = after
                    candidates.append(Candidate(
                        "pointwise group", [*group, *chain, copy], g_after,
                        lambda group=group, after=after: self._apply(gm, group, after),
                        label=f"{label}, writing the copy {copy.name} after it"))
                    continue
            candidates.append(Candidate("pointwise group", group, gain,
                                        lambda group=group: self._apply(gm, group), label=label))
        res.apply_ranked(ctx, candidates)
        return res

    @staticmethod
    def _eligible(ok: set) -> set:
        """The nodes this pass may group (all fusible ones)."""
        return ok

    # ------------------------------------------------------------------ grouping

    @staticmethod
    def _groups(gm, ok, order, merge: bool = True) -> list[list[fx.Node]]:
        """Connected components of fusible same-shape nodes, cut so no group depends on itself. A row
        reduction joins its input's group, and its per-row result (with the per-row ops after it) the
        ops that broadcast it back along the row. ``merge``: siblings reading a common tensor become one
        group (not in a training graph: one kernel fewer, but the merged node's backward holds both
        groups' values at once, which raised the T5 encoder's checkpoint minimum from below 0.3 to 0.36)."""
        per_row = _per_row(ok, order)
        # an expand joins only to broadcast a per-row value back along the row (elsewhere it stays a view)
        ok = {n for n in ok if n.target not in EXPANDS or n.args[0] in per_row}

        def joinable(a, n):
            sa, sn = tuple(ir.info(a).shape), tuple(ir.info(n).shape)
            if ir.info(a).device != ir.info(n).device:
                return False
            if sa == sn:
                return True
            if n.target in PADS:  # its operand's values, padded
                return n.args[0] is a
            if n.target in ROW_REDUCTIONS:  # a row into its reduction (kept dim or not)
                d = row_dim(n)
                return d is not None and sn in (sa[:d] + (1,) + sa[d + 1:], sa[:d] + sa[d + 1:])
            if n.target is ROW_UNSQUEEZE:  # the reduced dim put back
                return a.target in ROW_REDUCTIONS and len(sn) == len(sa) + 1 and \
                    sn == sa[:row_dim(a)] + (1,) + sa[row_dim(a):]
            # a per-row value broadcast back along the row (one dim of size 1 in it)
            return a in per_row and len(sa) == len(sn) and \
                sum(x != y for x, y in zip(sa, sn)) == 1 and all(x == y or x == 1 for x, y in zip(sa, sn))

        out = []
        pending = ir.connected_components(list(ok), order, joinable)
        while pending:
            group = pending.pop()
            good, rest = _cut_cycles(group, order)
            out.append(good)
            if rest:
                # the remainder may fall apart into several pieces: re-split by connectivity
                pending.extend(ir.connected_components(rest, order))
        out = [g for g in out if g]
        return _merge_siblings(out, order, joinable) if merge else out

    # ------------------------------------------------------------------ rewrite

    def _apply(self, gm, group, after=None) -> fx.Node:
        g = gm.graph
        order = {n: i for i, n in enumerate(g.nodes)}
        # inputs are outside the group: earlier rewrites may have replaced them, so read them now
        live_ins, outs = _boundary(group)
        anchor = max(live_ins, key=order.__getitem__, default=None)
        first = min(group, key=order.__getitem__)
        if anchor is not None and order[anchor] > order[first]:
            ctx_mgr = g.inserting_before(anchor.next)  # (in order: inserting_after puts each new node first)
        else:
            ctx_mgr = g.inserting_before(first)
        device = ir.info(outs[0]).device

        def const(t):
            a = g.get_attr(ir.register_constant(gm, f"{first.name}_pad", t.to(device)))
            a.meta["val"] = ir.get_attr_value(gm, a.target)
            return a

        with ctx_mgr:
            b = GraphBuilder(g)
            args, pad = _fused_inputs(b, group, live_ins, const)
            set_meta(gm, b.made)
            program = _program(group, live_ins, outs, pad)
            if program.reduces:
                program = _eager_layout(program, args, outs)
                if program is None:  # (an input an earlier rewrite replaced is laid out otherwise)
                    ir.erase_dead(gm, list(reversed(b.made)))
                    return None
            made_before = len(b.made)
            if after is not None and _through_copy(Replacement(None), ir.info(outs[0]).shape, args, program,
                                                   after[0]) is None:
                after = None  # (an input an earlier rewrite replaced cannot be seen through the views)
            if after is not None:
                args, program = copy_space(b, ir.info(outs[0]).shape, args, program, after[0])
            made = b.made[made_before:]  # (the views of the copy's index space)
            fused = g.call_function(torch.ops.graphopt.fused_pointwise.default, (program.source, args))
        with g.inserting_after(fused):
            items = []
            prev = fused
            for i in range(len(outs)):
                with g.inserting_after(prev):
                    prev = g.call_function(operator.getitem, (fused, i))
                items.append(prev)
        set_meta(gm, made + [fused] + items)
        if after is not None:
            chain, copy = after
            res = items[0]
            if tuple(ir.info(copy).shape) != tuple(ir.info(res).shape):  # a reshape: a view of the row-major result
                with g.inserting_after(res):
                    res = g.call_function(aten.view.default, (res, list(ir.info(copy).shape)))
                set_meta(gm, [res])
            copy.replace_all_uses_with(res)
            ir.erase_dead(gm, [copy, *reversed(chain)])
        pos = {n: i for i, n in enumerate(g.nodes)}
        # a reader of an early output can come before the fused node (which follows the group's last
        # input): the group has no path back into itself (_cut_cycles), so a topological order exists
        read_early = any(u not in group and u.op != "output" and pos[u] < pos[item]
                         for o, item in zip(outs, items) for u in o.users)
        for o, item in zip(outs, items):
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in group)
        ir.erase_dead(gm, group)
        if read_early:
            toposort_stable(g)
        return fused


_requires_grad = requires_grad  # (the tests' name)

_PASS_THROUGH = {aten.add.Tensor, aten.add.Scalar}  # autograd hands the gradient on without a kernel


def _backward_gain(ctx, group, ins, outs, program, grad) -> float:
    """Predicted seconds the fused backward saves: eager's derivative kernels of ``group`` (priced
    as an elementwise kernel of each node's shape per operand taking a gradient, plus an add per
    extra use of a value) minus the backward program's kernel."""
    from graphopt.cuda_ext.pointwise_grad import backward_program

    gs = set(group)
    eager = ctx.replacement()
    for n in group:
        takes = [a for a in _operands(n) if isinstance(a, fx.Node) and grad.get(a, False)]
        if n.target in _PASS_THROUGH and _alpha(n) == 1:
            takes = []
        elif n.target in (aten.sub.Tensor, aten.sub.Scalar) and takes and takes[0] is _operands(n)[0]:
            takes = takes[1:]  # the first operand's gradient passes through
        for _ in takes:
            eager.call(aten.mul.Tensor, n, n)
    for v in list(group) + list(ins):
        if grad.get(v, False):
            uses = [u for u in v.users if u in gs]
            for _ in uses[1:]:
                eager.call(aten.add.Tensor, v, v)
    in_vals = [a.meta.get("val") for a in ins]
    if any(not isinstance(t, torch.Tensor) for t in in_vals):
        return 0.0
    bw = backward_program(program.source, tuple(t.dtype for t in in_vals), tuple(grad.get(a, False) for a in ins),
                          tuple(o.meta["val"].dtype.is_floating_point for o in outs))
    if bw.source is None:
        return eager.time()
    fused = ctx.replacement()
    fused.call(torch.ops.graphopt.fused_pointwise.default, bw.source,
               [ins[i] for i in bw.inputs] + [outs[j] for j in bw.grads])  # a gradient is shaped as its output
    return eager.time() - fused.time()


def _is_free(ctx, n) -> bool:
    return ir.concrete(ctx.cost.node_cost(n).time_s, ctx.hints) == 0


def _per_row(ok, order) -> set:
    """The row reductions among ``ok`` and the fusible nodes of their result's shape downstream of them
    (sqrt of a sum of squares, clamp_min): values computed once per row in a reducing program."""
    out = set()
    for n in sorted(ok, key=order.__getitem__):
        if n.target in ROW_REDUCTIONS or (n.target is ROW_UNSQUEEZE and n.args[0] in out):
            out.add(n)
        elif any(a in out and tuple(ir.info(a).shape) == tuple(ir.info(n).shape) for a in n.all_input_nodes):
            out.add(n)
    return out


def _row_group(group, outs, ctx, grad) -> str:
    """'' when ``group`` has no row reduction, or its reductions can run as one program (one full
    shape, reduced over one dim; only full rows read outside; inference), else why not."""
    reducing = [n for n in group if n.target in ROW_REDUCTIONS or n.target in SOFTMAXES]
    if not reducing:
        return ""
    shape = tuple(ir.info(reducing[0].args[0]).shape)
    if any(tuple(ir.info(r.args[0]).shape) != shape for r in reducing):
        return "row reductions of different shapes"
    if len({row_dim(r) for r in reducing}) > 1:
        return ROWS_ALONG_DIMS
    d = row_dim(reducing[0])
    row = shape[:d] + (1,) + shape[d + 1:]
    for n in group:
        if tuple(ir.info(n).shape) not in (shape, row, shape[:d] + shape[d + 1:]):
            return f"{n.name} is neither a row {shape} nor a per-row value"
    for o in outs:
        if tuple(ir.info(o).shape) != shape:
            return f"the per-row value {o.name} is read outside the group (a program's outputs are full rows)"
        if o.target in EXPANDS:
            return f"the broadcast view {o.name} is read outside the group (fusing would copy it)"
    if ctx.training and any(grad.get(n) for n in group):
        return "a row reduction with a gradient (the program's backward has no row reductions)"
    return ""


def _feeding_convolutions(gm: fx.GraphModule) -> set:
    """The nodes a conv2d reads through 4-D values only (the activations of a channels_last region:
    a 4-D tensor that reaches a convolution only through a 3-D view is not one)."""
    seen: set = set()
    stack = [a for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.conv2d.default
             for a in n.args[:1] if isinstance(a, fx.Node)]
    while stack:
        n = stack.pop()
        info = ir.info(n)
        if n in seen or info is None or len(info.shape) != 4:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _eager_layout(program, args, outs):
    """``program``, or the spelling of it (the row dim named, making the outputs follow the inputs'
    layout; or ``layout row_major``) whose outputs have the strides eager's ``outs`` have; None where
    none does."""
    from graphopt.cuda_ext.pointwise import Program, dense_order, empty_in_order

    vals = [a.meta.get("val") for a in args]
    eager = [o.meta.get("val") for o in outs]
    if any(not isinstance(v, torch.Tensor) for v in vals + eager):
        return None
    shape = tuple(eager[0].shape)
    nd = len(shape)
    dim = program.row_dim(nd)
    for p in (program, Program(list(program.stmts), list(program.outputs), reduce_dim=dim),
              Program(list(program.stmts), list(program.outputs), reduce_dim=dim, row_major=True)):
        order = dense_order(vals, shape, p)
        written = empty_in_order(shape, order, torch.float32, "meta").stride()
        if all(_same_strides(shape, written, e.stride()) for e in eager):
            return p.validate()
    return None


def _same_strides(shape, a, b) -> bool:
    """Strides ``a`` and ``b`` lay out a tensor of ``shape`` alike (size-1 dims ignored)."""
    return all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def _boundary(group):
    gs = set(group)
    ins = []
    for n in group:
        for a in (_operands(n) if n.target in (aten.expand_as.default, aten.batch_norm.default, aten.type_as.default)
                  else n.all_input_nodes):
            if not isinstance(a, fx.Node):
                continue
            if a not in gs and a not in ins:
                ins.append(a)
    outs = [n for n in group if any(u not in gs for u in n.users)]
    return ins, outs


def _write_between(group, ins, outs, order, nodes) -> str:
    """'' unless the fused node, placed after its last input, would follow a reader of one of its
    values and an in-place write between the two: moving the reader's producers ahead of it
    (toposort_stable) would move them across the write, which the graph's edges do not show (a
    slice of a tensor filled in place, then the tensor read)."""
    gs = set(group)
    at = max([order[a] for a in ins] + [min(order[n] for n in group)])
    early = [order[u] for o in outs for u in o.users if u not in gs and u.op != "output" and order[u] < at]
    for n in nodes[min(early):at] if early else ():
        if ir.written(n):
            return (f"a reader of its values comes before {n.name}, an in-place write the fused kernel would have "
                    "to be moved across")
    return ""


def _cut_cycles(group, order):
    """Split ``group`` into (good, rest): good has no path group -> outside -> group."""
    gs = set(group)
    hi = order[group[-1]]
    # outside nodes between the group's first and last node that depend on the group
    tainted = set()
    node = group[0]
    while node is not None and order.get(node, hi + 1) <= hi:
        if node not in gs and any(a in gs or a in tainted for a in node.all_input_nodes):
            tainted.add(node)
        node = node.next if node.next.op != "root" else None
    bad = {n for n in group if any(a in tainted for a in n.all_input_nodes)}
    if not bad:
        return group, []
    # everything in the group downstream of a bad node goes to the remainder
    rest = set()
    for n in group:
        if n in bad or any(a in rest for a in n.all_input_nodes):
            rest.add(n)
    return [n for n in group if n not in rest], [n for n in group if n in rest]


def _merge_siblings(groups, order, joinable) -> list[list[fx.Node]]:
    """Groups that read a common tensor from outside, of one shape and device, neither depending on
    the other, merged into one (one kernel reads the shared tensor once and writes both groups'
    outputs: the cos and sin of one rotary angle table), within the program's input and output limits.
    Of the groups reading one tensor, only neighbours in graph order within MERGE_SPAN positions are
    tried (the check for a path between two groups walks the nodes between them; siblings far apart,
    one per layer, depend on each other), and a pair that failed is not tried again."""
    groups = [sorted(g, key=order.__getitem__) for g in groups]
    failed: set = set()
    while True:
        readers: dict = {}
        for g in sorted(groups, key=lambda g: order[g[0]]):
            for a in _boundary(g)[0]:
                readers.setdefault(a, []).append(g)
        pair = None
        for seq in readers.values():
            for a, b in zip(seq, seq[1:]):
                key = (tuple(a), tuple(b))
                if key in failed:
                    continue
                failed.add(key)
                if max(order[a[-1]], order[b[-1]]) - order[a[0]] > MERGE_SPAN or not joinable(a[0], b[0]):
                    continue
                both = sorted(a + b, key=order.__getitem__)
                ins, outs = _boundary(both)
                if len(ins) <= MAX_INPUTS and len(outs) <= MAX_OUTPUTS and not _cut_cycles(both, order)[1]:
                    pair = (a, b, both)
                    break
            if pair:
                break
        if pair is None:
            return groups
        a, b, both = pair
        groups = [g for g in groups if g is not a and g is not b] + [both]


ROWS_ALONG_DIMS = "row reductions along different dims"
ROWS_AND_CAT = "a row reduction and a concatenation (a program reads a catin or reduces rows, not both)"


def _strided_row(n: fx.Node) -> bool:
    """A row reduction or softmax over a dim other than the last whose row is not contiguous in its
    input (aten copies the input first, or reduces in its strided kernel; the program's kernel reads
    adjacent rows together). A strided last dim is not one: the row kernel would read it strided."""
    if n.target not in ROW_REDUCTIONS and n.target not in SOFTMAXES:
        return False
    xi, d = ir.info(n.args[0]), row_dim(n)
    return (d is not None and xi is not None and xi.stride is not None and d != len(xi.shape) - 1
            and xi.shape[d] != 1 and xi.stride[d] != 1)


def _correction(node) -> float:
    """Bessel's correction of a var node (var.dim's ``unbiased``, var.correction's ``correction``)."""
    if node.target is aten.var.dim:
        return 1.0 if get_arg(node, 2, "unbiased", True) else 0.0
    c = node.kwargs.get("correction")
    return 1.0 if c is None else float(c)


def _reduce(p, n, x):
    if n.target in _LOG_SOFTMAXES:
        s = x - p.rmax(x)
        return s - p.log(p.rsum(p.exp(s)))
    if n.target in SOFTMAXES:
        e = p.exp(x - p.rmax(x))
        return e / p.rsum(e)
    row = ir.info(n.args[0]).shape[row_dim(n)]
    if n.target in (aten.var.dim, aten.var.correction):
        d = x - p.rsum(x) * (1.0 / row)
        return p.rsum(d * d) * (1.0 / (row - _correction(n)))
    if n.target is aten.amax.default:
        return p.rmax(x)
    if n.target is aten.linalg_vector_norm.default:
        return p.sqrt(p.rsum(x * x))
    s = p.rsum(x)
    return s * (1.0 / row) if n.target is aten.mean.dim else s


def _program(group, ins, outs, pad=None):
    """The group as a pointwise program over ``ins`` (then the pad's zero pieces and mask, where
    ``pad`` is _fused_inputs' plan: (the pad node, {input position: (its zero pieces' positions)},
    the mask's position))."""
    from graphopt.cuda_ext.pointwise import Program

    reducing = [n for n in group if n.target in ROW_REDUCTIONS or n.target in SOFTMAXES]
    d = row_dim(reducing[0]) if reducing else None
    p = Program(reduce_dim=None if d is None or d == len(ir.info(reducing[0].args[0]).shape) - 1 else d)
    cats = [n for n in group if n.target is aten.cat.default]
    if cats and reducing:
        raise _NotExpressible(ROWS_AND_CAT)
    listed = [a for n in cats for a in n.args[0]]
    pieces = set(listed)
    if pieces:
        if len({get_arg(n, 1, "dim", 0) % len(ir.info(n).shape) for n in cats}) > 1:
            raise _NotExpressible("concatenations along different dims")
        gs = set(group)
        if len(pieces) < len(listed) or any(a in gs for a in pieces) or \
                any(u in gs and u.target is not aten.cat.default for a in pieces for u in a.users):
            raise _NotExpressible("a concatenated tensor is also read by another op of the group")
    padded = pad[1] if pad is not None else {}
    vals = {a: p.input(i) for i, a in enumerate(ins) if a not in pieces and i not in padded}
    if pad is not None:
        pad_node, padded, mask_at = pad
        dim = pad_args(pad_node)[0]
        for i, ends in padded.items():  # read at its padded index, zero around it
            vals[ins[i]] = p.catin(dim, [j for j in (ends[0], i, ends[1]) if j is not None])
        mask = p.input(mask_at)
    for n in group:
        if n.target in PADS:
            vals[n] = p.where(mask, vals[n.args[0]], pad_args(n)[3])
            continue
        if n.target is aten.batch_norm.default:
            x, scale, shift = (vals[a] for a in _operands(n))
            vals[n] = x * scale + shift
            continue
        if n.target is aten.cat.default:
            vals[n] = p.catin(get_arg(n, 1, "dim", 0) % len(ir.info(n).shape), [ins.index(a) for a in n.args[0]])
            continue
        if n.target in CASTS:
            vals[n] = p.cast(vals[n.args[0]], ir.info(n).dtype)
            continue
        if n.target in EXPANDS or n.target is ROW_UNSQUEEZE:  # broadcasting is the program's own
            vals[n] = vals[n.args[0]]
            continue
        if n.target in ROW_REDUCTIONS or n.target in SOFTMAXES:
            vals[n] = _reduce(p, n, vals[n.args[0]])
            continue
        operands = [vals[a] if isinstance(a, fx.Node) else a for a in _operands(n)]
        v = OPS[n.target](p, n, operands)
        if not hasattr(v, "id"):
            raise _NotExpressible(f"{n.name} folds to a constant")
        vals[n] = v
    for o in outs:
        p.output(vals[o], ir.info(o).dtype)
    return p.validate()



# ---------------------------------------------------------------------- a copy after the group

# views a group's value may reach a copy through; each is replayed on the group's inputs
_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints)
# the views view_through replays (other passes follow a value's readers through the same ones)
VIEW_OPS = _PERMUTES + _RESHAPES
_COPIES = (aten.clone.default, aten.contiguous.default, aten.reshape.default)
_MAX_CHAIN = 6


def _makes_contiguous_copy(n: fx.Node) -> bool:
    """``n`` copies a tensor that is not laid out row-major into a row-major one of the same dtype
    (``clone``, ``contiguous``, or a ``reshape`` its input cannot be viewed as)."""
    if n.target not in _COPIES or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    xi, ni = ir.info(n.args[0]), ir.info(n)
    if not (concrete_layout(xi) and concrete_layout(ni)) or xi.dtype != ni.dtype or xi.device != ni.device:
        return False
    if ir.is_contiguous(xi) or not ir.is_contiguous(ni):
        return False
    if n.target is aten.reshape.default:
        return not ir.reshape_is_view(xi, ni.shape)
    extra = set(n.kwargs) - {"memory_format"}
    return not extra and tuple(ni.shape) == tuple(xi.shape)


def copy_after(group, outs) -> tuple[list[fx.Node], fx.Node] | None:
    """(views, copy) when the group's one output is read, outside the group, only through a chain of
    views (each read once) ending in a copy that makes it row-major (a ``transpose(1, 2).reshape(B, N, C)``
    after the pointwise ops of an attention's output): the group can run in the index space the copy
    writes instead, its inputs seen through the same views, and the copy goes."""
    if len(outs) != 1:
        return None
    gs = set(group)
    readers = [u for u in outs[0].users if u not in gs]
    if len(readers) != 1:
        return None
    chain, n = [], readers[0]
    while len(chain) <= _MAX_CHAIN:
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        if _makes_contiguous_copy(n):
            return chain, n
        if n.target not in _PERMUTES + _RESHAPES or len(n.users) != 1 or not concrete_layout(ir.info(n)):
            return None
        if n.target is aten.reshape.default and not ir.reshape_is_view(ir.info(n.args[0]), ir.info(n).shape):
            return None
        chain.append(n)
        n = next(iter(n.users))
    return None


def view_through(b, a: fx.Node, shape, chain: list[fx.Node], expand: bool = True) -> fx.Node:
    """``a`` broadcast to the group's ``shape`` (unless ``expand`` is False: a catin's piece, full rank
    already) and taken through ``chain``'s views, built with ``b`` (a Replacement to price it, a
    GraphBuilder to make it); a view that would need a copy raises (RuntimeError from the fake tensors)."""
    x = a
    if expand and tuple(ir.info(a).shape) != tuple(shape):
        x = b.call(aten.expand.default, x, list(shape))
    for v in chain:
        if v.target in _PERMUTES:
            x = b.call(v.target, x, *v.args[1:])
        else:
            x = b.call(aten.view.default, x, list(ir.info(v).shape))
    return x


def _permutation(chain: list[fx.Node], rank: int) -> list[int] | None:
    """The dims of the group's shape in the order ``chain`` (permutes only) leaves them, or None."""
    perm = list(range(rank))
    for v in chain:
        if v.target not in _PERMUTES:
            return None
        perm = [perm[d] for d in perm_of(v, rank)]
    return perm


def copy_space(b, shape, args, program, chain):
    """(the fused node's inputs seen through ``chain``, the program that writes row-major there): a
    catin's pieces keep their own size along its dim, which the views may only permute."""
    from graphopt.cuda_ext.pointwise import Program, with_cat_dims

    cats = program.cat_inputs()
    if cats:
        perm = _permutation(chain, len(shape))
        if perm is None:
            raise _NotExpressible("a concatenated dim seen through a view that is not a permute")
        dims = [perm.index(s.attrs[0] + len(shape) - len(ir.info(args[s.attrs[1][0]]).shape))
                for s in program.stmts if s.op == "catin"]
        program = with_cat_dims(program, dims)
    viewed = [view_through(b, a, shape, chain, expand=i not in cats) for i, a in enumerate(args)]
    return viewed, Program(list(program.stmts), list(program.outputs), row_major=True)


def _through_copy(r, shape, args, program, chain):
    """The fused node, built on the scratch graph ``r`` (a Replacement) with ``args`` seen through
    ``chain``, or None where a view would need a copy or the kernel would not write row-major."""
    try:
        viewed, prog = copy_space(r, shape, args, program, chain)
        fused = r.call(torch.ops.graphopt.fused_pointwise.default, prog.source, viewed)
    except (RuntimeError, ValueError, _NotExpressible):
        return None
    val = fused.meta.get("val")
    return fused if val and val[0].is_contiguous() else None


def _gain_writing_copy(ctx, group, args, outs, program, chain, copy) -> float | None:
    """Predicted seconds saved by the group (its fused node's inputs ``args``, priced on another scratch
    graph) run in the index space of ``copy`` (with it and its views gone), or None where it cannot."""
    r = ctx.replacement()
    if _through_copy(r, ir.info(outs[0]).shape, args, program, chain) is None:
        return None
    return ctx.node_time([*group, *chain, copy]) - r.time()


# ---------------------------------------------------------------------- a pad in the group

def _pad_plan(group):
    """None for a group without a pad; else (pad, the group's nodes it reads through): those are
    computed at its operand's shape and read only by each other and the pad; every other node has the
    pad's shape."""
    pads = [n for n in group if n.target in PADS]
    if not pads:
        return None
    if len(pads) > 1:
        raise _NotExpressible("more than one pad")
    if any(n.target in ROW_REDUCTIONS or n.target in SOFTMAXES or n.target is aten.cat.default for n in group):
        raise _NotExpressible("a pad with a row reduction or a concatenation")
    pad = pads[0]
    gs, under, stack = set(group), set(), [pad.args[0]]
    while stack:
        n = stack.pop()
        if n in gs and n not in under:
            under.add(n)
            stack.extend(n.all_input_nodes)
    small, big = tuple(ir.info(pad.args[0]).shape), tuple(ir.info(pad).shape)
    for n in group:
        if n in under:
            if tuple(ir.info(n).shape) != small or any(u not in under and u is not pad for u in n.users):
                raise _NotExpressible(f"{n.name} is read beside the pad")
        elif n is not pad and tuple(ir.info(n).shape) != big:
            raise _NotExpressible(f"{n.name} has neither the pad's shape nor its operand's")
    return pad, under


def _fused_inputs(b, group, ins, const):
    """(the fused node's inputs, the pad's reading plan for _program or None). Without a pad: ``ins``.
    With one, pad(f(x, ...)) = where(mask, f(catin(0, x, 0), ...), fill): each input the pad's operand
    is computed from, where it varies along the padded dim, is read through a ``catin`` between zero
    pieces (a 0-d constant expanded: no memory), so the operand's values land at their padded index;
    ``mask`` (a boolean constant along the padded dim) says where they are. Built with ``b`` (a
    Replacement or a GraphBuilder); ``const(tensor)`` makes a constant node."""
    plan = _pad_plan(group)
    if plan is None:
        return list(ins), None
    pad, under = plan
    d, lo, hi, _ = pad_args(pad)
    gs = set(group)
    small, big = list(ir.info(pad.args[0]).shape), list(ir.info(pad).shape)
    rank = len(small)
    args, extra, pieces = list(ins), [], {}
    through = under | {pad}  # (the pad itself reads an input that is its operand)
    for i, a in enumerate(ins):
        readers = [u for u in a.users if u in gs]
        if not any(u in through for u in readers):
            continue
        if any(u not in through for u in readers):
            raise _NotExpressible(f"{a.name} is read both through the pad and beside it")
        ai = ir.info(a)
        k = len(ai.shape) - (rank - d)
        if k < 0 or ai.shape[k] == 1:
            continue  # (broadcast along the padded dim: the same value at every index)
        if list(ai.shape) != small:
            args[i] = b.call(aten.expand.default, a, small)
        zero = const(torch.zeros((), dtype=ai.dtype))
        ends = []
        for w in (lo, hi):
            if w:
                extra.append(b.call(aten.expand.default, zero, small[:d] + [w] + small[d + 1:]))
                ends.append(len(ins) + len(extra) - 1)
            else:
                ends.append(None)
        pieces[i] = tuple(ends)
    mask = torch.zeros([big[d]] + [1] * (rank - 1 - d), dtype=torch.bool)
    mask[lo:lo + small[d]] = True
    extra.append(const(mask))
    return args + extra, (pad, pieces, len(ins) + len(extra) - 1)


# ---------------------------------------------------------------------- views between two groups

def sink_views(gm: fx.GraphModule, dtypes, max_rounds: int = 8) -> int:
    """``y = f(x, ...); z = views(y); g(z, ...)`` with f and g pointwise, y read only by the views and each
    view read once: f is computed after the views instead, ``f(views(x), ...)`` with each operand broadcast
    to y's shape and seen through the same views (a layer scale over NHWC values, permuted back to NCHW,
    then the residual add: one group). Not where a view of an operand would need a copy. Returns how many
    ops moved."""
    moved = 0
    for _ in range(max_rounds):
        done = 0
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or getattr(n, "_erased", False) or fusible(n, dtypes) or _is_view_like(n):
                continue
            for a in list(n.all_input_nodes):
                done += _sink_into(gm, a, dtypes)
        moved += done
        if not done:
            break
    return moved


def _is_view_like(n: fx.Node) -> bool:
    return n.target in _PERMUTES + _RESHAPES or n.target in EXPANDS


def _sink_into(gm: fx.GraphModule, a: fx.Node, dtypes) -> int:
    """Move the pointwise op at the far end of the view chain ending in ``a`` past it (1), or 0."""
    chain, x = [], a
    while x.op == "call_function" and x.target in _PERMUTES + _RESHAPES and len(x.users) == 1 \
            and concrete_layout(ir.info(x)) and isinstance(x.args[0], fx.Node):
        chain.append(x)
        x = x.args[0]
    if not chain or x.op != "call_function" or len(x.users) != 1 or (x.target not in OPS and x.target not in CASTS) \
            or fusible(x, dtypes) or not concrete_layout(ir.info(x)):
        return 0
    chain.reverse()  # from x outward
    shape = ir.info(x).shape
    tensors = [t for t in _operands(x) if isinstance(t, fx.Node)]
    r = Replacement(None)
    try:  # every operand seen through the views without a copy
        for t in tensors:
            view_through(r, t, shape, chain)
    except (RuntimeError, ValueError):
        return 0
    g = gm.graph
    with g.inserting_before(chain[-1]):
        b = GraphBuilder(g)
        seen = {t: view_through(b, t, shape, chain) for t in tensors}
        args = tuple(seen.get(v, v) if isinstance(v, fx.Node) else v for v in x.args)
        new = b.call(x.target, *args, **x.kwargs)
    set_meta(gm, b.made)
    chain[-1].replace_all_uses_with(new)
    ir.erase_dead(gm, [*reversed(chain), x])
    return 1
