"""Capture a model as a torch.fx GraphModule in graphopt's canonical op vocabulary.

torch.export (non-strict) is tried first; torch.fx.symbolic_trace is the fallback. Both end in
the same vocabulary: ATen overloads (``aten.conv2d.default``, ``aten.linear.default``,
``aten.add.Tensor``...), no in-place ops on intermediates, no eval-mode dropout, parameters and
buffers read with ``get_attr``, and ``meta["val"]`` on every node. Patterns are written once,
against this vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import ir, timing
from .capture_einsum import einsums_as_matmul
from .capture_mha import MhaCapture, batch_first_sdpa, resolve_mode
from .errors import CaptureError, traceback_requested

log = logging.getLogger("graphopt.capture")
aten = torch.ops.aten


@dataclass
class CaptureInfo:
    method: str  # "torch.export" | "symbolic_trace"
    export_error: str | None = None
    dynamic: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    num_inputs: int = 0
    mha: dict = field(default_factory=dict)  # nn.MultiheadAttention calls: SDPA form / kept (capture_mha)


# --------------------------------------------------------------------------- inputs


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    """example_inputs may be a tensor, a tuple/list of positional args, or a dict of kwargs."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if len(example_inputs) == 2 and isinstance(example_inputs[0], (tuple, list)) and isinstance(example_inputs[1], dict):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    raise CaptureError(
        f"example_inputs must be a tensor, a tuple of args or a dict of kwargs, got {type(example_inputs).__name__}"
    )


def flat_tensors(args: tuple, kwargs: dict) -> list:
    leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    return leaves


# --------------------------------------------------------------------------- Hugging Face outputs


def _register_hf_pytrees() -> None:
    """Teach torch.export to flatten transformers' caches: DynamicCache (returned by default
    configs), so the optimized module hands back the same ModelOutput-with-cache the model does,
    and StaticCache, so a decode step that writes into it can be captured."""
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.cache_utils import DynamicCache
    except Exception:  # pragma: no cover - very old/new transformers
        return
    from torch.utils import _pytree as pytree

    _register_static_cache()
    if DynamicCache in pytree.SUPPORTED_NODES:
        return

    def flatten(cache):
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        if any(k is None for k in keys):
            return [], 0
        return keys + values, len(keys)

    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - a transformers without per-layer cache classes
        DynamicLayer = None

    def unflatten(values, n):
        """The cache holding these keys and values. ``update`` would concatenate each to an empty
        past, a copy per layer on every call; a plain DynamicLayer is initialized on an empty slice
        and then holds the tensors themselves, which is what that concatenation returns a copy of."""
        cache = DynamicCache()
        values = list(values)
        for i in range(n):
            k, v = values[i], values[n + i]
            if DynamicLayer is not None and k.dim() >= 2 and v.dim() >= 2:
                cache.update(k.narrow(-2, 0, 0), v.narrow(-2, 0, 0), i)  # creates and initializes layer i
                layer = cache.layers[i] if len(getattr(cache, "layers", ())) > i else None
                if type(layer) is DynamicLayer:
                    layer.keys, layer.values = k, v
                    continue
            cache.update(k, v, i)  # another layer class (a sliding window keeps a suffix): its own update
        return cache

    def flatten_with_keys(cache):
        leaves, n = flatten(cache)
        return [(pytree.SequenceKey(i), v) for i, v in enumerate(leaves)], n

    try:
        pytree.register_pytree_node(
            DynamicCache,
            flatten,
            unflatten,
            serialized_type_name="transformers.cache_utils.DynamicCache",
            flatten_with_keys_fn=flatten_with_keys,
        )
        torch.fx._pytree.register_pytree_flatten_spec(DynamicCache, lambda c, spec: flatten(c)[0])
    except ValueError as e:  # registered meanwhile (by transformers itself)
        if "already registered" not in str(e):
            raise


_PLAIN = (int, float, bool, str, type(None), torch.device, torch.dtype)


def _static_cache_flatten(cache):
    """A StaticCache as its layers' tensors (each layer's tensor attributes, by name: keys,
    values, the position counter ``cumulative_length``) and a context holding every other
    attribute (class, sizes, device), so unflattening rebuilds an equal cache around the same
    tensors. The tensors are the graph's inputs; the in-place writes a step makes into them stay
    in the graph."""
    if getattr(cache, "offloading", False):
        raise ValueError("a StaticCache with offloading=True moves its tensors between devices on every call; "
                         "build it with offloading=False to capture a step")
    leaves, ctx = [], []
    for layer in cache.layers:
        attrs = vars(layer)
        names = tuple(sorted(k for k, v in attrs.items() if isinstance(v, torch.Tensor)))
        other = []
        for k, v in sorted(attrs.items()):
            if isinstance(v, torch.Tensor):
                continue
            if not isinstance(v, _PLAIN):
                raise ValueError(f"StaticCache layer attribute {k} is a {type(v).__name__}; only tensors and "
                                 "plain values can be captured")
            other.append((k, v))
        leaves.extend(attrs[n] for n in names)
        ctx.append((type(layer), names, tuple(other)))
    return leaves, (type(cache), tuple(ctx))


