"""Graph IR helpers: node metadata, metadata re-propagation, invariant checks, provenance.

The IR is a ``torch.fx.GraphModule`` whose call_function nodes are ATen overloads (the
canonical vocabulary made by :mod:`graphopt.capture`). Every node carries ``meta["val"]`` (a
FakeTensor, or a tuple of them) from which shape, dtype, device and symbolic dims are read.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import sympy
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from . import timing
from .errors import GraphoptError, one_line

aten = torch.ops.aten


class InvariantError(GraphoptError):
    """A pass left the graph in a broken state (names the node)."""


# gm.meta keys set at capture: mutation_signature of the captured graph, and whether the captured
# graph itself reads across its in-place writes (then mutation_order_violation is not checked)
MUTATIONS = "graphopt_mutations"
MUTATION_ORDER_EXEMPT = "graphopt_mutation_order_exempt"


# --------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple  # ints or sympy expressions
    dtype: torch.dtype
    device: torch.device
    stride: tuple | None = None

    @functools.cached_property  # TensorInfo is immutable; the cost model asks for it many times
    def numel(self):
        if all(type(d) is int for d in self.shape):  # static shapes: no sympy arithmetic (a hot path)
            return math.prod(self.shape)
        n = sympy.Integer(1)
        for d in self.shape:
            n = n * d
        return sympy.simplify(n) if not isinstance(n, (int, sympy.Integer)) else int(n)

    @functools.cached_property
    def nbytes(self):
        return self.numel * self.dtype.itemsize

    @property
    def symbolic(self) -> bool:
        return any(not isinstance(d, int) for d in self.shape)


def _dim(d):
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        return int(expr) if expr.is_number else expr
    return int(d)


def tensor_info(val) -> TensorInfo | None:
    if isinstance(val, torch.Tensor):
        try:
            stride = tuple(_dim(s) for s in val.stride())
        except Exception:  # sparse / nested tensors have no strides
            stride = None
        return TensorInfo(tuple(_dim(d) for d in val.shape), val.dtype, val.device, stride)
    return None


_INFO = "_graphopt_infos"


def infos(node: fx.Node) -> list[TensorInfo]:
    """TensorInfo of every tensor a node produces (tuple outputs flattened). Cached in the node's
    meta for as long as its ``meta["val"]`` is the same object (propagation replaces it)."""
    val = node.meta.get("val")
    cached = node.meta.get(_INFO)
    if cached is not None and cached[0] is val:
        return cached[1]
    vals = val if isinstance(val, (tuple, list)) else [val]
    out = [t for t in (tensor_info(v) for v in vals) if t is not None]
    node.meta[_INFO] = (val, out)
    return out


def info(node: fx.Node) -> TensorInfo | None:
    """TensorInfo of a node producing one tensor, else None."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    out = infos(node)
    return out[0] if out else None


def arg_infos(node: fx.Node) -> list[TensorInfo]:
    """TensorInfo of every tensor input of a node (each input node once): what it reads, for
    byte counts. Use :func:`operand_infos` to read a particular operand."""
    out = []
    for a in node.all_input_nodes:
        out.extend(infos(a))
    return out


def operand_infos(node: fx.Node) -> list[TensorInfo]:
    """TensorInfo of a node's tensor operands in argument order (args, then kwargs), one entry per
    occurrence: ``sdpa(x, x, x)`` gives three, where :func:`arg_infos` gives one."""
    nodes: list = []
    fx.node.map_arg((node.args, node.kwargs), nodes.append)
    out = []
    for a in nodes:
        out.extend(infos(a))
    return out


def concrete(expr, hints: dict | None = None) -> float:
    """Evaluate a size expression; symbols take their hint values."""
    if isinstance(expr, (int, float)):
        return expr
    if hints:
        expr = expr.subs(hints)
    try:
        return float(expr)
    except TypeError as e:
        raise InvariantError(f"size {expr} has symbols with no hint value") from e


def shape_hints(gm: fx.GraphModule) -> dict:
    """Symbol -> example value, read from the ShapeEnv of the graph's fake tensors."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None or mode.shape_env is None:
        return {}
    env = mode.shape_env
    values = getattr(env, "backed_var_to_val", None)
    if values is None:
        values = env.var_to_val
    return {k: int(v) for k, v in values.items()}


def is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def op_name(node: fx.Node) -> str:
    """The bare name of what a node calls, the one spelling the cost model, the passes and the
    runtime share: ``linear`` for aten.linear.default, ``add_rms_norm`` for
    graphopt.add_rms_norm.default, ``getitem`` for operator.getitem, a function's ``__name__``
    (a placeholder, get_attr or call_module node: its target string)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def op_namespace(node: fx.Node) -> str:
    """The library of an op overload node ("aten", "graphopt", ...); "" for anything else."""
    t = node.target
    return t._schema.name.split("::")[0] if isinstance(t, torch._ops.OpOverload) else ""


