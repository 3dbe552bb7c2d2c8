"""The accuracy rule (docs/design.md), shared by the optimizer's guard and the tests.

pass if ``allclose(out, ref, atol=tol, rtol=tol)``; else if
``rmse(out, ref64) <= k * rmse(eager, ref64) + tol / 10`` with k = 2 for fp32 and 3 for
bf16/fp16; tol 1e-4 for fp32 inference, 1e-3 for fp32 training, 1e-2 for bf16/fp16. NaN never
passes. Integer and bool outputs must be equal.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

LOW_PRECISION = (torch.bfloat16, torch.float16)


def tolerance(dtype: torch.dtype, training: bool = False) -> float:
    if dtype in LOW_PRECISION:
        return 1e-2
    return 1e-3 if training else 1e-4


def k_factor(dtype: torch.dtype) -> float:
    return 3.0 if dtype in LOW_PRECISION else 2.0


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    d = a.detach().double() - b.detach().double()
    return float(torch.sqrt(torch.mean(d * d))) if d.numel() else 0.0


@dataclass
class LeafResult:
    index: int
    passed: bool
    how: str  # "allclose" | "rmse" | "exact" | "fail"
    max_abs_err: float
    rmse: float
    eager_rmse: float | None
    tol: float

    def as_dict(self):
        return dict(self.__dict__)


@dataclass
class AccuracyResult:
    passed: bool
    leaves: list[LeafResult] = field(default_factory=list)
    reason: str = ""

    @property
    def max_abs_err(self) -> float:
        return max((leaf.max_abs_err for leaf in self.leaves), default=0.0)

    @property
    def worst_rmse(self) -> float:
        return max((leaf.rmse for leaf in self.leaves), default=0.0)

    def as_dict(self):
        return {
            "passed": self.passed,
            "reason": self.reason,
            "max_abs_err": self.max_abs_err,
            "rmse": self.worst_rmse,
            "outputs": [leaf.as_dict() for leaf in self.leaves],
        }


def flatten_outputs(out) -> list:
    leaves, _ = pytree.tree_flatten(out)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


# elements per chunk of a comparison: a decoder's logits (10^9 elements) are compared without
# materializing float64 copies of the whole tensor. A chunk is at most an eighth of the tensor (its
# float64 temporaries then stay about the size of the output itself), but not under _MIN_CHUNK.
_CHUNK = 1 << 23
_MIN_CHUNK = 1 << 16


def _chunk_elems(n: int) -> int:
    return max(1, min(_CHUNK, max(_MIN_CHUNK, -(-n // 8))))


def _stats(out: torch.Tensor, ref: torch.Tensor, tol: float, device: torch.device | None = None):
    """One chunked float64 pass over ``out`` vs ``ref`` on ``device`` (default: out's): (sum of squared
    error over the elements where ref is finite, their count, max |err| over them, allclose(atol=rtol=tol,
    equal_nan) over all, any NaN in out, any NaN in ref), as device tensors (one sync later). Either
    tensor may wait on the host: it moves to ``device`` a chunk at a time."""
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    dev = o.device if device is None else torch.device(device)
    acc = torch.zeros(2, dtype=torch.float64, device=dev)  # squared error, finite count
    worst = torch.zeros((), dtype=torch.float64, device=dev)
    flags = torch.zeros(3, dtype=torch.bool, device=dev)  # not close, nan in out, nan in ref
    step = _chunk_elems(o.numel())
    to_gpu = dev.type == "cuda"  # (a copy to the host must finish before the host reads it)
    for s in range(0, o.numel(), step):
        # a chunk on the host moves in its own dtype (asynchronously from page-locked memory) and is
        # widened on the device: widening first would make a pageable float64 copy on the host
        oc = o[s:s + step].to(device=dev, non_blocking=to_gpu).to(torch.float64)
        rc = r[s:s + step].to(device=dev, non_blocking=to_gpu).to(torch.float64)
        fin = torch.isfinite(rc)
        d = torch.where(fin, oc - rc, 0.0)
        acc += torch.stack([(d * d).sum(), fin.sum(dtype=torch.float64)])
        worst = torch.maximum(worst, d.abs().max()) if d.numel() else worst
        flags |= torch.stack([~torch.isclose(oc, rc, rtol=tol, atol=tol, equal_nan=True).all(),
                              torch.isnan(oc).any(), torch.isnan(rc).any()])
        del oc, rc, fin, d
    return acc, worst, flags


def _rmse_of(acc) -> float:
    total, count = acc.tolist()
    return (total / count) ** 0.5 if count else 0.0


def compare_leaf(i, out, ref64, eager, training=False, dtype=None, cache: dict | None = None) -> LeafResult:
    """The rule on one output. ``cache``: a dict the caller keeps across checks against the same
    ``ref64``/``eager`` pair (the eager rmse is then computed once)."""
    if out.shape != ref64.shape:
        return LeafResult(i, False, "fail", float("inf"), float("inf"), None, 0.0)
    if not (out.is_floating_point() or out.is_complex()):
        same = torch.equal(out, ref64.to(device=out.device, dtype=out.dtype))
        return LeafResult(i, same, "exact" if same else "fail", 0.0 if same else float("inf"), 0.0, None, 0.0)
    if dtype is None:
        dtype = eager.dtype if eager is not None and eager.is_floating_point() else out.dtype
    tol = tolerance(dtype, training)
    if out.is_complex():  # rare: the plain float64 path
        o, r = out.detach().to(torch.complex128), ref64.detach().to(device=out.device, dtype=torch.complex128)
        err = rmse(o, r)
        max_err = float((o - r).abs().max()) if o.numel() else 0.0
        if torch.allclose(o, r, atol=tol, rtol=tol, equal_nan=True):
            return LeafResult(i, True, "allclose", max_err, err, None, tol)
        eager_err = rmse(eager.detach().to(device=o.device, dtype=o.dtype), r) if eager is not None else None
    else:
        # the comparison runs in float64 on the output's device (a GPU holds a decoder's logits, the
        # host may not), chunk by chunk, with one device sync
        acc, worst, flags = _stats(out, ref64, tol)
        not_close, nan_out, nan_ref = flags.tolist()
        if nan_out and not nan_ref:
            return LeafResult(i, False, "fail", float("nan"), float("nan"), None, tol)
        err, max_err = _rmse_of(acc), float(worst)
        if not not_close:
            return LeafResult(i, True, "allclose", max_err, err, None, tol)
        eager_err = None
        if eager is not None:
            key = (i, id(eager), id(ref64))
            if cache is not None and key in cache:
                eager_err = cache[key]
            else:
                # the rmse over the elements where the reference is finite, as for the output (on the
                # output's device: the eager output and the reference may wait on the host)
                eager_err = _rmse_of(_stats(eager, ref64, tol, out.device)[0])
                if cache is not None:
                    cache[key] = eager_err
    if eager_err is not None and err <= k_factor(dtype) * eager_err + tol / 10:
        return LeafResult(i, True, "rmse", max_err, err, eager_err, tol)
    return LeafResult(i, False, "fail", max_err, err, eager_err, tol)


def check(out, ref64, eager, training: bool = False, dtype: torch.dtype | None = None,
          cache: dict | None = None) -> AccuracyResult:
    """Apply the accuracy rule to every tensor leaf of (possibly nested) outputs. The tolerance
    follows the eager output's dtype unless ``dtype`` names the precision being judged. ``cache``:
    see :func:`compare_leaf` (the caller must keep ``ref64`` and ``eager`` alive with it)."""
    outs, refs = flatten_outputs(out), flatten_outputs(ref64)
    eagers = flatten_outputs(eager) if eager is not None else [None] * len(refs)
    if len(outs) != len(refs):
        return AccuracyResult(False, [], f"{len(outs)} outputs, expected {len(refs)}")
    leaves = [compare_leaf(i, o, r, e, training, dtype, cache) for i, (o, r, e) in enumerate(zip(outs, refs, eagers))]
    bad = [leaf for leaf in leaves if not leaf.passed]
    reason = ""
    if bad:
        b = bad[0]
        reason = (f"output {b.index}: max |err| {b.max_abs_err:.3g}, rmse {b.rmse:.3g} "
                  f"vs eager rmse {b.eager_rmse if b.eager_rmse is None else f'{b.eager_rmse:.3g}'} (tol {b.tol:g})")
    return AccuracyResult(not bad, leaves, reason)


def _to_double(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a large float64 reference output is kept in, for an eager output of ``dtype``: float32
    for a bf16/fp16 output (its rounding, 2^-24 relative, is 2^-16 of the output dtype's: invisible to
    the rule, half the bytes to hold and move), float64 otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else torch.float64


def offload(out, nbytes: float):
    """``out`` with its GPU tensors moved to the host when they hold more than ``nbytes`` in total (the
    rule compares chunk by chunk on the output's device, moving them back a chunk at a time)."""
    leaves, spec = pytree.tree_flatten(out)
    on_gpu = [x for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cuda"]
    if sum(x.numel() * x.element_size() for x in on_gpu) <= nbytes:
        return out
    leaves = [_to_host(x) if isinstance(x, torch.Tensor) and x.device.type == "cuda" else x for x in leaves]
    return pytree.tree_unflatten(leaves, spec)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied to page-locked host memory, where both this copy and the chunks the rule moves
    back run at the bus's rate (a pageable copy runs at a fraction of it); pageable memory where
    page-locked memory cannot be had. :func:`release_host_memory` unlocks it again."""
    dst = _page_locked_empty(x.shape, x.dtype, x.device)
    return dst.copy_(x.detach())


def _page_locked_empty(shape, dtype, device: torch.device) -> torch.Tensor:
    """A host tensor page-locked in place: its pages are first touched by torch's CPU threads in
    parallel (``zero_``), then registered with CUDA (cudaHostRegister) - several times faster for a
    buffer of gigabytes than cudaHostAlloc, which touches every page from one thread. Registered
    tensors are kept until :func:`release_host_memory` unregisters them (a tensor must not be freed
    while registered; ``device``: the GPU whose copies read it, waited for before then). Pageable
    where registering fails."""
    dst = torch.empty(shape, dtype=dtype)
    nbytes = dst.numel() * dst.element_size()
    if nbytes == 0:
        return dst
    dst.zero_()
    try:
        err = torch.cuda.cudart().cudaHostRegister(dst.data_ptr(), nbytes, 0)
    except (RuntimeError, AttributeError):
        return dst
    if int(err) != 0:
        return dst
    _registered.append((dst, device))
    return dst


_registered: list = []  # (host tensor page-locked by _page_locked_empty, the GPU reading it)


def release_host_memory() -> None:
    """Unlock the host memory the guard page-locked for its offloaded outputs (after the device has
    finished every copy from it); the tensors are then ordinary pageable ones, freed with the guard."""
    if not _registered:
        return
    for device in {d for _, d in _registered}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    cudart = torch.cuda.cudart()
    while _registered:
        cudart.cudaHostUnregister(_registered.pop()[0].data_ptr())


# the tensor metadata a model may read from a weight without computing with it
_METADATA = {"shape", "dtype", "ndim", "layout", "device", "is_cuda", "requires_grad", "size", "dim", "numel",
             "nelement", "ndimension", "is_floating_point", "is_complex", "element_size", "stride", "get_device",
             "is_contiguous"}
_DEVICE_METADATA = {"device", "is_cuda", "get_device"}


def _metadata_name(func) -> str | None:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.shape.__get__
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name if name in _METADATA else None


def _grouped_mm_plain(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch's grouped matrix multiply (a mixture of experts' per-expert products) as plain matmuls,
    for a dtype its kernels lack (float64): 3-D x 3-D is a batched matmul; with ``offs`` (the groups'
    cumulative ends) the 2-D operand's jagged dimension is cut into groups: mat_a's rows (2-D x 3-D,
    a row after the last group is left 0), mat_b's columns (3-D x 2-D), or the K both share (2-D x
    2-D, one product per group). ``out_dtype`` does not narrow a float64 result; a ``bias`` (which
    torch's own kernels refuse today) is refused."""
    if bias is not None:
        raise ValueError("grouped_mm with a bias: no float64 form in graphopt's reference")
    ends = [] if offs is None else [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        return torch.bmm(mat_a, mat_b)
    if offs is None:
        raise ValueError(f"grouped_mm of {mat_a.dim()}-D by {mat_b.dim()}-D operands needs offs")
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = mat_a[s:e] @ mat_b[g]
        return out
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        out = mat_a.new_zeros(mat_a.shape[1], mat_b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = mat_a[g] @ mat_b[:, s:e]
        return out
    out = mat_a.new_zeros(len(ends), mat_a.shape[0], mat_b.shape[-1])
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[g] = mat_a[:, s:e] @ mat_b[s:e]
    return out


# ------------------------------------------------------------- a model's Python-side state
# the entries nn.Module keeps in every module's __dict__ (parameters, buffers, submodules, hooks,
# training): not Python-side state; what a forward may store besides them is
_MODULE_OWN = frozenset(vars(torch.nn.Module()))
# objects of these packages' classes are not walked into (a logger, a lock, torch's own objects)
_NOT_WALKED = frozenset(sys.stdlib_module_names) | {"builtins", "torch"}
_MISSING = object()
_SCALARS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _walked_object(v) -> bool:
    """An object whose attributes the walk follows: of a class of the model's or another library's (a
    cache holder, a config), not a type, function, module or nn.Module, nor of Python's or torch's."""
    if isinstance(v, (type, types.ModuleType, torch.nn.Module)) or callable(v):
        return False
    return isinstance(getattr(v, "__dict__", None), dict) and type(v).__module__.split(".")[0] not in _NOT_WALKED


class ModuleState:
    """The Python-side state of a module tree, taken when made: every module's ``__dict__`` entries
    beside nn.Module's own (a cache a forward fills, ``self.cache[device] = f(weight)``), and what the
    dicts, lists and sets and the plain objects' attributes reachable from them hold (a few levels
    down). :meth:`restore` puts back in place what changed: the same objects under the same names (the
    parameters' and buffers' too), each container holding what it held, the entries a run added removed. So a run of the model
    (graphopt's float64 reference, an eager run of the guard, a capture that traces the forward with
    fake tensors) neither leaves what it stored behind (a float64 tensor the caller's next bf16 call
    would read) nor reads what another run stored.

    ``tensors``: the tensors held in that state (by id; the state keeps them alive), which a run in
    another dtype converts as it reads them (:class:`_Float64State`)."""

    DEPTH = 6
    # entries the walk looks into at most: past it the containers it meets are still recorded (a
    # module's own dicts and lists always are), their contents not followed. Scalars do not count (a
    # list of 38416 index ints in each of LeViT's attention blocks once used up the budget before the
    # walk reached the cache dicts after them); they count against MAX_SCANNED, which bounds the
    # walk's time over huge lists of them the same way
    MAX_ENTRIES = 1 << 16
    MAX_SCANNED = 1 << 21

    def __init__(self, model: torch.nn.Module):
        self.attrs = [(m, {k: v for k, v in vars(m).items() if k not in _MODULE_OWN}) for m in model.modules()]
        # which tensor each parameter and buffer name holds: a forward that assigns one
        # (``self.steps += 1``, ``self.ema = 0.9 * self.ema + ...``) puts its result there, and in the
        # float64 run that result is a float64 copy
        self.members = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
        self.contents: dict = {}  # id -> (container, a shallow copy of what it held)
        self.tensors: dict = {}  # id -> tensor
        self._entries = self._scanned = 0
        for _, attrs in self.attrs:
            for v in attrs.values():
                self._walk(v, 0)

    def _walk(self, v, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            self.tensors.setdefault(id(v), v)
            return
        if depth >= self.DEPTH:
            return
        if _walked_object(v):
            v = vars(v)  # its attributes: a dict, kept as one
        if isinstance(v, tuple) and not isinstance(v, torch.Size):
            items = v
        elif isinstance(v, (dict, list, set)):
            if id(v) in self.contents:
                return
            self.contents[id(v)] = (v, dict(v) if isinstance(v, dict) else list(v))
            items = v.values() if isinstance(v, dict) else v
        else:
            return
        for x in list(items):
            self._scanned += 1
            if self._scanned > self.MAX_SCANNED:
                return
            if x is None or isinstance(x, _SCALARS):
                continue
            if self._entries > self.MAX_ENTRIES:
                return
            self._entries += 1
            self._walk(x, depth + 1)

    def restore(self) -> None:
        for m, params, buffers in self.members:
            for now, held in ((m._parameters, params), (m._buffers, buffers)):
                if len(now) != len(held) or any(now.get(k, _MISSING) is not v for k, v in held.items()):
                    now.clear()
                    now.update(held)
        for obj, held in self.contents.values():
            if isinstance(obj, dict):
                if len(obj) != len(held) or any(obj.get(k, _MISSING) is not x for k, x in held.items()):
                    obj.clear()
                    obj.update(held)
            elif isinstance(obj, list):
                if len(obj) != len(held) or any(a is not b for a, b in zip(obj, held)):
                    obj[:] = held
            elif len(obj) != len(held) or any(x not in obj for x in held):
                obj.clear()
                obj.update(held)
        for m, attrs in self.attrs:
            d = vars(m)
            for k in [k for k in d if k not in _MODULE_OWN and k not in attrs]:
                del d[k]
            for k, v in attrs.items():
                if d.get(k, _MISSING) is not v:
                    d[k] = v


@contextlib.contextmanager
def module_state_kept(model: torch.nn.Module):
    """The model's Python-side state (:class:`ModuleState`) as it was on entry, again on exit."""
    state = ModuleState(model)
    try:
        yield state
    finally:
        state.restore()


# torch functions without a float64 kernel on some device, run as plain ops in the float64 reference
_FLOAT64_PLAIN = {"grouped_mm": _grouped_mm_plain, "_grouped_mm": _grouped_mm_plain}

# factories whose result takes the default dtype when no dtype is given (and, for these, always a float one)
_FLOAT_FACTORIES = {"zeros", "ones", "empty", "empty_strided", "rand", "randn", "eye", "linspace", "logspace"}
# random ones among them draw in the default dtype, as the model does, and are widened after: the
# same numbers (a float64 draw takes other bits from the generator)
_RANDOM_FACTORIES = {"rand", "randn"}


def _makes_default_float(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether torch.<name>(*args, **kwargs), given no dtype, makes a tensor of the default (float) dtype:
    the float factories, ``full`` of a Python float, ``arange`` over a float bound or step, ``tensor``
    and ``scalar_tensor`` of Python floats."""
    if kwargs.get("dtype") is not None:
        return False
    if name in _FLOAT_FACTORIES:
        return True
    if name == "full":
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return isinstance(fill, float)
    if name == "arange":
        return any(isinstance(a, float) for a in (*args, kwargs.get("start"), kwargs.get("end"), kwargs.get("step")))
    if name in ("tensor", "scalar_tensor"):
        data = args[0] if args else kwargs.get("data", kwargs.get("s"))
        leaves = pytree.tree_leaves(data) if isinstance(data, (list, tuple)) else [data]
        return any(isinstance(x, float) for x in leaves) and not any(isinstance(x, torch.Tensor) for x in leaves)
    return False


def widened_factory(func, args: tuple, kwargs: dict, dtype: torch.dtype):
    """A torch factory call that makes a tensor in the default dtype, made in ``dtype`` as when it is
    the default (random ones drawn as the model draws them, then widened: the same numbers); None for
    any other call."""
    name = getattr(func, "__name__", "")
    if getattr(torch, name, None) is not func or not _makes_default_float(name, args, kwargs):
        return None
    if name in _RANDOM_FACTORIES:
        return func(*args, **kwargs).to(dtype)
    return func(*args, **dict(kwargs, dtype=dtype))


def widened_cast(func, args: tuple, kwargs: dict, dtype: torch.dtype):
    """A cast to the default float dtype (``x.float()``, ``x.to(torch.float32)``, ``x.to(other)`` of that
    dtype), made to ``dtype`` instead: in a float64 run, what a forward casts to float32 on purpose (an
    integer grid it computes with, a norm's statistics in float32) stays exact; None for any other call."""
    if func is torch.Tensor.float and len(args) == 1 and set(kwargs) <= {"memory_format"}:
        return args[0].to(dtype, memory_format=kwargs.get("memory_format", torch.preserve_format))
    if func is not torch.Tensor.to or not args or not isinstance(args[0], torch.Tensor):
        return None
    rest = dict(kwargs)
    copy = rest.pop("copy", False)
    try:
        device, want, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **rest)
    except (TypeError, RuntimeError):
        return None
    if want != torch.get_default_dtype() or want == dtype:
        return None
    return args[0].to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy,
                      memory_format=memory_format if memory_format is not None else torch.preserve_format)


class _Float64State(torch.overrides.TorchFunctionMode):
    """Run a model as ``model.to(dtype)`` would (float64 by default; for float64, with it the default
    dtype: a float tensor the forward makes without a dtype is made in it, and a cast to the default
    dtype casts to it), without a converted copy of
    it: every torch function that reads one of the model's parameters or buffers gets a converted
    copy of that tensor made for the call (a buffer is always copied, so in-place updates —
    BatchNorm's statistics and its step counter — land on the copy, never on the model); reading a
    weight's metadata (shape, dtype, device...) converts nothing. Only the tensors one call reads
    exist converted at a time (a block of the largest weight, not all of them).

    ``narrow_outputs``: ``{shape: dtype}`` of outputs kept in a narrower dtype (a decoder's logits:
    :func:`reference_dtype`): a projection over a large weight whose result has one of these shapes
    writes it, block by block, into a tensor of that dtype (never whole in float64); the model sees
    the float64 tensor it would have had (metadata included), and an op that reads it gets it back
    in float64 (after which outputs of that shape are made in float64 again).

    The model's Python-side state (:class:`ModuleState`) is as a converted copy's would be: the
    tensors it holds (a cache a forward filled in the model's dtype) are converted as they are
    read, like buffers, and what the run stores there (float64 tensors) is undone on exit."""

    # converted bytes of a weight's block: at most CHUNK_BYTES, and at most a 32nd of the model's own
    # bytes (but not under MIN_CHUNK_BYTES), so what one op converts stays small beside the model
    CHUNK_BYTES = 64 << 20
    MIN_CHUNK_BYTES = 1 << 20

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.float64, narrow_outputs: dict | None = None):
        super().__init__()
        self.dtype = dtype
        params, buffers = list(model.parameters()), list(model.buffers())
        self.params = {id(p) for p in params}
        self.buffers = {id(b) for b in buffers}
        own = sum(t.numel() * t.element_size() for t in (*params, *buffers))
        self.block_bytes = min(self.CHUNK_BYTES, max(self.MIN_CHUNK_BYTES, own // 32))
        self.narrow_outputs = dict(narrow_outputs or {})
        self.narrowed: dict = {}  # id -> [the narrow tensor, its float64 form once an op read it]
        self.model = model
        self.state: ModuleState | None = None  # taken on entry, restored on exit
        self.held: dict = {}  # id -> a tensor the model's Python-side state held on entry (read as a buffer)

    def __enter__(self):
        self.state = ModuleState(self.model)
        self.held = self.state.tensors
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.state.restore()
            self.state, self.held = None, {}

    def _swap(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        key = id(x)
        if key in self.narrowed:
            entry = self.narrowed[key]
            if entry[1] is None:  # not an output after all: float64 again, and for its shape from now on
                entry[1] = entry[0].to(self.dtype)
                self.narrow_outputs.pop(tuple(entry[0].shape), None)
            return entry[1]
        if key in self.params:
            return x.detach().to(self.dtype) if x.is_floating_point() else x.detach()
        if key in self.buffers or key in self.held:
            return x.detach().to(self.dtype, copy=True) if x.is_floating_point() else x.detach().clone()
        return x

    def _big(self, w) -> bool:
        return (isinstance(w, torch.Tensor) and id(w) in self.params and w.is_floating_point()
                and w.dim() == 2 and w.numel() * self.dtype.itemsize > self.block_bytes)

    def _metadata(self, name: str, func, args, kwargs):
        """The metadata the converted tensor would have (NotImplemented when ``args[0]`` is not ours)."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return NotImplemented
        key = id(x)
        if key not in self.narrowed and key not in self.params and key not in self.buffers and key not in self.held:
            return NotImplemented
        if name in _DEVICE_METADATA:
            return func(*args, **kwargs)
        stand_in = torch.empty_strided(x.shape, x.stride(), device="meta",
                                       dtype=self.dtype if x.is_floating_point() else x.dtype)
        return func(stand_in, *args[1:], **kwargs)

    def _projection(self, x, w, b):
        """``linear(x, w, b)`` over blocks of w's rows converted one at a time, written into one output
        (of the narrow dtype when its shape is one of ``narrow_outputs``)."""
        rows = max(1, self.block_bytes // (w.shape[1] * self.dtype.itemsize))
        shape = (*x.shape[:-1], w.shape[0])
        narrow = self.narrow_outputs.get(tuple(shape))
        out = torch.empty(shape, dtype=narrow or self.dtype, device=x.device)
        for i in range(0, w.shape[0], rows):
            part = torch.nn.functional.linear(x, w[i:i + rows].detach().to(self.dtype), None if b is None else b[i:i + rows])
            out[..., i:i + rows].copy_(part)
            del part
        if narrow is not None:
            self.narrowed[id(out)] = [out, None]
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _metadata_name(func)
        if name is not None:
            got = self._metadata(name, func, args, kwargs)
            if got is not NotImplemented:
                return got
        # in a float64 run, a tensor the model makes in the default dtype is made in float64, as when
        # it is the default (a float64 run's torch.finfo(x.dtype).min does not fit the float32 default);
        # a run in a low dtype is what model.to(dtype) computes, whose factories keep the default
        if self.dtype == torch.float64:
            made = widened_factory(func, args, kwargs, self.dtype)
            if made is not None:
                return made
        # a large weight is never converted whole: a projection runs over blocks of its rows, an
        # embedding gathers its rows first (the same values as converting the whole weight)
        if func is torch.nn.functional.linear and len(args) >= 2 and self._big(args[1]):
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return self._projection(self._swap(args[0]), args[1], None if b is None else self._swap(b))
        if (func is torch.nn.functional.embedding and len(args) >= 2 and self._big(args[1])
                and kwargs.get("max_norm") is None and (len(args) < 4 or args[3] is None)):
            return args[1].detach()[self._swap(args[0])].to(self.dtype)
        args, kwargs = pytree.tree_map(self._swap, (args, kwargs))
        if self.dtype == torch.float64:
            cast = widened_cast(func, args, kwargs, self.dtype)
            if cast is not None:
                return cast
        plain = _FLOAT64_PLAIN.get(getattr(func, "__name__", ""))
        if plain is not None and any(isinstance(t, torch.Tensor) and t.dtype == self.dtype
                                     for t in pytree.tree_leaves((args, kwargs))):
            return plain(*args, **kwargs)
        return func(*args, **kwargs)


def fp64_reference(model: torch.nn.Module, args: tuple, kwargs: dict, *, offload_bytes: float | None = None,
                   like=None, large_bytes: float | None = None):
    """The model run in float64 on float64 copies of the inputs: what ``copy.deepcopy(model).double()``
    computes, with each parameter and buffer converted when an op reads it (:class:`_Float64State`)
    instead of a float64 copy of the whole model beside it.

    ``like`` (the eager outputs of the same call: their shapes and dtypes) and ``large_bytes``: an
    output whose float64 form is larger than ``large_bytes`` is kept in :func:`reference_dtype` of its
    eager output's dtype, written so where a projection makes it (a decoder's logits: never whole in
    float64). ``offload_bytes``: outputs on a GPU larger than this in total are then moved to the host
    (:func:`offload`; a device sync)."""
    a, k = pytree.tree_map(_to_double, (args, kwargs))
    likes = flatten_outputs(like) if like is not None else []
    narrow = {}
    if large_bytes is not None:
        narrow = {tuple(e.shape): reference_dtype(e.dtype) for e in likes
                  if e.is_floating_point() and e.numel() * 8 > large_bytes and reference_dtype(e.dtype) != torch.float64}
    with torch.no_grad(), _Float64State(model, narrow_outputs=narrow):
        out = model(*a, **k)
    if narrow:  # a large output another op made: narrowed at the end
        leaves, spec = pytree.tree_flatten(out)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if len(tensors) == len(likes):
            want = {id(t): narrow.get(tuple(t.shape)) for t, e in zip(tensors, likes)
                    if t.dtype == torch.float64 and t.shape == e.shape}
            leaves = [x.to(want[id(x)]) if isinstance(x, torch.Tensor) and want.get(id(x)) else x for x in leaves]
            out = pytree.tree_unflatten(leaves, spec)
    if offload_bytes is not None:
        out = offload(out, offload_bytes)
    return out


# ------------------------------------------------------------- the low-precision yardstick
# The matrix-multiplying functions whose fp32 inputs the floor run rounds to the low dtype.
_MATMUL_FUNCS = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
                 "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                 "conv_transpose3d", "scaled_dot_product_attention"}


class _RoundMatmulInputs(torch.overrides.TorchFunctionMode):
    """Round every fp32 tensor a matrix multiply (linear, matmul, conv, SDPA...) reads to ``dtype``
    and back; the arithmetic itself stays fp32. What is left is the error that running the matrix
    multiplies in bf16/fp16 with fp32 accumulation cannot avoid."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _MATMUL_FUNCS:
            rnd = lambda t: t.to(self.dtype).to(t.dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
            args, kwargs = pytree.tree_map(rnd, (args, kwargs))
        return func(*args, **kwargs)


def matmul_floor(model: torch.nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, training: bool = False):
    """The model as written (fp32), but with every matrix multiply's inputs rounded to ``dtype``:
    the yardstick a lowered graph is judged against. Running the GEMMs in bf16 is what lower
    precision is for, so their input rounding is the error any assignment accepts; an assignment
    that adds much more than that (a cancellation, an overflow, a long reduction done in bf16)
    fails the rule and the offending nodes go back to fp32."""
    with _RoundMatmulInputs(dtype), torch.set_grad_enabled(training):
        return model(*args, **kwargs)