def _static_cache_unflatten(leaves, context):
    from transformers.cache_utils import Cache

    cache_type, ctx = context
    it = iter(leaves)
    layers = []
    for layer_type, names, other in ctx:
        layer = layer_type.__new__(layer_type)  # no __init__: it would allocate a position tensor
        layer.__dict__.update(dict(other))
        for n in names:
            setattr(layer, n, next(it))
        layers.append(layer)
    cache = cache_type.__new__(cache_type)
    Cache.__init__(cache, layers=layers)
    return cache


def _register_static_cache() -> None:
    try:
        from transformers.cache_utils import StaticCache
    except Exception:  # pragma: no cover - a transformers without it
        return
    from torch.utils import _pytree as pytree

    if StaticCache in pytree.SUPPORTED_NODES:
        return

    def flatten_with_keys(cache):
        leaves, ctx = _static_cache_flatten(cache)
        return [(pytree.SequenceKey(i), v) for i, v in enumerate(leaves)], ctx

    try:
        pytree.register_pytree_node(
            StaticCache,
            _static_cache_flatten,
            _static_cache_unflatten,
            serialized_type_name="transformers.cache_utils.StaticCache",
            flatten_with_keys_fn=flatten_with_keys,
        )
        torch.fx._pytree.register_pytree_flatten_spec(StaticCache, lambda c, spec: _static_cache_flatten(c)[0])
    except ValueError as e:  # registered meanwhile (by transformers itself)
        if "already registered" not in str(e):
            raise


# --------------------------------------------------------------------------- error location


def _user_frame(exc: BaseException) -> str | None:
    """The innermost frame of the user's code in an exception's traceback."""
    skip = (os.sep + "torch" + os.sep, os.sep + "graphopt" + os.sep, "<frozen", os.sep + "contextlib.py",
            os.sep + "transformers" + os.sep + "utils" + os.sep, os.sep + "nn" + os.sep + "modules" + os.sep)
    best = None
    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for fr in traceback.extract_tb(e.__traceback__):
            # (code generated at run time, "<string>" or "<eval_with_key>.3", is nobody's source)
            if not fr.filename.startswith("<") and not any(s in fr.filename for s in skip):
                best = fr
        e = e.__cause__ or e.__context__
    if best is None:
        return None
    line = (best.line or "").strip()
    return f"{best.filename}:{best.lineno} `{line}`"


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def _advice(exc: BaseException) -> str:
    text = str(exc)
    if "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__ or "control flow" in text:
        return ("control flow depends on tensor values; compute the branch outside the model, "
                "or use torch.cond / torch.where so both paths are traceable")
    if "not a known type" in text or "pytree" in text:
        return "an input or output type is not a tensor container torch.export understands; return tensors, tuples, dicts or register it with torch.utils._pytree"
    if any(s in text for s in _SHAPE_ERRORS):
        return ("an op rejected the shapes it was given: check that example_inputs are inputs the model runs on "
                "(their shapes, channels and lengths)")
    return "make the forward traceable by torch.export (the error is in parentheses)"


# what aten's and torch.nn's shape checks say when an op's operands do not fit each other
_SHAPE_ERRORS = ("shapes cannot be multiplied", "same reduction dim", "must match the size of tensor",
                 "Sizes of tensors must match", "size mismatch", "Given groups=", "is invalid for input of size",
                 "Expected input batch_size", "to have the same number of dimensions")


# --------------------------------------------------------------------------- capture