def target_name(node: fx.Node) -> str:
    """:func:`op_name` with the overload (``add.Tensor``), ``module:<target>`` for a module call:
    how reports name a node's op."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return op_name(node) + (f".{t._overloadname}" if t._overloadname != "default" else "")
    if node.op == "call_module":
        return f"module:{t}"
    return getattr(t, "__name__", str(t))


def is_contiguous(ti: TensorInfo | None) -> bool:
    """Row-major dense (size-1 dims ignored); a tensor without strides (or no tensor) counts as
    contiguous."""
    if ti is None or ti.stride is None:
        return True
    expected = 1
    for size, stride in reversed(list(zip(ti.shape, ti.stride))):
        if size != 1 and stride != expected:
            return False
        expected = expected * size
    return True


def reshape_is_view(ti: TensorInfo | None, new_shape) -> bool:
    """Whether ``reshape(t, new_shape)`` returns a view of ``t`` (torch's rule, ATen's
    computeStride: each run of dims merged or split must be one stride-compatible chunk); False
    where a size or stride is symbolic or unknown."""
    if ti is None or ti.stride is None:
        return False
    old, strides, new = ti.shape, ti.stride, tuple(new_shape)
    if not all(type(d) is int for d in (*old, *strides, *new)):
        return False
    if math.prod(old) != math.prod(new):
        return False
    if math.prod(old) == 0 or not old:
        return True
    view_d = len(new) - 1
    base = strides[-1]
    t_numel = v_numel = 1
    for d in range(len(old) - 1, -1, -1):
        t_numel *= old[d]
        if d == 0 or (old[d - 1] != 1 and strides[d - 1] != t_numel * base):
            while view_d >= 0 and (v_numel < t_numel or new[view_d] == 1):
                v_numel *= new[view_d]
                view_d -= 1
            if v_numel != t_numel:
                return False
            if d > 0:
                base, t_numel, v_numel = strides[d - 1], 1, 1
    return view_d == -1


# op names (ATen schema names, without the namespace) that synchronize with the host
HOST_SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique", "_unique",
    "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "bincount", "histc",
    "argwhere", "_nested_tensor_from_mask", "equal", "is_nonzero",
})


def static_repeat(node: fx.Node, name: str) -> bool:
    """repeat_interleave with integer repeats (GLM's rotary tables) has a static output size;
    only the Tensor-repeats overload needs the host to size its output."""
    if name != "repeat_interleave":
        return False
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    return isinstance(repeats, int)


def ranged_histc(node: fx.Node, name: str) -> bool:
    """histc with a range given (min < max): its output is ``bins`` counts and the device bins
    without the host; only an empty range (min == max, the default) makes torch read the data's
    min and max back to the host first. MoE routers count their tokens per expert this way."""
    if name != "histc":
        return False
    lo = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
    hi = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
    return isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi


def host_sync(node: fx.Node) -> bool:
    """A call the host must wait for (its output's size or value decides what runs next)."""
    if node.op != "call_function":
        return False
    name = op_name(node)
    return name in HOST_SYNC_OPS and not static_repeat(node, name) and not ranged_histc(node, name)


RANDOM_OPS = frozenset({
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "rand", "randn",
    "rand_like", "randn_like", "randint", "randint_like", "randperm", "normal", "uniform",
    "multinomial", "exponential", "geometric", "log_normal", "cauchy", "rrelu", "rrelu_with_noise",
})


def is_random(node: fx.Node) -> bool:
    """Does the node draw random numbers? (ops tagged nondeterministic_seeded, or a known random
    op; a dropout of any spelling with train=False, or p=0, does not draw and does not count, nor a
    recurrent layer's dropout between layers). The one definition the
    passes, the guard and the CUDA-graph lowering share."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    names = [a.name for a in t._schema.arguments]
    if names[1:3] == ["p", "train"]:  # the dropout family: (input, p, train)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        if train is False:
            return False  # the identity (dropout*) or a copy and an all-true mask (native_dropout)
        # dropout, feature_dropout, alpha_dropout (and in place) return their input at p == 0;
        # native_dropout still draws its mask
        return not (p == 0 and t._schema.name.split("::")[-1] != "native_dropout")
    if "dropout" in names and "train" in names:  # the recurrent layers (lstm, gru, rnn_*): dropout between layers
        i, j = names.index("dropout"), names.index("train")
        p = node.args[i] if len(node.args) > i else node.kwargs.get("dropout", 0.0)
        train = node.args[j] if len(node.args) > j else node.kwargs.get("train", True)
        return train is not False and not (isinstance(p, (int, float)) and p == 0)
    if "dropout_p" in names:  # attention: seeded only for its dropout (tagged either way)
        i = names.index("dropout_p")
        p = node.args[i] if len(node.args) > i else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()) or op_name(node) in RANDOM_OPS


# --------------------------------------------------------------------------- aliasing


def alias_source(node: fx.Node):
    """The input whose storage ``node``'s value shares (a view, an op that may return its input
    such as ``to``/``contiguous``, an in-place op returning what it wrote, an item of a list of
    views), else None."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, fx.Node) and alias_source(src) is not None else None
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.returns:
        return None
    ret = t._schema.returns[0].alias_info
    if ret is None:
        return None
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set & ret.before_set:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            return v if isinstance(v, fx.Node) else None
    return None


def written(node: fx.Node) -> list:
    """The input nodes an in-place op writes into. Calls graphopt cannot read (a method or module
    call of a symbolic_trace graph) whose name says in place write their first argument."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        if not t._schema.is_mutable:
            return []
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                out.extend(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, fx.Node))
        return out
    name = t if node.op == "call_method" else getattr(t, "__name__", "") if node.op == "call_function" else ""
    inplace = isinstance(name, str) and name.endswith("_") and not name.startswith("_")
    if node.op == "call_module":
        owner = node.graph.owning_module
        try:
            inplace = bool(getattr(owner.get_submodule(node.target), "inplace", False)) if owner is not None else False
        except AttributeError:
            inplace = False
    return [node.args[0]] if inplace and node.args and isinstance(node.args[0], fx.Node) else []


def storages(gm: fx.GraphModule) -> tuple[dict, dict]:
    """``(storage, writes)``: the node whose storage each node's value shares (itself for a fresh
    tensor), and for each storage the nodes writing it in place, in graph order. Capture leaves
    in-place ops where the written tensor is a view, an input or a parameter, so a pass that drops
    a copy or reorders reads checks here that nothing writes the storages involved."""
    storage: dict = {}
    writes: dict = {}
    for n in gm.graph.nodes:
        src = alias_source(n)
        storage[n] = storage.get(src, src) if src is not None else n
        for w in written(n):
            writes.setdefault(storage.get(w, w), []).append(n)
    return storage, writes


def get_attr_value(gm: fx.GraphModule, target: str):
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- propagation


def placeholder_fakes(gm: fx.GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def _signature(v):
    """What a node's fake propagation can depend on in an input value: shape, strides, offset,
    dtype, device and requires_grad of tensors (symbolic sizes by their expression), the value
    of anything else."""
    if type(v) is _NodeSig:  # an input node's, computed (and cached) already
        return v
    if isinstance(v, torch.Tensor):
        return ("T", tuple(str(d) for d in v.shape), tuple(str(d) for d in v.stride()), str(v.storage_offset()),
                v.dtype, v.device, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_signature(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _signature(x)) for k, x in v.items()))
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", str(v))
    if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                      torch.layout)):
        return v
    return ("id", id(v))


_SIG = "_graphopt_val_signature"


class _NodeSig(tuple):
    """("N", an input node's value signature) inside a key: _signature leaves it as it is."""


def _versions(val):
    if isinstance(val, torch.Tensor):
        # an inference tensor (made under torch.inference_mode) keeps no version counter: a fresh
        # object every time, so a signature cached against it is never taken as current
        return object() if val.is_inference() else val._version
    if isinstance(val, (tuple, list)):
        return tuple(_versions(v) for v in val)
    return None


def _node_signature(node: fx.Node):
    """_signature of a node's ``meta["val"]``, cached for as long as it is the same object at the
    same version (an in-place op bumps a tensor's version, also a fake one's)."""
    val = node.meta.get("val")
    ver = _versions(val)
    cached = node.meta.get(_SIG)
    if cached is not None and cached[0] is val and cached[1] == ver:
        return cached[2]
    sig = _signature(val)
    node.meta[_SIG] = (val, ver, sig)
    return sig


class _IncrementalProp(FakeTensorProp):
    """FakeTensorProp that keeps a pure op's ``meta["val"]`` when its target, arguments and its
    inputs' signatures are those it was last computed from: a pass changes a few nodes, and
    re-running fake kernels over the whole graph after each one dominated ``optimize()``'s time.
    Mutating ops, higher-order ops, submodule calls
    and data-dependent results (unbacked symbols) always re-run."""

    KEY = "_graphopt_prop_key"
    SEEDED = "_graphopt_seeded_val"  # get_attr: (key, the value a propagation gives it), from seed_propagation

    def _key(self, n: fx.Node, sig=None):
        """What ``n``'s value is computed from (None: always re-run). ``sig(input node)``: the
        input's value signature (default: that of its current ``meta["val"]``)."""
        sig = sig or _node_signature
        if n.op == "get_attr" and "val" in n.meta:
            obj = get_attr_value(self.module, n.target)
            if isinstance(obj, torch.Tensor) and not isinstance(obj, torch._subclasses.FakeTensor) \
                    and not obj.is_inference():  # (an inference tensor has no version to key on: re-run)
                return ("get_attr", id(obj), obj._version, tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device)
            return None
        if n.op == "call_function" and n.target is operator.getitem and "val" in n.meta:
            return ("getitem", sig(n.args[0]), n.args[1])
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or n.target._schema.is_mutable or "val" not in n.meta:
            return None
        # the inputs' meta["val"] (set earlier in this run): detached snapshots whether computed now
        # or kept, where the interpreter's own values would differ in requires_grad between the two
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: _NodeSig(("N", sig(a))))
        return (n.target, _signature(args))

    def run_node(self, n: fx.Node):
        key = self._key(n)
        if key is not None and n.meta.get(self.KEY) == key:
            return n.meta["val"]
        seeded = n.meta.pop(self.SEEDED, None)
        if seeded is not None and key is not None and seeded[0] == key:
            # a parameter's propagated value, made by seed_propagation from this same tensor
            n.meta["val"], n.meta[self.KEY] = seeded[1], key
            return seeded[1]
        try:
            result = super().run_node(n)
        except Exception as e:
            e.graphopt_node = n.name  # (failing_node: a pass that tries a rewrite names what it broke)
            raise
        if key is None:  # a node without a value yet: keyed once it has one (its inputs are as they were)
            key = self._key(n)
        val = n.meta.get("val")
        free = getattr(val, "shape", None) is not None and any(
            isinstance(d, torch.SymInt) and "u" in str(d) for d in val.shape)
        n.meta[self.KEY] = None if free else key
        return result


