"""Helpers shared by the passes: fake-tensor metadata for nodes a pass creates, so that later
candidates and later passes can prove things from ``meta["val"]`` before the manager
re-propagates; GraphBuilder, so one function builds a rewrite's nodes for its price (on the cost
model's scratch graph) and for the rewrite; a projection's sizes; a convolution's pair arguments;
which values of a training graph take a gradient; an inference BatchNorm as its per-channel affine.
Not a pass (the leading underscore keeps passes/__init__ from importing it as one)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphopt import ir


# readers whose result depends on their input's strides, not only its values: a rewrite that changes
# a tensor's layout must not reach one
STRIDE_READERS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default,
                  torch.ops.aten.view_as.default}


def fake_mode(gm: fx.GraphModule):
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def set_meta(gm: fx.GraphModule, nodes) -> None:
    """Compute ``meta['val']`` of each new node (in order) from its inputs' fake values."""
    mode = fake_mode(gm)
    if mode is None:
        return
    prev = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        for n in nodes:
            if n.op == "get_attr":
                n.meta["val"] = mode.from_tensor(ir.get_attr_value(gm, n.target), static_shapes=True)
                continue
            if n.op != "call_function":
                continue

            def load(a):
                return a.meta.get("val") if isinstance(a, fx.Node) else a

            args = fx.node.map_aggregate(n.args, load)
            kwargs = fx.node.map_aggregate(n.kwargs, load)
            with mode:
                n.meta["val"] = n.target(*args, **kwargs)
    finally:
        mode.allow_non_fake_inputs = prev