def capture(model: nn.Module, example_inputs, dynamic: dict | None = None, *, strategy: str = "auto",
            mha: str | None = None, stack_traces: bool = False, inference: bool = False) -> fx.GraphModule:
    """Capture ``model`` as a GraphModule whose outputs equal the model's.

    ``dynamic`` maps argument names to ``{dim: "name"}``, e.g. ``{"x": {0: "batch"}}``; dims that
    share a name share a symbol. Metadata (``meta["val"]``) then holds sympy expressions of those
    symbols. ``strategy`` is "auto" (export, then symbolic_trace), "export" or "symbolic_trace".
    ``mha``: "sdpa" captures eligible nn.MultiheadAttention self-attention calls in the batch-first
    SDPA form eager's fast path runs (graphopt.capture_mha), "module" keeps the module's own
    forward; default: the environment variable GRAPHOPT_MHA, else "sdpa".
    ``stack_traces``: keep torch.export's per-node source locations (``node.stack_trace``, the
    ``# File:`` comments of the generated code; graphopt itself never reads them). Recording and
    symbolizing them is a noticeable share of export's time, so they are off unless asked for
    (``optimize(dump_dir=...)`` asks).
    ``inference``: the graph will only run without gradients (optimize() without ``training``):
    export runs under ``torch.no_grad()`` and the model's switches to that same mode record nothing.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mha_record = MhaCapture(mode=resolve_mode(mha))
    args, kwargs = split_inputs(example_inputs)
    if not any(isinstance(x, torch.Tensor) for x in flat_tensors(args, kwargs)):
        raise CaptureError("example_inputs hold no tensor; pass at least one example tensor")
    _register_hf_pytrees()
    info = CaptureInfo(method="", dynamic=dict(dynamic or {}), num_inputs=len(flat_tensors(args, kwargs)))
    export_exc = None
    gm = None
    if strategy in ("auto", "export"):
        timing.progress("capturing the graph with torch.export")
        try:
            with batch_first_sdpa(model, mha_record):
                gm = _capture_export(model, args, kwargs, dynamic, stack_traces, inference)
            info.method = "torch.export"
            info.mha = mha_record.as_dict()
            info.notes.extend(mha_record.notes())
            # export's values count as propagated: the first re-propagation re-runs what changed
            ir.seed_propagation(gm)
        except CaptureError:
            raise
        except Exception as e:  # export failed: remember why, try the fallback
            export_exc = e
            info.export_error = _first_line(e)
            log.debug("torch.export failed", exc_info=True)
            if strategy == "export":
                raise _capture_error(model, e, None) from None
    if gm is None:
        if dynamic:
            raise _capture_error(model, export_exc, None,
                                 extra="torch.export failed with these dims dynamic, and its fallback "
                                       "(symbolic_trace) fixes every size: declare fewer dims dynamic "
                                       "(the batch alone), or none")
        try:
            timing.progress("capturing the graph with torch.fx.symbolic_trace (torch.export failed: %s)",
                            info.export_error or "not tried")
            with timing.phase("capture: symbolic_trace"):
                gm = _capture_symbolic(model, args, kwargs)
            info.method = "symbolic_trace"
        except Exception as e:
            raise _capture_error(model, export_exc or e, e) from None
        if export_exc is not None:
            info.notes.append(f"torch.export failed ({info.export_error}); captured with symbolic_trace")
    with timing.phase("capture: canonicalize"):
        canonicalize(gm, info)
    gm.meta["graphopt_capture"] = info
    return gm


def _capture_error(model, export_exc, trace_exc, extra: str = "") -> CaptureError:
    exc = export_exc or trace_exc
    where = _user_frame(exc) if exc is not None else None
    if where is None and trace_exc is not None:
        where = _user_frame(trace_exc)
    name = type(model).__name__
    parts = [f"cannot capture {name}"]
    if where:
        parts.append(f"at {where}")
    if exc is not None:
        parts.append(f"({_first_line(exc)})")
    if extra:
        parts.append(f"- {extra}")
    parts.append(f"- fix: {_advice(exc) if exc is not None else 'see above'}")
    err = CaptureError(" ".join(parts))
    graph = getattr(export_exc, "partial_fx_graph", None)
    err.partial_graph = None if graph is None else str(graph)
    return err


def _dynamic_shapes(model, args, kwargs, dynamic):
    if not dynamic:
        return None
    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs)
    dims: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    for pname in sig.parameters:
        if pname in bound.arguments:
            spec[pname] = None
    for argname, axes in dynamic.items():
        if argname not in bound.arguments:
            raise CaptureError(
                f"dynamic names argument '{argname}', but forward takes {list(bound.arguments)}"
            )
        val = bound.arguments[argname]
        if not isinstance(val, torch.Tensor):
            raise CaptureError(f"dynamic argument '{argname}' is not a tensor")
        entry = {}
        for axis, dname in axes.items():
            if not isinstance(axis, int) or not -val.dim() <= axis < val.dim():
                raise CaptureError(f"dynamic axis {axis} of '{argname}' is outside its {val.dim()} dims")
            if val.shape[axis] < 2:
                raise CaptureError(f"dynamic axis {axis} ('{dname}') of '{argname}' has size {val.shape[axis]} in the "
                                   "example; torch.export specializes sizes 0 and 1 - give an example with 2 or more "
                                   "there")
            if dname not in dims:
                dims[dname] = torch.export.Dim(dname)
            entry[axis % val.dim()] = dims[dname]
        spec[argname] = entry
    # dynamic_shapes must mirror the call: positional args by position, kwargs by name
    return spec


@contextlib.contextmanager
def _stack_traces(keep: bool):
    """torch.fx.config.do_not_emit_stack_traces for the duration of an export (torch versions
    without that switch record them either way)."""
    config = getattr(torch.fx, "config", None)
    if keep or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    prev = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = prev


@contextlib.contextmanager
def _module_conversions_that_change_nothing_skipped():
    """``Module.to(...)`` called by a forward while it is traced (Switch Transformers' router casts its
    classifier to the router dtype on every call) converts the module's parameters, which torch.export
    refuses ("Couldn't swap"); a call whose every parameter and buffer already has the dtype and device
    asked for changes nothing, so it returns the module as it is (what eager's conversion amounts to).
    Any other call converts as before."""
    nn_to = nn.Module.to

    def to(self, *args, **kwargs):
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except Exception:  # noqa: BLE001 - arguments torch itself will reject: its own error
            return nn_to(self, *args, **kwargs)
        if memory_format is None and all(
                (device is None or t.device == torch.device(device))
                and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
                for t in (*self.parameters(), *self.buffers())):
            return self
        return nn_to(self, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = nn_to


@contextlib.contextmanager
def _causal_mask_hints_left_unset():
    """nn.TransformerEncoder / nn.TransformerDecoder, given a mask and no ``is_causal`` hint, compare
    the mask with a causal one to set the hint (``torch.nn.modules.transformer._detect_is_causal_mask``):
    a branch on tensor values, which torch.export cannot trace. The hint only lets attention use a
    causal kernel instead of the mask; while a graph is captured it is left unset (False, the mask
    applied as given: the same values), unless the caller passed it. fuse_attention recognizes a
    constant causal mask in the graph by itself."""
    from torch.nn.modules import transformer

    detect = transformer._detect_is_causal_mask

    def hint_as_given(mask, is_causal=None, size=None):
        return is_causal is True

    transformer._detect_is_causal_mask = hint_as_given
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


@contextlib.contextmanager
def _inference_grad_mode(inference: bool):
    """For an inference capture: export under ``torch.no_grad()``, the model's own switches to the
    grad mode already in force skipped (transformers' decoders compute their rotary tables under
    ``@torch.no_grad()``). Export records every switch as a graph node, and on torch 2.11 one such
    node makes it split the whole graph and inline it back (replace_set_grad_with_hop_pass), a
    fifth of a 40-layer decoder's export. A switch that changes the mode (an ``enable_grad``
    region) is recorded as before; one that does not changes nothing, so skipping it is exact, in
    this thread and any other while the methods are replaced."""
    grad_mode = torch.autograd.grad_mode
    no_grad, enable_grad, set_grad = (getattr(grad_mode, n, None)
                                      for n in ("no_grad", "enable_grad", "set_grad_enabled"))

    def switch(mode) -> None:
        try:
            same = bool(mode) == torch.is_grad_enabled()
        except Exception:  # noqa: BLE001 - a mode that is not a plain bool: switch as torch would
            same = False
        if not same:
            torch._C._set_grad_enabled(mode)

    def entering(mode):
        def enter(self):
            self.prev = torch.is_grad_enabled()
            switch(mode)
        return enter

    def restore(self, *exc):
        switch(self.prev)

    def set_init(self, mode):
        self.prev = torch.is_grad_enabled()
        self.mode = mode
        switch(mode)

    def set_enter(self):
        switch(self.mode)

    def set_call(self, orig_func):
        switch(self.prev)
        return super(set_grad, self).__call__(orig_func)

    patches = [(no_grad, "__enter__", entering(False)), (no_grad, "__exit__", restore),
               (enable_grad, "__enter__", entering(True)), (enable_grad, "__exit__", restore),
               (set_grad, "__init__", set_init), (set_grad, "__enter__", set_enter), (set_grad, "__exit__", restore),
               (set_grad, "__call__", set_call)]
    if not inference or any(cls is None or name not in vars(cls) for cls, name, _ in patches):
        # (a torch whose classes are laid out otherwise keeps its own methods)
        with torch.no_grad() if inference else contextlib.nullcontext():
            yield
        return
    saved = [(cls, name, vars(cls)[name]) for cls, name, _ in patches]
    with torch.no_grad():
        try:
            for cls, name, fn in patches:
                setattr(cls, name, fn)
            yield
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)


def _lazy_graph_modules():
    """torch.fx's lazy GraphModules (code generated on first use) where this torch has them."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - torch releases graphopt supports all have it
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def _shape_solver_quiet():
    """torch's symbolic-shape solver logs its own failures at WARNING while export runs ("Failed to reduce
    inequalities" with a traceback, "Unable to find user code corresponding to u0"): on a capture with
    dynamic dims that fails, ~200 lines before graphopt's one-line error. Raised to ERROR while graphopt
    exports; GRAPHOPT_TRACEBACK=1 or TORCH_LOGS leave it alone."""
    if traceback_requested() or os.environ.get("TORCH_LOGS"):
        yield
        return
    solver = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = solver.level
    solver.setLevel(max(logging.ERROR, level))
    try:
        yield
    finally:
        solver.setLevel(level)