def _unbacked(val) -> bool:
    return getattr(val, "shape", None) is not None and any(
        isinstance(d, torch.SymInt) and "u" in str(d) for d in val.shape)


@timing.timed("fake propagation")
def seed_propagation(gm: fx.GraphModule) -> int:
    """Key the ``meta["val"]`` torch.export left on the graph as if a propagation had computed
    them, so the first :func:`repropagate` re-runs only what changed since capture instead of the
    whole graph. Export's values are those a fake
    propagation computes from the same inputs (tests/test_ir_propagation.py checks every node's
    shape, strides, offset, dtype, device and requires_grad on the zoo), with two exceptions left
    unkeyed, so that the first propagation re-runs them as before: get_attr nodes (export's
    parameters require grad, a propagation's snapshots do not; their readers are keyed with the
    snapshot's signature, what they will read then) and list values (a propagation gives torch.fx's
    immutable_list). No value is changed: a pass that runs before any propagation sees export's,
    as without the keys (the parameters' propagated values wait beside them, installed by that
    propagation while the attribute is the same tensor). Returns the number of nodes keyed."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import snapshot_fake

    fakes = [v for v in placeholder_fakes(gm) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(fakes)
    if mode is None:
        return 0
    prop = _IncrementalProp(gm, mode)
    attr_sig: dict = {}  # get_attr node -> the signature its propagated value will have
    keyed = 0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = get_attr_value(gm, n.target)
            if isinstance(obj, torch.Tensor):
                snap = snapshot_fake(obj if is_fake(obj) else mode.from_tensor(obj, static_shapes=True))
                attr_sig[n] = _signature(snap)
                key = prop._key(n)
                if key is not None:  # the first propagation installs it instead of converting the tensor again
                    n.meta[_IncrementalProp.SEEDED] = (key, snap)
            continue
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) or (isinstance(val, tuple) and val
                                                  and all(isinstance(v, torch.Tensor) for v in val))):
            continue
        if _unbacked(val) or any(_unbacked(v) for v in (val if isinstance(val, tuple) else ())):
            continue
        key = prop._key(n, sig=lambda a: attr_sig[a] if a in attr_sig else _node_signature(a))
        if key is not None:
            n.meta[_IncrementalProp.KEY] = key
            keyed += 1
    return keyed


@timing.timed("fake propagation")
def repropagate(gm: fx.GraphModule, incremental: bool = True) -> None:
    """Recompute ``meta["val"]`` for every node from the placeholders' fake values (with
    ``incremental``, re-running only the nodes whose inputs' shapes, strides or dtypes changed)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    fakes = placeholder_fakes(gm)
    mode = detect_fake_mode([v for v in fakes if isinstance(v, torch.Tensor)])
    if mode is None:
        incremental = False  # values cached under another mode cannot mix with this one
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in fakes]
    written = mutated_placeholder_indices(gm) if gm.meta.get(MUTATIONS) else ()
    if written:
        # a propagation runs the in-place writes on the placeholders' fake values (an index_copy_
        # of a grad-requiring value makes its destination require grad): each run gets fresh ones
        with mode:
            fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                     if i in written and isinstance(v, torch.Tensor) else v for i, v in enumerate(fakes)]
    prev = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    # get_attr hands real buffers to the fake run, and an in-place op on a real 0-dim buffer
    # (BatchNorm's num_batches_tracked += 1 in a training graph) really runs: undo it
    scalars = [(b, b.clone()) for b in gm.buffers() if b.dim() == 0 and not isinstance(b, torch._subclasses.FakeTensor)]
    try:
        (_IncrementalProp if incremental else FakeTensorProp)(gm, mode).propagate_dont_convert_inputs(*fakes)
    finally:
        mode.allow_non_fake_inputs = prev
        with torch.no_grad():
            for b, v in scalars:
                b.copy_(v)