def projection_mnk(x, w, out: fx.Node, dtypes, symbolic: str):
    """``("", (M, N, K, dtype))`` for ``out = linear(x, w)`` when its metadata is present, w is 2-D, x, w
    and out share one of ``dtypes`` and the shapes are concrete; else ``(why not, None)``
    (``symbolic``: why the rewrite needs one size)."""
    xi = ir.info(x) if isinstance(x, fx.Node) else None
    wi = ir.info(w) if isinstance(w, fx.Node) else None
    oi = ir.info(out)
    if xi is None or wi is None or oi is None or not xi.shape:
        return "no tensor metadata", None
    if len(wi.shape) != 2:
        return f"weight {w.name} is {len(wi.shape)}-D", None
    if xi.dtype not in dtypes or wi.dtype != xi.dtype or oi.dtype != xi.dtype:
        names = [str(d).replace("torch.", "") for d in dtypes]
        allowed = " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]
        return f"dtypes {xi.dtype}/{wi.dtype} ({allowed}, the same for input and weight)", None
    if xi.symbolic or wi.symbolic:
        return f"symbolic shapes ({symbolic})", None
    K, N = int(xi.shape[-1]), int(wi.shape[0])
    return "", (int(xi.numel) // K if K else 0, N, K, xi.dtype)


class GraphBuilder:
    """``call(target, *args, **kwargs)`` on a real graph at its insertion point, as
    graphopt.cost.replacement.Replacement has on a scratch one: one function that builds a
    rewrite's nodes serves both its price and the rewrite."""

    def __init__(self, g: fx.Graph, meta_of: fx.GraphModule | None = None):
        self.g = g
        self.meta_of = meta_of  # set each node's metadata as it is made (a builder that reads its dtypes)
        self.made: list[fx.Node] = []  # the nodes made, in order (for the rewrite's set_meta)

    def call(self, target, *args, val=None, **kwargs) -> fx.Node:
        """A node at the insertion point (``val`` is for scratch nodes: a rewrite's set_meta computes these)."""
        n = self.g.call_function(target, args, kwargs)
        self.made.append(n)
        if self.meta_of is not None:
            set_meta(self.meta_of, [n])
        return n


def stored_view(gm: fx.GraphModule, attr: fx.Node, view, prefix: str) -> fx.Node:
    """A get_attr node (at the insertion point) of ``view(value)``, ``value`` the constant ``attr``
    reads: a bias reshaped or sliced once at optimization time, where a node would run at every call.
    Inference only (a stored view carries no gradient to the parameter)."""
    value = ir.get_attr_value(gm, attr.target).detach()
    return gm.graph.get_attr(ir.register_constant(gm, prefix, view(value)))


def dense_channels_last(t: ir.TensorInfo) -> bool:
    """A 4-D tensor laid out exactly as NHWC in memory (strides H*W*C, 1, W*C, C)."""
    if t is None or t.stride is None or len(t.shape) != 4:
        return False
    n, c, h, w = t.shape
    want = (h * w * c, 1, w * c, c)
    return all(s == e or d == 1 for s, e, d in zip(t.stride, want, t.shape)) and c != 1


def dense_layout(t: ir.TensorInfo) -> bool | None:
    """True for a dense channels_last 4-D tensor, False for a contiguous one (a tensor that is both
    counts as contiguous), None for neither (a lowering that writes its own output keeps the layout
    aten's node wrote, so readers' views hold)."""
    if t is None or t.stride is None or len(t.shape) != 4 or t.symbolic:
        return None
    if ir.is_contiguous(t):
        return False
    return True if dense_channels_last(t) else None


def conv_pair(v, default):
    """A convolution's stride/padding/dilation argument as a [h, w] list (an int, a 1- or 2-list, or
    None for ``default``)."""
    if v is None:
        v = default
    if isinstance(v, int):
        return [v, v]
    v = list(v)
    return v * 2 if len(v) == 1 else v


def int_pairs(node: fx.Node, names) -> list | None:
    """The node's arguments ``names`` (((position, name), ...)) as [h, w] integer pairs (:func:`conv_pair`),
    or None where one is not two integers (a window op's kernel, dilation, padding and stride)."""
    from graphopt.matcher import get_arg

    args = [conv_pair(get_arg(node, i, name), None) for i, name in names]
    if any(len(a) != 2 or not all(isinstance(x, int) for x in a) for a in args):
        return None
    return args


def nbytes(ti: ir.TensorInfo, hints) -> float:
    """Bytes of a tensor at the example sizes (what a rewrite that copies it stores)."""
    return ir.concrete(ti.nbytes, hints)


def requires_grad(gm) -> dict:
    """{node: its output takes a gradient}: parameters and inputs that require grad, and the
    floating values computed from them (comparisons and casts to bool stop it)."""
    out = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "get_attr":
            try:
                out[n] = bool(getattr(ir.get_attr_value(gm, n.target), "requires_grad", False))
            except AttributeError:
                out[n] = False
        elif n.op == "placeholder":
            out[n] = bool(getattr(val, "requires_grad", False))
        else:
            vals = val if isinstance(val, (tuple, list)) else [val]
            floating = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
            out[n] = floating and any(out.get(a, False) for a in n.all_input_nodes)
    return out


def inference_affine(gm: fx.GraphModule, n: fx.Node):
    """(scale, shift, the get_attr nodes it reads) of an inference ``aten.batch_norm`` with constant
    statistics (and affine, if any): ``batch_norm(x) = x * scale + shift`` per channel, both float64
    vectors computed once; None for any other node."""
    from graphopt.matcher import get_arg

    if n.op != "call_function" or n.target is not torch.ops.aten.batch_norm.default or get_arg(n, 5, "training", True):
        return None
    eps = get_arg(n, 7, "eps", None)
    params = [get_arg(n, i, k, None) for i, k in ((1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))]
    if (not isinstance(eps, float) or params[2] is None or params[3] is None
            or any(a is not None and (not isinstance(a, fx.Node) or a.op != "get_attr") for a in params)):
        return None
    gamma, beta, mean, var = (None if a is None else ir.get_attr_value(gm, a.target).detach().double() for a in params)
    scale = torch.rsqrt(var + eps) * (gamma if gamma is not None else 1.0)
    shift = (beta if beta is not None else 0.0) - mean * scale
    return scale, shift, [a for a in params if a is not None]