def _export(model, args, kwargs, shapes):
    """torch.export.export, non-strict. A failed trace makes torch print the graph traced so far
    to stderr before it raises; that text stays on the exception (``partial_fx_graph``, which
    CaptureError keeps as ``partial_graph``) so the one-line error comes first. Anything else
    written to stderr is passed on; GRAPHOPT_TRACEBACK=1 leaves torch's print alone."""
    if traceback_requested():
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
    buf, graph = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(buf):
            return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as e:
        graph = getattr(e, "partial_fx_graph", None)
        raise
    finally:
        text = buf.getvalue()
        if graph is not None:
            text = text.replace(f"{graph}\n", "")  # printed once per nested export wrapper
        if text:
            sys.stderr.write(text)


def _capture_export(model, args, kwargs, dynamic, stack_traces: bool = False,
                    inference: bool = False) -> fx.GraphModule:
    shapes = _dynamic_shapes(model, args, kwargs, dynamic)
    try:
        # export builds and rebuilds intermediate GraphModules of the whole model; lazy ones generate
        # their Python code only if something runs or reads it (the module handed back is a plain one)
        with timing.phase("capture: torch.export"), _stack_traces(stack_traces), _lazy_graph_modules(), \
                _inference_grad_mode(inference), _module_conversions_that_change_nothing_skipped(), \
                _causal_mask_hints_left_unset(), _shape_solver_quiet():
            ep = _export(model, args, kwargs, shapes)
    except Exception as e:
        if shapes and "Constraints violated" in str(e):
            raise CaptureError(
                f"a dim declared dynamic was specialized by the model ({_first_line(e)}) - "
                "drop it from dynamic= or remove the code that fixes its size"
            ) from None
        raise
    with timing.phase("capture: unlift (ep.module)"), _lazy_graph_modules():
        # (its intermediate modules' code, generated three or four times, is left ungenerated).
        # With static shapes no _guards_fn node: see _drop_call_checks
        gm = ep.module(check_guards=shapes is not None)
    if shapes is None:
        _drop_call_checks(gm)
    return gm