def failing_node(gm: fx.GraphModule, error: BaseException) -> fx.Node | None:
    """The node whose fake run raised ``error`` in an incremental :func:`repropagate`, or None."""
    name = getattr(error, "graphopt_node", None)
    return next((n for n in gm.graph.nodes if n.name == name), None) if name else None


def propagate_from_real(gm: fx.GraphModule, flat_inputs: list) -> None:
    """First propagation, from real example inputs (used when capture did not give metadata)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in flat_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


# --------------------------------------------------------------------------- invariants


@timing.timed("invariant checks")
def check_invariants(gm: fx.GraphModule, where: str = "", allow_dtype_change: bool = False,
                     devices_before: set | None = None) -> None:
    """lint + metadata present and consistent; raises InvariantError naming the node.
    ``allow_dtype_change`` is for passes whose job is to change dtypes (assign_precision).
    ``devices_before``: the device types the graph computed on before the pass (graph_devices);
    a graph may mix the host with a device as captured (tensors a forward builds on the host),
    and a pass may only not add a device type to it."""
    suffix = f" after {where}" if where else ""
    try:
        gm.graph.lint()
    except Exception as e:  # lint's message ends with the whole graph: kept as the detail
        raise InvariantError(f"graph lint failed{suffix}: {one_line(e)}", detail=str(e)) from e
    captured = gm.meta.get(MUTATIONS)
    if captured is not None:  # the in-place writes into inputs the captured graph makes (capture.py)
        now = mutation_signature(gm)
        if now != captured:
            lost = {k: v for k, v in captured.items() if now.get(k, 0) != v}
            raise InvariantError(f"the graph's in-place writes into its inputs changed{suffix}: "
                                 f"{lost or now} (expected {captured})")
        if captured and not gm.meta.get(MUTATION_ORDER_EXEMPT):
            crossing = mutation_order_violation(gm)
            if crossing is not None:
                raise InvariantError(f"{crossing}{suffix}")
    before = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    try:
        repropagate(gm)
    except Exception as e:
        raise InvariantError(f"shape propagation failed{suffix}: {type(e).__name__}: {one_line(e)}",
                             detail=f"{type(e).__name__}: {e}") from e
    for n in gm.graph.nodes:
        if n.op in ("output",):
            continue
        val = n.meta.get("val")
        if val is before.get(n.name, ...):  # kept by the incremental propagation: nothing changed
            continue
        old, new = tensor_info(before.get(n.name)), tensor_info(val)
        if old is not None and new is not None:
            dtype_changed = old.dtype != new.dtype and not allow_dtype_change
            if dtype_changed or old.device != new.device or len(old.shape) != len(new.shape):
                raise InvariantError(
                    f"node {n.name} ({target_name(n)}) changed metadata{suffix}: "
                    f"{old.dtype}/{old.device}/{old.shape} -> {new.dtype}/{new.device}/{new.shape}"
                )
    batched = batched_graphopt_op(gm)
    if batched is not None:
        raise InvariantError(f"node {batched.name} ({target_name(batched)}) runs on torch.vmap's batched tensors"
                             f"{suffix}: graphopt's ops have no batching rule")
    devices = graph_devices(gm)
    if len(devices) > 1 and not getattr(gm, "_graphopt_multi_device", False):
        if devices_before is None or devices - devices_before:
            raise InvariantError(f"graph mixes devices {sorted(devices)}{suffix}")


def batched_nodes(gm: fx.GraphModule) -> set:
    """Nodes computing on functorch's batched tensors: reached from an ``_add_batch_dim`` (torch.export's
    record of a ``torch.vmap`` in the forward, transformers' mask functions on some versions) before the
    ``_remove_batch_dim`` that ends it. They run under vmap, where graphopt's ops have no batching rule."""
    out: set = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", "")
        if name == "_add_batch_dim" or (name != "_remove_batch_dim" and any(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def batched_graphopt_op(gm: fx.GraphModule) -> fx.Node | None:
    """The first graphopt op that computes on batched tensors (:func:`batched_nodes`), if any: a
    rewrite must leave the body of a ``torch.vmap`` in ATen ops, which carry batching rules."""
    if not any(n.op == "call_function" and getattr(n.target, "__name__", "") == "_add_batch_dim"
               for n in gm.graph.nodes):
        return None
    batched = batched_nodes(gm)
    return next((n for n in gm.graph.nodes if n in batched and isinstance(n.target, torch._ops.OpOverload)
                 and n.target.namespace == "graphopt"), None)


def graph_devices(gm: fx.GraphModule) -> set:
    """The device types the graph's computed tensors live on (constants read with get_attr aside)."""
    return {info(n).device.type for n in gm.graph.nodes if info(n) is not None and n.op != "get_attr"}


# --------------------------------------------------------------------------- provenance


class ProvenanceObserver:
    """Stamps ``meta['graphopt_from']`` on every node created while active (torch.fx
    node-creation hooks), so passes never do provenance bookkeeping by hand."""

    def __init__(self, gm: fx.GraphModule, pass_name: str):
        self.gm, self.pass_name = gm, pass_name
        self.sources: list[str] = []
        self.created: list[fx.Node] = []
        self.replaced: dict = {}  # node -> names of the nodes its uses were redirected to
        self.touched: list[fx.Node] = []  # nodes whose inputs a replacement redirected

    def _hook(self, node: fx.Node) -> None:
        node.meta["graphopt_from"] = {"pass": self.pass_name, "sources": list(self.sources)}
        self.created.append(node)

    def _replace_hook(self, old: fx.Node, new: str, user: fx.Node) -> None:
        self.replaced.setdefault(old, set()).add(new)
        self.touched.append(user)

    def live(self, node: fx.Node) -> fx.Node | None:
        """``node`` if it is in the graph, else the node a rewrite replaced it with (all its uses
        redirected to one node, followed through later replacements), else None."""
        by_name = None
        seen = set()
        first = node
        while getattr(node, "_erased", False):
            names = self.replaced.get(node)
            if not names or len(names) != 1 or node in seen:
                return None
            seen.add(node)
            if by_name is None:
                by_name = {n.name: n for n in self.gm.graph.nodes}
            (name,) = names
            node = by_name.get(name)
            if node is None:
                return None
        if node is not first:
            self.replaced[first] = {node.name}  # the chain resolved once
        return node

    @contextlib.contextmanager
    def active(self) -> Iterator["ProvenanceObserver"]:
        self.gm._register_create_node_hook(self._hook)
        self.gm._register_replace_node_hook(self._replace_hook)
        try:
            yield self
        finally:
            self.gm._unregister_create_node_hook(self._hook)
            self.gm._unregister_replace_node_hook(self._replace_hook)

    @contextlib.contextmanager
    def sourced(self, nodes: Iterable[fx.Node]):
        saved = self.sources
        self.sources = [n.name for n in nodes]
        try:
            yield
        finally:
            self.sources = saved


# --------------------------------------------------------------------------- graph editing helpers


def replace_with(old: fx.Node, new: fx.Node) -> None:
    """Redirect old's users to new and carry its metadata if new has none."""
    if "val" not in new.meta and "val" in old.meta:
        new.meta["val"] = old.meta["val"]
    old.replace_all_uses_with(new)


def misplaced(nodes: Iterable[fx.Node]) -> str:
    """Why the given (new) nodes break the graph's order, in one line, or "" when each one reads
    only live nodes defined before it and is read only by nodes after it. A rewrite that read a
    node an earlier rewrite replaced (erased), or inserted its node before one of its inputs,
    shows here, at the rewrite, rather than in graph.lint() after the pass."""
    for n in nodes:
        if getattr(n, "_erased", False) or n.op == "placeholder":
            continue
        for a in n.all_input_nodes:
            if getattr(a, "_erased", False) or a.graph is not n.graph:
                return f"{n.name} reads {a.name}, which is no longer in the graph (an earlier rewrite replaced it)"
            if not a < n:
                return f"{n.name} reads {a.name}, which is defined after it"
        for u in n.users:
            if not n < u:
                return f"{n.name} is read by {u.name}, which comes before it"
    return ""


def erase_dead(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> int:
    """Erase those of the given nodes that end up with no users (users first)."""
    pending = [n for n in dict.fromkeys(nodes) if n.op not in ("placeholder", "output")]
    count, progress = 0, True
    while progress:
        progress = False
        for n in list(pending):
            if not n.users:
                gm.graph.erase_node(n)
                pending.remove(n)
                count += 1
                progress = True
    return count


def register_constant(gm: fx.GraphModule, prefix: str, value: torch.Tensor) -> str:
    """Store a tensor computed at optimization time as a buffer; returns its attribute name."""
    base = prefix.replace(".", "_")
    i = 0
    name = f"_graphopt_{base}"
    while hasattr(gm, name):
        i += 1
        name = f"_graphopt_{base}_{i}"
    gm.register_buffer(name, value, persistent=True)
    return name


class GraphSnapshot:
    """A graph's nodes as they are now, to rebuild the graph from later (a pass undone, the graph
    before a pass timed beside the one after it). Taking one reads each node's fields and copies
    its meta dict (as ``copy.deepcopy(graph)`` does), without building a graph: a node's args are
    tuples a rewrite replaces, never edits, so the ones kept still name the nodes they named then,
    and the rebuild maps those to the new graph's nodes. Every pass takes one and few are rebuilt."""

    def __init__(self, graph: fx.Graph):
        self._source = graph
        self._rows = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta)) for n in graph.nodes]

    def graph(self) -> fx.Graph:
        """A new graph with the nodes as they were (names, meta, the source graph's code generator)."""
        import copy

        g = fx.Graph(tracer_cls=self._source._tracer_cls)
        env: dict = {}
        for old, op, target, args, kwargs, name, type_expr, meta in self._rows:
            node = g.create_node(op, target, fx.node.map_arg(args, env.__getitem__),
                                 fx.node.map_arg(kwargs, env.__getitem__), name, type_expr)
            node.meta = dict(meta)
            env[old] = node
        g._codegen = copy.deepcopy(self._source._codegen)
        return g


