"""Op classes, and the per-class corrections ``graphopt calibrate --corpus`` fits.

A node's class is a path of tags read from the node itself (its op, shapes, strides, dtypes and
arguments, never a model's name), most general first::

    gemm/f32/a16/m4k        linear, mm, addmm...: N and K multiples of 16 (a8: of 8; odd; small_m: M <= 16),
                            then M (m256, m4k, mbig)
    bmm/bf16/small          batched products (bmm, baddbmm, matmul with batch dims) of at most 64^3 per matrix
    conv/bf16/depthwise/cl/m256  convolutions: dense / grouped / depthwise / transposed, channels_last /
                            nchw / nd, output pixels (batch x height x width: the implicit GEMM's M)
    sdpa/bf16/float/causal  attention by mask (none, bool, float: additive) and causality
    softmax/row512/contig   softmax by row length and input layout (contig, cl, strided)
    norm/layer_norm/row64/contig  norms by row length and layout (batch_norm: norm/batch_norm/<layout>)
    reduce/row4k/sum        sums, means, maxima... by the length they reduce, and op
    pointwise/float/bcast/add  elementwise, by dtype family, inputs (same, bcast, strided) and op
    copy/strided/clone      copies by stride pattern (contiguous, strided, narrow; cat, pad) and op
    gather/embedding, pool/max_pool2d, factory/<op>, view/<op> (no kernel), op/<name>
    graphopt/conv_bias_relu/bf16/grouped/cl/mbig  graphopt's own ops by name, and where the op declares the
                            class of the ATen op it replaces (graphopt.cost.ops.register_op_class), that
                            class's tags after its family: a fit for dense convolutions is not a grouped one's

The profile's ``op_class_fit`` (DeviceProfile) holds a fit per class path ("conv/f32/depthwise");
a node takes the fit of its longest prefix whose fit covers its predicted time. A fit is a curve of
ln(measured / predicted) against ln(predicted seconds), piecewise linear between ``knots`` (flat
beyond them), applying up to a little above the largest predicted time it was fitted on (a node far
larger takes a more general class's fit, or none), or, for a class the model prices at nothing
(views on the CPU), ``fixed_s`` seconds per node.

Two forms. A combined fit (``classes``, fitted on each node's time alone, host and device
together) multiplies a node's host and device time alike, read at its NodeCost time. A split fit
(``device_classes`` and ``host_classes``, fitted where the corpus measured each node's device time
alone and its host issue time: :func:`is_split`) corrects the two apart: the device curves are read
at the node's uncorrected device time and multiply it, the host curves are read at its uncorrected
host time and multiply it (plus a host entry's ``add_s``).
"""

from __future__ import annotations

import bisect
import math

import torch
import torch.fx as fx

from .. import ir

SEP = "/"
SMALL_M = 16  # gemm rows at or under which a projection is "small_m" (a decode step's weight stream)
SMALL_BMM = 64 ** 3  # M * N * K per matrix at or under which a batched product is "small"
ROW_BUCKETS = ((64, "row64"), (512, "row512"), (4096, "row4k"))
SOFTMAX_OPS = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
NORM_OPS = {"layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "rms_norm", "_fused_rms_norm",
            "batch_norm", "native_batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
            "instance_norm"}
REDUCE_OPS = {"sum", "mean", "amax", "amin", "var", "std", "var_mean", "std_mean", "max", "min", "argmax", "argmin",
              "cumsum", "cumprod", "prod", "any", "all", "logsumexp", "norm", "linalg_vector_norm"}
GATHER_OPS = {"embedding", "index_select", "index", "gather", "take", "masked_select"}
POOL_OPS = {"max_pool2d", "avg_pool2d", "max_pool2d_with_indices", "adaptive_avg_pool2d", "adaptive_max_pool2d",
            "max_pool1d", "avg_pool1d", "max_pool3d", "avg_pool3d", "adaptive_avg_pool1d"}
CAT_OPS = {"cat", "stack", "concat", "hstack", "vstack"}
PAD_OPS = {"pad", "constant_pad_nd", "reflection_pad2d", "replication_pad2d"}
BATCHED_MATMUL = {"bmm", "baddbmm"}


def _int(v):
    try:
        return int(v)
    except TypeError:  # symbolic
        return None