def _drop_call_checks(gm: fx.GraphModule) -> None:
    """ep.module()'s per-call input checks, on a graph with static shapes (captured without its
    ``_guards_fn`` node): forward pre-hooks matching each call's inputs against the example's
    structure and sizes. An optimized module's own guard (graphopt.api: the flat inputs' count,
    shapes, dtypes and devices, the values of non-tensor inputs) runs before any call reaches the
    graph, and the hooks alone cost tens of microseconds a call. Left in place where the module
    holds hooks other than export's (two pre-hooks, one forward hook) or takes a module as input."""
    from torch.export import _unlift

    pre, post = list(gm._forward_pre_hooks.values()), list(gm._forward_hooks.values())
    if len(pre) != 2 or len(post) != 1 or _unlift._check_input_constraints_pre_hook not in pre \
            or gm._backward_hooks or gm._backward_pre_hooks:
        return
    if any(isinstance(n.meta.get("val"), nn.Module) for n in gm.graph.find_nodes(op="placeholder")):
        return
    gm._forward_pre_hooks.clear()
    gm._forward_pre_hooks_with_kwargs.clear()
    gm._forward_hooks.clear()
    gm._forward_hooks_with_kwargs.clear()
    gm._forward_hooks_always_called.clear()


# --------------------------------------------------------------------------- symbolic_trace fallback


def _capture_symbolic(model, args, kwargs) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    ir.propagate_from_real(gm, list(args) + list(kwargs.values()))
    normalize_symbolic(gm)
    ir.propagate_from_real(gm, list(args) + list(kwargs.values()))
    return gm


_ACT_MODULES = {
    nn.ReLU: aten.relu.default,
    nn.SiLU: aten.silu.default,
    nn.Sigmoid: aten.sigmoid.default,
    nn.Tanh: aten.tanh.default,
    nn.Hardswish: aten.hardswish.default,
}
_FUNCS = {
    torch.relu: aten.relu.default, F.relu: aten.relu.default, torch.sigmoid: aten.sigmoid.default,
    torch.tanh: aten.tanh.default, F.silu: aten.silu.default, torch.exp: aten.exp.default,
}
_BINOPS = {
    operator.add: aten.add.Tensor, torch.add: aten.add.Tensor, operator.iadd: aten.add.Tensor,
    operator.mul: aten.mul.Tensor, torch.mul: aten.mul.Tensor, operator.imul: aten.mul.Tensor,
    operator.sub: aten.sub.Tensor, torch.sub: aten.sub.Tensor, operator.truediv: aten.div.Tensor,
    torch.div: aten.div.Tensor,
}


def normalize_symbolic(gm: fx.GraphModule) -> None:
    """Rewrite symbolic_trace's module calls and torch functions into ATen overloads."""
    g = gm.graph
    for node in list(g.nodes):
        repl = None
        with g.inserting_before(node):
            if node.op == "call_module":
                mod = gm.get_submodule(node.target)
                repl = _normalize_module(gm, node, mod)
            elif node.op == "call_function":
                if node.target in _FUNCS and len(node.args) == 1 and not node.kwargs:
                    repl = g.call_function(_FUNCS[node.target], node.args)
                elif node.target in _BINOPS and not node.kwargs and len(node.args) == 2:
                    a, b = node.args
                    if isinstance(a, fx.Node) and ir.is_tensor_node(a):
                        repl = g.call_function(_BINOPS[node.target], (a, b))
                elif node.target in (torch.flatten,) and ir.is_tensor_node(node.args[0]):
                    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
                    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
                    repl = g.call_function(aten.flatten.using_ints, (node.args[0], start, end))
        if repl is not None:
            ir.replace_with(node, repl)
            g.erase_node(node)
    g.lint()
    gm.recompile()