def remove_unused_attributes(gm: fx.GraphModule) -> list[str]:
    """Drop buffers graphopt added that no get_attr node reads any more."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    removed = []
    for name in list(gm._buffers):
        if name.startswith("_graphopt_") and name not in used:
            del gm._buffers[name]
            removed.append(name)
    return removed


GETITEM = operator.getitem


# --------------------------------------------------------------------------- aliasing and mutation
# torch.export's graphs keep in-place ops on their inputs (a StaticCache's index_copy_ into its
# preallocated keys, its position counter's add_): the caller's tensors are written by the call.
# These helpers say which node's memory a value is, and which inputs a graph writes.


def _returns_alias_of(node: fx.Node) -> fx.Node | None:
    """The argument node whose memory ``node``'s value is, per the op's schema (a view, an
    in-place op's return, ``alias``, or a may-alias op such as ``to``/``reshape``/``contiguous``
    that does not copy here), or None for a fresh tensor."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return None
    schema = t._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    sets = schema.returns[0].alias_info.before_set
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not (a.alias_info.before_set & sets):
            continue
        base = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        if not isinstance(base, fx.Node):
            return None
        if t.is_view or a.alias_info.is_write:
            return base
        # may-alias ops: the to() family copies when it changes dtype or device; the others
        # (reshape, contiguous, ...) are taken to alias (the conservative answer for mutations)
        if schema.name in ("aten::to", "aten::type_as"):
            new, old = node.meta.get("val"), base.meta.get("val")
            if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and (
                    new.dtype != old.dtype or new.device != old.device):
                return None
        return base
    return None