def dtype_tag(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
            torch.bool: "bool"}.get(dtype, "int" if not dtype.is_floating_point else str(dtype).replace("torch.", ""))


def _family(dtype: torch.dtype) -> str:
    return "float" if dtype.is_floating_point else ("bool" if dtype == torch.bool else "int")


def row_bucket(n) -> str:
    n = _int(n)
    if n is None:
        return "rowsym"
    for limit, tag in ROW_BUCKETS:
        if n <= limit:
            return tag
    return "rowbig"


# the tag of a channels_last 4-D tensor in a class path (layout(), conv_tags())
CHANNELS_LAST = "cl"


def layout(t: ir.TensorInfo) -> str:
    """"contig" (row-major), "cl" (a channels_last 4-D tensor) or "strided"."""
    from .model import is_channels_last

    if ir.is_contiguous(t):
        return "contig"
    return CHANNELS_LAST if is_channels_last(t) else "strided"


def _arg(node: fx.Node, name: str, index: int | None = None):
    """Schema argument ``name`` as the node passes it (kwargs, then position), else None."""
    if name in node.kwargs:
        return node.kwargs[name]
    if isinstance(node.target, torch._ops.OpOverload):
        for i, a in enumerate(node.target._schema.arguments):
            if a.name == name:
                return node.args[i] if i < len(node.args) else None
    if index is not None and index < len(node.args):
        return node.args[index]
    return None


def m_bucket(m) -> str:
    """The rows of a GEMM (for a convolution, output pixels: batch x height x width): m256, m4k
    or mbig; few rows stream the weight with little reuse."""
    m = _int(m)
    if m is None:
        return "msym"
    return "m256" if m <= 256 else "m4k" if m <= 4096 else "mbig"


def gemm_tags(dt: str, m, n, k, *, batched: bool = False) -> tuple:
    """The class of a GEMM of ``m`` x ``k`` by ``k`` x ``n`` in dtype tag ``dt`` (for a batched
    product, one matrix of the batch): ("gemm", dt, alignment, m bucket), ("gemm", dt, "small_m"),
    ("bmm", dt, "small" | "large"), or "sym" for symbolic sizes."""
    m, n, k = _int(m), _int(n), _int(k)
    if batched:
        if None in (m, n, k):
            return ("bmm", dt, "sym")
        return ("bmm", dt, "small" if m * n * k <= SMALL_BMM else "large")
    if None in (m, n, k) or not n:
        return ("gemm", dt, "sym")
    if m <= SMALL_M:
        return ("gemm", dt, "small_m")
    if n % 16 == 0 and k % 16 == 0:
        return ("gemm", dt, "a16", m_bucket(m))
    if n % 8 == 0 and k % 8 == 0:
        return ("gemm", dt, "a8", m_bucket(m))
    return ("gemm", dt, "odd", m_bucket(m))