def _normalize_module(gm, node, mod):
    g = gm.graph
    x = node.args[0] if node.args else None
    if len(node.args) != 1 or node.kwargs:
        return None
    p = node.target

    def attr(name):
        return g.get_attr(f"{p}.{name}") if getattr(mod, name, None) is not None else None

    if type(mod) in _ACT_MODULES:
        return g.call_function(_ACT_MODULES[type(mod)], (x,))
    if isinstance(mod, nn.GELU):
        return g.call_function(aten.gelu.default, (x,), {"approximate": mod.approximate})
    if isinstance(mod, (nn.Identity,)) or (isinstance(mod, nn.Dropout) and not mod.training):
        return x
    if isinstance(mod, nn.Linear):
        return g.call_function(aten.linear.default, (x, attr("weight"), attr("bias")))
    if isinstance(mod, nn.Conv2d) and mod.padding_mode == "zeros" and not isinstance(mod.padding, str):
        return g.call_function(
            aten.conv2d.default,
            (x, attr("weight"), attr("bias"), list(mod.stride), list(mod.padding), list(mod.dilation), mod.groups),
        )
    if isinstance(mod, nn.modules.batchnorm._BatchNorm) and not mod.training and mod.track_running_stats:
        return g.call_function(
            aten.batch_norm.default,
            (x, attr("weight"), attr("bias"), attr("running_mean"), attr("running_var"), False,
             mod.momentum if mod.momentum is not None else 0.0, mod.eps, True),
        )
    if isinstance(mod, nn.LayerNorm):
        return g.call_function(aten.layer_norm.default, (x, list(mod.normalized_shape), attr("weight"), attr("bias"), mod.eps))
    if isinstance(mod, nn.MaxPool2d) and not mod.return_indices:
        k = list(mod.kernel_size) if isinstance(mod.kernel_size, tuple) else [mod.kernel_size] * 2
        s = mod.stride if mod.stride is not None else mod.kernel_size
        s = list(s) if isinstance(s, tuple) else [s] * 2
        pd = list(mod.padding) if isinstance(mod.padding, tuple) else [mod.padding] * 2
        d = list(mod.dilation) if isinstance(mod.dilation, tuple) else [mod.dilation] * 2
        return g.call_function(aten.max_pool2d.default, (x, k, s, pd, d, mod.ceil_mode))
    if isinstance(mod, nn.AdaptiveAvgPool2d):
        o = mod.output_size
        o = list(o) if isinstance(o, tuple) else [o, o]
        if None not in o:
            return g.call_function(aten.adaptive_avg_pool2d.default, (x, o))
    if isinstance(mod, nn.Flatten):
        return g.call_function(aten.flatten.using_ints, (x, mod.start_dim, mod.end_dim))
    return None


# --------------------------------------------------------------------------- canonical form


def _functional_variant(op: torch._ops.OpOverload):
    """aten.relu_.default -> aten.relu.default, aten.add_.Tensor -> aten.add.Tensor."""
    name = op._schema.name.split("::")[1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)