def alias_root(node: fx.Node, memo: dict | None = None) -> fx.Node:
    """The node that owns the memory ``node``'s value lives in (itself for a fresh tensor)."""
    chain = []
    while True:
        if memo is not None and node in memo:
            root = memo[node]
            break
        base = _returns_alias_of(node)
        if base is None:
            root = node
            break
        chain.append(node)
        node = base
    if memo is not None:
        for n in chain:
            memo[n] = root
        memo[node] = root
    return root


def written_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes an in-place/out= op writes into (empty for a functional op)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        val = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        out.extend(v for v in torch.utils._pytree.tree_leaves(val) if isinstance(v, fx.Node))
    return out


def input_mutations(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(mutating node, the placeholder or get_attr it writes) for every in-place write into a
    graph input or attribute, directly or through views, in graph order."""
    memo: dict = {}
    out = []
    for n in gm.graph.nodes:
        for w in written_args(n):
            root = alias_root(w, memo)
            if root.op in ("placeholder", "get_attr"):
                out.append((n, root))
    return out


def mutated_placeholder_indices(gm: fx.GraphModule) -> set[int]:
    """Positions (among the graph's placeholders, i.e. the flat inputs) of the inputs the graph
    writes in place."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    hit = {root for _, root in input_mutations(gm) if root.op == "placeholder"}
    return {i for i, n in enumerate(places) if n in hit}


def mutated_flat_inputs(gm: fx.GraphModule, flat: list) -> set[int]:
    """Flat indices (pytree order of the call's arguments) of the inputs ``gm`` writes in place:
    the placeholders' positions when they are the flat inputs (a torch.export capture), every
    tensor input otherwise (a symbolic_trace capture that writes one)."""
    idx = mutated_placeholder_indices(gm)
    if not idx:
        return set()
    places = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    same = len(places) == len(flat) and all(
        v is None or (isinstance(v, torch.Tensor) == isinstance(x, torch.Tensor)
                      and (not isinstance(x, torch.Tensor) or v.dtype == x.dtype)) for v, x in zip(places, flat))
    return idx if same else {i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)}


def mutation_signature(gm: fx.GraphModule) -> dict:
    """{input name: number of nodes writing it} of the graph's in-place writes into its inputs
    (placeholders): what every pass must leave as it is (a write dropped, or redirected into a
    copy, changes it). The op doing a write may change (a fused op writing a KV cache in place of
    index_copy_, one _foreach_add_ in place of several add_), the inputs written and how often may
    not. Writes into attributes (a training graph's BatchNorm statistics) are the checkpointing
    passes' business and not counted."""
    sig: dict = {}
    for n, root in input_mutations(gm):
        if root.op != "placeholder":
            continue
        key = str(root.target)
        sig[key] = sig.get(key, 0) + 1
    return sig


def reads_result_of(n: fx.Node, m: fx.Node) -> bool:
    """``n`` reads ``m``'s result (``m`` itself, or an element of its tuple)."""
    return any(a is m or (a.op == "call_function" and a.target is operator.getitem and a.args[0] is m)
               for a in n.all_input_nodes)


def mutation_order_violation(gm: fx.GraphModule) -> str | None:
    """The first read that crosses an in-place write into an input, or None. After a node M
    writes input R,
    every later node must read R through M's result (or a view made after M); a later node that
    reads a value of R made before M would see M's write where the captured graph did not (a pass
    that moved a read, or made a new reader of an input, after its mutation). A custom op cannot
    return an alias of what it writes (``graphopt::rotary_cache_write`` writes a KV cache and
    returns the rotated q): a node reading R after such an M also reads M's result, which puts it
    after M in every order, and reads what M wrote."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    memo: dict = {}
    writes: dict = {}  # input -> positions of the nodes writing into it
    for n in gm.graph.nodes:
        for w in written_args(n):
            root = alias_root(w, memo)
            if root.op == "placeholder":
                writes.setdefault(root, []).append(order[n])
    if not writes:
        return None
    at = {i: n for n, i in order.items()}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue  # returns the tensors themselves: their final state, as eager returns them
        pn = order[n]
        for x in n.all_input_nodes:
            root = alias_root(x, memo)
            if root not in writes:
                continue
            px = order[x]
            for pm in writes[root]:
                if px < pm < pn:
                    m = at[pm]
                    if _returns_alias_of(m) is None and reads_result_of(n, m):
                        continue
                    return (f"{n.name} ({target_name(n)}) reads {x.name}, a value of {root.name} from before "
                            f"{m.name} ({target_name(m)}) writes it")
    return None


def connected_components(nodes, order: dict, joinable=lambda a, n: True) -> list[list[fx.Node]]:
    """Connected components of ``nodes`` (edges between the producer/consumer pairs among them
    that ``joinable`` accepts), each sorted in graph ``order``. Union-find with path halving."""
    members = set(nodes)
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in members and joinable(a, n):
                parent[find(a)] = find(n)
    comps: dict = {}
    for n in nodes:
        comps.setdefault(find(n), []).append(n)
    return [sorted(c, key=order.__getitem__) for c in comps.values()]


# an output at least this large, made by one op that nothing else reads, runs outside a replayed
# CUDA graph instead of being cloned out of it (graphopt.runtime.cuda_graphs; the cost model prices it)
TAIL_MIN_BYTES = 16 << 20


def flat_outputs(gm: fx.GraphModule):
    """The output node's flat tuple of values when the module unflattens them itself (pytree
    codegen, as capture makes), else None (also for a module that is not a GraphModule)."""
    if not isinstance(gm, fx.GraphModule):
        return None
    cg = gm.graph._codegen
    info = getattr(cg, "pytree_info", None)
    if not isinstance(cg, fx.graph._PyTreeCodeGen) or info is None or info.out_spec is None:
        return None
    flat = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(flat) if isinstance(flat, (tuple, list)) else None


def nbytes(val: torch.Tensor) -> int:
    return int(val.numel()) * val.element_size()


def tail_nodes(gm: fx.GraphModule, min_bytes: int = TAIL_MIN_BYTES) -> list[fx.Node]:
    """Output nodes that a replay can leave to an eager call after it: an ATen or graphopt op
    whose single, fresh (not a view) output is at least ``min_bytes``, read only by the output,
    returned once, that neither draws random numbers nor mutates its arguments."""
    flat = flat_outputs(gm)
    if flat is None:
        return []
    out = []
    for n in flat:
        if not isinstance(n, fx.Node) or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = n.target._schema
        if len(schema.returns) != 1 or schema.returns[0].alias_info is not None or schema.is_mutable:
            continue
        if flat.count(n) != 1 or len(n.users) != 1 or is_random(n):
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        try:
            big = nbytes(val) >= min_bytes
        except TypeError:  # symbolic size
            continue
        if big:
            out.append(n)
    return out