def _gemm_tags(node: fx.Node, name: str, ins, out, dt: str, adds_first: set) -> tuple:
    a = ins[1] if name in adds_first and len(ins) > 2 else ins[0]
    b = ins[2] if name in adds_first and len(ins) > 2 else (ins[1] if len(ins) > 1 else None)
    n, k = _int(out.shape[-1]) if out.shape else None, _int(a.shape[-1]) if a.shape else None
    batched = name in BATCHED_MATMUL or (name == "matmul" and b is not None and len(a.shape) > 2 and len(b.shape) > 2)
    if batched:
        return gemm_tags(dt, out.shape[-2] if len(out.shape) > 1 else None, n, k, batched=True)
    numel = _int(out.numel)
    return gemm_tags(dt, numel // n if numel is not None and n else None, n, k)


def conv_tags(dt: str, x: ir.TensorInfo | None, w: ir.TensorInfo | None, out: ir.TensorInfo | None, *,
              transposed: bool = False) -> tuple:
    """The class of a convolution of input ``x`` and weight ``w`` giving ``out``: ("conv", dt,
    dense | grouped | depthwise, cl | nchw | nd, output pixels' m bucket), ("conv", dt,
    "transposed"), or ("conv", dt, "sym") without the tensors."""
    from .model import is_channels_last

    if x is None or w is None or out is None:
        return ("conv", dt, "sym")
    if transposed:
        return ("conv", dt, "transposed")
    cin, cin_w = _int(x.shape[1]) if len(x.shape) > 1 else None, _int(w.shape[1]) if len(w.shape) > 1 else None
    if cin is None or cin_w is None or not cin_w:
        group = "sym"
    elif cin == cin_w:
        group = "dense"
    elif cin_w == 1:
        group = "depthwise"
    else:
        group = "grouped"
    lay = "nd" if len(x.shape) != 4 else (CHANNELS_LAST if is_channels_last(x) else "nchw")
    cout = _int(out.shape[1]) if len(out.shape) > 1 else None
    numel = _int(out.numel)
    pixels = numel // cout if cout and numel is not None else None
    return ("conv", dt, group, lay, m_bucket(pixels))


def _conv_tags(node: fx.Node, name: str, ins, out, dt: str) -> tuple:
    return conv_tags(dt, ins[0], ins[1] if len(ins) > 1 else None, out,
                     transposed="transpose" in name or _arg(node, "transposed") is True)


def sdpa_tags(dt: str, mask, causal: bool) -> tuple:
    """The class of an attention call by its mask (an fx.Node, or None) and causality:
    ("sdpa", dt, none | bool | float, causal | full)."""
    if isinstance(mask, fx.Node):
        mi = ir.info(mask)
        kind = "bool" if mi is not None and mi.dtype == torch.bool else "float"
    else:
        kind = "none"
    return ("sdpa", dt, kind, "causal" if causal else "full")


def _sdpa_tags(node: fx.Node, dt: str) -> tuple:
    return sdpa_tags(dt, _arg(node, "attn_mask", 3), _arg(node, "is_causal") is True)


def _copy_tags(node: fx.Node, name: str, ins, out) -> tuple:
    from .model import narrow_copy

    if name in CAT_OPS:
        return ("copy", "cat")
    if name in PAD_OPS:
        return ("copy", "pad")
    if out is None or not ins:
        return ("copy", "other", name)
    if narrow_copy(node):
        return ("copy", "narrow", name)
    if ir.is_contiguous(ins[0]) and ir.is_contiguous(out):
        return ("copy", "contiguous", name)
    return ("copy", "strided", name)


def op_class(node: fx.Node, kind: str) -> tuple | None:
    """The class path of a ``call_function`` node (see the module docstring); ``kind`` is the
    cost model's kind for it (``CostModel.flops_bytes(node)[3]``). None for nodes that are not
    op calls (placeholders, outputs, getitem, regions)."""
    from . import ops as op_costs
    from .model import ADD_FIRST, ATTENTION_OPS, CONV_OPS, MATMUL_OPS

    if node.op != "call_function" or kind == "region" or not isinstance(
            node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    name = ir.op_name(node)
    if ir.op_namespace(node) == op_costs.NAMESPACE:
        return graphopt_op_class(node, name)
    if kind == "free":
        return ("view", name)
    outs, ins = ir.infos(node), ir.operand_infos(node)
    out = outs[0] if outs else None
    if out is None:
        return ("op", name)
    dt = dtype_tag(ins[0].dtype if ins else out.dtype)
    if name in MATMUL_OPS and ins:
        return _gemm_tags(node, name, ins, out, dt, ADD_FIRST)
    if name in CONV_OPS and ins:
        return _conv_tags(node, name, ins, out, dt)
    if name in ATTENTION_OPS:
        return _sdpa_tags(node, dt)
    if name in SOFTMAX_OPS:
        dim = _arg(node, "dim", 1)
        dim = dim if isinstance(dim, int) else -1
        return ("softmax", row_bucket(ins[0].shape[dim] if ins and ins[0].shape else 1), layout(ins[0]))
    if name in NORM_OPS:
        if "batch_norm" in name or name == "instance_norm":
            return ("norm", "batch_norm", layout(ins[0]))
        shape = _arg(node, "normalized_shape", 1)
        row = math.prod(shape) if isinstance(shape, (list, tuple)) and all(isinstance(s, int) for s in shape) else (
            ins[0].shape[-1] if ins and ins[0].shape else 1)
        return ("norm", name, row_bucket(row), layout(ins[0]))
    if name in REDUCE_OPS and ins:
        o, i = _int(out.numel), _int(ins[0].numel)
        row = i // o if o and i is not None and name not in ("cumsum", "cumprod") else (
            ins[0].shape[-1] if ins[0].shape else 1)
        return ("reduce", row_bucket(row), name)
    if name in POOL_OPS:
        return ("pool", name)
    if name in GATHER_OPS or kind == "gather":
        return ("gather", name)
    if name in CAT_OPS or name in PAD_OPS or kind == "copy" or name in ("clone", "contiguous", "_to_copy", "copy",
                                                                         "copy_", "lift_fresh_copy", "roll", "repeat",
                                                                         "flip", "tile"):
        return _copy_tags(node, name, ins, out)
    if not ins or name.startswith("new_") or name.endswith("_like") or name in ("arange", "zeros", "ones", "full",
                                                                                 "empty", "scalar_tensor", "linspace"):
        return ("factory", name)
    if kind == "pointwise":
        if any(not ir.is_contiguous(i) for i in ins):
            how = "strided"
        elif any(_int(i.numel) != _int(out.numel) for i in ins):
            how = "bcast"
        else:
            how = "same"
        return ("pointwise", _family(out.dtype), how, name)
    return ("op", name)


def graphopt_op_class(node: fx.Node, name: str) -> tuple:
    """("graphopt", op) and, for an op that declares the class of the ATen op it replaces
    (graphopt.cost.ops.register_op_class: a convolution, a GEMM, an attention), that class's
    tags after its family: ("graphopt", "conv_bias_relu", "bf16", "grouped", "cl", "mbig")."""
    from . import ops as op_costs

    fn = op_costs.op_class_fn(name)
    like = fn(op_costs.op_call(node)) if fn is not None else None
    return (op_costs.NAMESPACE, name) + tuple(like[1:] if like else ())


def dtype_of(info: ir.TensorInfo | None) -> str:
    """The dtype tag of a tensor argument ("sym" without one)."""
    return dtype_tag(info.dtype) if info is not None else "sym"


def class_name(path) -> str:
    return SEP.join(path)


RANGE_MARGIN = 0.7  # how far (in ln seconds, 2x) above the predicted times of its samples a curve applies


def covers(entry: dict, predicted_s: float) -> bool:
    """Does a class fit apply to a node predicted at ``predicted_s``: a positive time up to a
    little (RANGE_MARGIN) above the largest of its curve's ``range`` of ln(predicted seconds)
    (below it the first knot's factor holds: a smaller op is no less dominated by its fixed
    costs; far above it, a larger one may run nearer the roofline than any sample did), a zero
    time where it has a ``fixed_s``. A curve without a range applies anywhere."""
    if predicted_s > 0:
        if not entry.get("knots"):
            return False
        _, hi = entry.get("range") or (-math.inf, math.inf)
        return math.log(predicted_s) <= hi + RANGE_MARGIN
    return entry.get("fixed_s") is not None


def lookup(fit: dict, path, predicted_s: float | None = None, key: str = "classes") -> tuple[str | None, dict | None]:
    """(class name, entry) of the longest prefix of ``path`` the fit's ``key`` table has ("classes";
    a split fit's "device_classes" or "host_classes") and, given ``predicted_s``, whose fit covers
    it (see :func:`covers`), or (None, None)."""
    classes = (fit or {}).get(key) or {}
    for i in range(len(path or ()), 0, -1):
        key = SEP.join(path[:i])
        entry = classes.get(key)
        if entry is not None and (predicted_s is None or covers(entry, predicted_s)):
            return key, entry
    return None, None


def curve_log_factor(entry: dict, x: float) -> float:
    """The fitted ln(measured / predicted) at x = ln(predicted seconds): linear between the
    entry's ``knots``, flat beyond the first and the last."""
    knots, values = entry["knots"], entry["log_factor"]
    if len(knots) == 1 or x <= knots[0]:
        return values[0]
    if x >= knots[-1]:
        return values[-1]
    j = bisect.bisect_right(knots, x) - 1
    t = (x - knots[j]) / (knots[j + 1] - knots[j])
    return values[j] * (1 - t) + values[j + 1] * t


def class_correction(fit: dict, path, predicted_s: float) -> tuple[float, float, float | None]:
    """(factor, added seconds, fixed seconds or None) for a node of class ``path`` predicted at
    ``predicted_s`` under the profile's ``op_class_fit``: its longest class prefix whose fit
    covers it (see :func:`correction`)."""
    return correction(lookup(fit, path, predicted_s)[1], predicted_s)


# How a class correction applies to a node's device time inside a CUDA-graph replay (the fit's
# "replay" rule, chosen by graphopt calibrate --corpus): a correction is fitted on nodes timed
# alone, back to back from the host, where each node's time is at least its host dispatch; in a
# replay the host's part vanishes, so the alone time bounds the device time from above only.
REPLAY_RULES = ("full", "lower", "none")  # the factor as is | only where it lowers the time | not at all


def replay_rule(fit: dict | None) -> str:
    """The fit's replay rule ("full" where it has none: fits made before the rule existed)."""
    rule = (fit or {}).get("replay") or "full"
    return rule if rule in REPLAY_RULES else "full"


def corrected_times(corr: tuple, host, dev, replay: str | None = None) -> tuple:
    """(host, device) seconds of a node under its class correction ``corr`` ((factor, added
    seconds, fixed seconds or None): :func:`correction`): both times the factor, the added seconds
    on the host's; a node with neither host nor device time takes the fixed time as host time.
    ``replay``: the node runs inside a CUDA-graph replay under that rule (:data:`REPLAY_RULES`),
    which decides what the factor does to its device time."""
    from .model import _num

    factor, add, fixed = corr
    if fixed is not None:
        return (fixed, 0.0) if not _num(host) and not _num(dev) else (host, dev)
    if factor != 1.0 or add:
        dev_factor = factor if replay in (None, "full") else (min(factor, 1.0) if replay == "lower" else 1.0)
        return host * factor + add, dev * dev_factor
    return host, dev


def correction(entry: dict | None, predicted_s: float) -> tuple[float, float, float | None]:
    """(factor, added seconds, fixed seconds or None) of a class fit for a node predicted at
    ``predicted_s``: a positive prediction becomes predicted * factor + added (``add_s``: what a
    node costs in a model's stream beyond its time alone); a zero one takes ``fixed_s`` where the
    class has one. No fit: (1.0, 0.0, None)."""
    if entry is None:
        return 1.0, 0.0, None
    if predicted_s > 0:
        if entry.get("knots"):
            return math.exp(curve_log_factor(entry, math.log(predicted_s))), entry.get("add_s", 0.0), None
        return 1.0, 0.0, None
    return 1.0, 0.0, entry.get("fixed_s")


# ------------------------------------------------------------------------------------ split fits

SPLIT_KEYS = ("device_classes", "host_classes")


def is_split(fit: dict | None) -> bool:
    """Does the fit correct device and host time apart (``device_classes`` / ``host_classes``)?"""
    return any(k in (fit or {}) for k in SPLIT_KEYS)


def host_path(path, op: str | None) -> tuple:
    """The path a split fit's host correction is looked up by: the class path, then the op
    (``ir.target_name``: a host time is the op's dispatch, so a fit may go down to one op)."""
    return tuple(path) + ((op.replace(SEP, "."),) if op else ())


def split_correction(fit: dict, path, host_s: float, device_s: float,
                     op: str | None = None) -> tuple[float, float, float]:
    """(device factor, host factor, host added seconds) of a split fit for a node of class
    ``path`` and op ``op`` whose uncorrected host and device times are ``host_s`` and
    ``device_s``: its longest device class prefix whose curve covers ``device_s``, its longest
    host prefix (:func:`host_path`) whose curve covers ``host_s``; (1.0, 1.0, 0.0) where none
    does."""
    fd, fh, add = 1.0, 1.0, 0.0
    if device_s > 0:
        entry = lookup(fit, path, device_s, "device_classes")[1]
        if entry is not None:
            fd = math.exp(curve_log_factor(entry, math.log(device_s)))
    if host_s > 0:
        entry = lookup(fit, host_path(path, op), host_s, "host_classes")[1]
        if entry is not None:
            fh = math.exp(curve_log_factor(entry, math.log(host_s)))
            add = entry.get("add_s", 0.0)
    return fd, fh, add


def split_times(corr: tuple, host, dev) -> tuple:
    """(host, device) seconds under a split correction ``corr`` (:func:`split_correction`): the
    host time times its factor plus the added seconds, the device time times its factor, eager
    or inside a CUDA-graph replay alike (the device factor is fitted on device time alone)."""
    fd, fh, add = corr
    return (host * fh + add if fh != 1.0 or add else host), (dev * fd if fd != 1.0 else dev)