def canonicalize(gm: fx.GraphModule, info: CaptureInfo | None = None) -> None:
    """In-place ops on intermediates -> functional ops; dropout that is the identity as called
    (every spelling, :func:`remove_eval_dropout`), arithmetic with its unit (``x * 1.0``, ``x + 0``:
    :func:`remove_identity_arithmetic`) and export's dtype assertions on intermediates
    removed; einsums that are batched matrix products in matmul form (graphopt.capture_einsum)."""
    g = gm.graph
    changed = remove_eval_dropout(gm) > 0
    changed = remove_identity_arithmetic(gm) > 0 or changed
    changed = conv_padding_as_ints(gm) > 0 or changed
    _einsums_as_matmul(gm, info)
    roots: dict = {}
    kept: dict = {}  # input name -> the in-place ops writing into it
    for node in list(g.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is aten._assert_tensor_metadata.default:
            # export's record of an intermediate's dtype at trace time: true by construction of
            # the captured graph, and stale once a pass changes dtypes on purpose
            g.erase_node(node)
            changed = True
            continue
        if node.target._schema.is_mutable:
            func = _functional_variant(node.target)
            base = node.args[0] if node.args else None
            if func is None or not isinstance(base, fx.Node):
                continue
            root = ir.alias_root(base, roots)
            if root.op in ("placeholder", "get_attr"):
                kept.setdefault(root.name, []).append(node.name)  # the caller's tensor is written: in place
                continue
            # a view base would alias: keep mutations of views as they are
            if base.op == "call_function" and isinstance(base.target, torch._ops.OpOverload) and base.target.is_view:
                continue
            with g.inserting_before(node):
                new = g.call_function(func, node.args, node.kwargs)
            new.meta = dict(node.meta)
            later = _nodes_after(g, node)
            for user in list(base.users):
                if user is not node and user in later:
                    user.replace_input_with(base, new)
            node.replace_all_uses_with(new)
            g.erase_node(node)
            changed = True
    if changed:
        g.lint()
        gm.recompile()
    _drop_asserts_in_subgraphs(gm)
    if kept and info is not None:
        ops = sum(len(v) for v in kept.values())
        info.notes.append(f"{ops} in-place write(s) into {len(kept)} input(s) kept in place "
                          f"({', '.join(list(kept)[:4])}{', ...' if len(kept) > 4 else ''})")
    # what every pass must keep: the writes into inputs, and reads ordered around them
    gm.meta[ir.MUTATIONS] = ir.mutation_signature(gm)
    if gm.meta[ir.MUTATIONS] and ir.mutation_order_violation(gm) is not None:
        gm.meta[ir.MUTATION_ORDER_EXEMPT] = True


_CONV_BY_PADDING = {aten.conv1d.padding: (aten.conv1d.default, 1), aten.conv2d.padding: (aten.conv2d.default, 2),
                    aten.conv3d.padding: (aten.conv3d.default, 3)}


def conv_padding_as_ints(gm: fx.GraphModule) -> int:
    """Convolutions with ``padding="valid"`` or ``"same"`` (the ``.padding`` overloads) as the
    ``.default`` ones with integer padding, which every convolution pass matches: "valid" is 0;
    "same" is ``dilation * (k - 1) / 2`` each side where that total is even (aten pads such a
    convolution symmetrically, the same call); an odd total (aten pads one more on the right)
    stays as captured. Returns how many were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CONV_BY_PADDING:
            continue
        target, d = _CONV_BY_PADDING[node.target]
        sig = dict(zip(("input", "weight", "bias", "stride", "padding", "dilation", "groups"), node.args))
        sig.update(node.kwargs)
        w = sig["weight"].meta.get("val") if isinstance(sig["weight"], fx.Node) else None
        mode = sig.get("padding", "valid")
        if w is None or not isinstance(mode, str) or w.dim() != d + 2:
            continue

        def per_dim(v, default):
            v = default if v is None else v
            return [int(v)] * d if isinstance(v, int) else [int(x) for x in v]

        stride, dilation = per_dim(sig.get("stride"), 1), per_dim(sig.get("dilation"), 1)
        if mode == "valid":
            pad = [0] * d
        else:
            total = [dl * (int(k) - 1) for dl, k in zip(dilation, w.shape[2:])]
            if mode != "same" or any(t % 2 for t in total) or any(s != 1 for s in stride):
                continue
            pad = [t // 2 for t in total]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, (sig["input"], sig["weight"], sig.get("bias"), stride, pad, dilation,
                                                  int(sig.get("groups", 1))))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    return count


def _einsums_as_matmul(gm: fx.GraphModule, info: CaptureInfo | None) -> None:
    n, kept = einsums_as_matmul(gm)
    if info is None:
        return
    if n:
        info.notes.append(f"{n} einsum(s) that are batched matrix products captured as matmul")
    for why, names in kept.items():
        info.notes.append(f"einsum {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} kept as einsum: {why}")


# dropout spellings whose eager kernel returns its input itself when not training or when p == 0
# (aten's _dropout_impl); native_dropout, which returns a copy and a mask, is handled apart
_IDENTITY_DROPOUTS = frozenset({
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_"})
# torch functions symbolic_trace leaves in the graph: name -> (index of p, index of the training
# flag, its default)
_DROPOUT_FUNCS = {
    F.dropout: (1, 2, True), F.dropout1d: (1, 2, True), F.dropout2d: (1, 2, True), F.dropout3d: (1, 2, True),
    F.alpha_dropout: (1, 2, False), F.feature_alpha_dropout: (1, 2, False),
    torch.dropout: (1, 2, None), torch.dropout_: (1, 2, None), torch.feature_dropout: (1, 2, None),
    torch.feature_dropout_: (1, 2, None), torch.alpha_dropout: (1, 2, None), torch.alpha_dropout_: (1, 2, None),
    torch.feature_alpha_dropout: (1, 2, None), torch.feature_alpha_dropout_: (1, 2, None),
}

def _arg(node: fx.Node, index: int, names, default):
    if len(node.args) > index:
        return node.args[index]
    for nm in (names if isinstance(names, tuple) else (names,)):
        if nm in node.kwargs:
            return node.kwargs[nm]
    return default


def eval_dropout_input(gm: fx.GraphModule, node: fx.Node):
    """The node's input when ``node`` is a dropout that is the identity as called (not training, or
    p == 0, in any spelling: the ATen ops, ``F.dropout*``/``torch.*dropout*`` calls and
    ``nn.Dropout*`` modules left by symbolic_trace, in place or not); else None."""
    x, p, train = None, None, True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        if node.target._schema.name.split("::")[-1] not in _IDENTITY_DROPOUTS:
            return None
        x, p, train = node.args[0], _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
    elif node.op == "call_function" and node.target in _DROPOUT_FUNCS:
        pi, ti, default = _DROPOUT_FUNCS[node.target]
        if default is None and len(node.args) <= ti and "train" not in node.kwargs:
            return None  # a required argument missing: leave the call to fail as it would
        x = _arg(node, 0, "input", None)
        p, train = _arg(node, pi, "p", 0.5), _arg(node, ti, ("training", "train"), default)
    elif node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if not isinstance(mod, nn.modules.dropout._DropoutNd) or len(node.args) != 1 or node.kwargs:
            return None
        x, p, train = node.args[0], mod.p, mod.training
    else:
        return None
    if not isinstance(x, fx.Node) or isinstance(train, fx.Node) or isinstance(p, fx.Node):
        return None
    return x if (train is False or p == 0) else None


def remove_eval_dropout(gm: fx.GraphModule) -> int:
    """Remove every dropout that is the identity as called, so an inference graph has no random op
    where eager draws no random number (CUDA-graph lowering refuses random ops). ``native_dropout``
    with ``train=False`` returns a copy of its input and an all-true mask: the copy's readers read
    the input (a clone is kept when something writes through it), the mask becomes ``ones_like``.
    Returns the number of nodes removed."""
    g = gm.graph
    removed = 0
    aliasing = None
    for node in list(g.nodes):
        x = eval_dropout_input(gm, node)
        if x is not None:
            node.replace_all_uses_with(x)
            g.erase_node(node)
            removed += 1
            continue
        if node.op == "call_function" and node.target in (aten.native_dropout.default, torch.native_dropout) \
                and _arg(node, 2, "train", True) is False and isinstance(node.args[0], fx.Node):
            x = node.args[0]
            users = list(node.users)
            if not all(u.op == "call_function" and u.target is operator.getitem for u in users):
                continue
            for u in users:
                if not u.users:
                    g.erase_node(u)
                    continue
                with g.inserting_before(u):
                    if u.args[1] == 1:
                        new = g.call_function(aten.ones_like.default, (x,), {"dtype": torch.bool})
                    elif _written(u, aliasing := aliasing or ir.storages(gm)):
                        new = g.call_function(aten.clone.default, (x,))
                    else:
                        new = x
                if new is not x:
                    new.meta = dict(u.meta)
                u.replace_all_uses_with(new)
                g.erase_node(u)
            g.erase_node(node)
            removed += 1
    return removed


# arithmetic whose result is its tensor operand when the other operand is the unit: (unit, commutes)
_UNIT_ARITHMETIC = {
    aten.mul.Tensor: (1, True), aten.mul.Scalar: (1, True), aten.div.Tensor: (1, False),
    aten.div.Scalar: (1, False), aten.add.Tensor: (0, True), aten.add.Scalar: (0, True),
    aten.sub.Tensor: (0, False), aten.sub.Scalar: (0, False)}


def _is_unit(v, unit) -> bool:
    return type(v) in (int, float) and v == unit


def identity_arithmetic_input(node: fx.Node):
    """The tensor operand of ``node`` when ``node`` multiplies or divides it by one, or adds or
    subtracts zero (a disabled layer scale ``gamma = 1.0``, an accumulator started at ``0``), and
    the result has the operand's dtype, shape and strides (no promotion, no broadcast, no new
    layout); else None. The values are the operand's (``-0.0 + 0`` aside, which reads equal)."""
    if node.op != "call_function" or node.target not in _UNIT_ARITHMETIC:
        return None
    unit, commutes = _UNIT_ARITHMETIC[node.target]
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"} or isinstance(node.kwargs.get("alpha"), fx.Node):
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and _is_unit(b, unit):
        x = a
    elif commutes and isinstance(b, fx.Node) and _is_unit(a, unit):
        x = b
    else:
        return None
    out = ir.info(node)
    return x if out is not None and out == ir.info(x) else None  # dtype, shape, strides, device


def remove_identity_arithmetic(gm: fx.GraphModule) -> int:
    """Replace each :func:`identity_arithmetic_input` node by its operand where neither is written
    in place and the result is not a graph output (the caller would get the operand itself, an
    input or a parameter perhaps). Returns the number of nodes removed."""
    aliasing = None
    removed = 0
    for node in list(gm.graph.nodes):
        x = identity_arithmetic_input(node)
        if x is None or any(u.op == "output" for u in node.users):
            continue
        aliasing = aliasing or ir.storages(gm)
        if _written(node, aliasing) or _written(x, aliasing):
            continue
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        removed += 1
    return removed


def _written(node: fx.Node, aliasing) -> bool:
    """Does an in-place op write into ``node`` or a view of it? (``aliasing``: ir.storages)"""
    storage, writes = aliasing
    return bool(writes.get(storage.get(node, node)))


def _drop_asserts_in_subgraphs(gm: fx.GraphModule) -> None:
    """Export's dtype assertions also sit inside higher-order-op subgraphs (on CUDA, Hugging Face's
    autocast-disabled rotary region becomes ``wrap_with_autocast`` with a body graph); a pass that
    changes a dtype on purpose (assign_precision) must not trip them."""
    for name, sub in gm.named_modules():
        if sub is gm or not isinstance(sub, fx.GraphModule):
            continue
        dead = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default]
        for n in dead:
            sub.graph.erase_node(n)
        if dead:
            sub.recompile()


def _nodes_after(g: fx.Graph, node: fx.Node) -> set:
    out, seen = set(), False
    for n in g.nodes:
        if seen:
            out.add(n)
        if n is node:
            seen = True
    return out
