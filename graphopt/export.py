"""Export an optimized module as TorchScript (report embedded) or a torch.export ``.pt2``, and
load either back.

Artifacts take and return flat tensors (the model's inputs and outputs flattened with
torch.utils._pytree); ``graphopt.load`` restores the nesting from the stored tree specs (for
Hugging Face ``ModelOutput``/``DynamicCache`` it imports the transformers modules the spec
names), and returns the flat tuple, saying so in ``.notes``, when they cannot be restored.
The input signature the module was optimized for (shapes, dtypes, dynamic dims, the values of
non-tensor inputs) is stored too, and the loaded module refuses other inputs with ``GuardError`` as
the optimized one does; it re-spells a call as the optimized one (positional arguments by the
forward's parameter names, keywords in any order).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import sys
import warnings
import zipfile
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import ArtifactError, GraphoptError, GuardError

FORMAT_VERSION = 1
_MISSING = object()
META = "graphopt_meta.json"
REPORT = "graphopt_report.json"


def _flat_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm taking flat tensor inputs and returning a flat tuple of outputs."""
    graph = fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    result = out[0] if isinstance(out, tuple) else out
    leaves = pytree.tree_leaves(result)
    graph.output(tuple(leaves))
    # torch.export's input-guard call: graphopt's own guard replaces it (stored in the metadata);
    # kept, it would stop torch.jit.script and be baked into a trace as a constant
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
            graph.erase_node(n)
    flat = fx.GraphModule(gm, graph, class_name="GraphoptFlat")
    flat.recompile()
    return flat


def _specs(gm: fx.GraphModule) -> dict:
    cg = gm.graph._codegen
    out = {}
    info = getattr(cg, "pytree_info", None)
    for key in ("in_spec", "out_spec"):
        spec = getattr(info, key, None) if info is not None else None
        if spec is None:
            continue
        try:
            out[key] = pytree.treespec_dumps(spec)
        except Exception as e:  # types without a serialized name
            out[key + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def export(module, path: str | Path, *, format: str | None = None, example_inputs=None) -> Path:
    """Save an OptimizedModule as TorchScript (``format="torchscript"``, default for .pt) or a
    torch.export program (``"pt2"``, default for .pt2). Returns the path."""
    from .api import OptimizedModule
    from .capture import flat_tensors, split_inputs

    path = Path(path)
    if format is None:
        format = "pt2" if path.suffix == ".pt2" else "torchscript"
    if format not in ("torchscript", "pt2"):
        raise GraphoptError(f"unknown export format '{format}'; use torchscript or pt2")
    if not isinstance(module, OptimizedModule):
        raise GraphoptError("graphopt.export takes the module graphopt.optimize returned")
    gm = module.graph_module
    flat_gm = _flat_graph_module(gm)
    if example_inputs is None:
        example = getattr(module, "_example_flat", None)
    else:
        a, k = split_inputs(example_inputs)
        example = flat_tensors(a, k)
    if example is None:
        raise GraphoptError("pass example_inputs= to graphopt.export (needed to trace the artifact)")
    signature = getattr(module, "_signature", None) or []
    dyn = getattr(module, "_dynamic_dims", {}) or {}
    meta = {"format": "graphopt", "version": FORMAT_VERSION, "artifact": format, "torch": torch.__version__,
            "num_inputs": len(example), "inputs": _inputs_meta(signature, dyn), **_specs(gm),
            **_convention_meta(getattr(module, "_convention", None))}
    report = module.report.to_json()
    if path.is_dir():  # (checked before the trace, whose time it would waste)
        raise GraphoptError(f"cannot write {path}: it is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GraphoptError(f"cannot write {path}: {e.strerror or e}") from None
    with _quiet_jit():
        if format == "torchscript":
            # TorchScript takes tensors: the non-tensor inputs the graph holds as constants are not its inputs
            constants = {i for i, m in enumerate(meta["inputs"]) if m is not None and "type" in m}
            if constants and len(meta["inputs"]) == len(example):
                flat_gm = _without_inputs(flat_gm, constants)
                example = [x for i, x in enumerate(example) if i not in constants]
                meta["constant_inputs"] = sorted(constants)
            scripted, how = _to_torchscript(flat_gm, example, dyn)
            meta["torchscript"] = how
            save = lambda: torch.jit.save(scripted, str(path), _extra_files={META: json.dumps(meta), REPORT: report})  # noqa: E731
        else:
            dynamic_shapes = _dynamic_shapes(example, dyn)
            with torch.no_grad():
                ep = torch.export.export(flat_gm, tuple(example), strict=False, dynamic_shapes=dynamic_shapes)
            save = lambda: torch.export.save(ep, str(path), extra_files={META: json.dumps(meta), REPORT: report})  # noqa: E731
        try:
            save()
        except OSError as e:
            raise GraphoptError(f"cannot write {path}: {e.strerror or e}") from None
        except RuntimeError as e:  # torch wraps file errors ("File ... cannot be opened")
            if "cannot be opened" in str(e) or "open file" in str(e):
                raise GraphoptError(f"cannot write {path}: {str(e).splitlines()[0][:200]}") from None
            raise
    return path


def _convention_meta(convention) -> dict:
    """How the model was called when optimized (api._calling_convention): the forward's parameters
    that take a positional argument, and which were given by position and which by keyword; a
    loaded artifact re-spells a call as that one (keywords in any order, positionals by name)."""
    if convention is None:
        return {}
    sig, pos_names, kw_names = convention
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {"call": {"parameters": [p.name for p in sig.parameters.values() if p.kind in kinds],
                     "positional": list(pos_names), "keywords": list(kw_names)}}


def _inputs_meta(signature: list, dyn: dict) -> list:
    """The input signature the module was optimized for, as JSON (None for non-tensor inputs)."""
    out = []
    for i, sig in enumerate(signature):
        if not isinstance(sig, tuple):
            value = getattr(sig, "value", _MISSING)  # api.Specialized: a constant of the graph
            if value is _MISSING:
                out.append(None)
            elif value is None or type(value) in (bool, int, float, str):
                out.append({"value": value, "type": type(value).__name__})
            else:  # a dtype, device, memory format or layout
                out.append({"repr": repr(value), "type": type(value).__name__})
            continue
        shape, dtype, device = sig
        out.append({"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "device": torch.device(device).type,
                    "dynamic": sorted(dyn.get(i, ()))})
    return out


def _dynamic_shapes(example: list, dyn: dict):
    """dynamic_shapes for torch.export of the flat module: the dims optimized as dynamic stay so."""
    if not dyn:
        return None
    auto = getattr(torch.export.Dim, "AUTO", None) or torch.export.Dim.DYNAMIC
    return tuple({a: auto for a in sorted(dyn.get(i, ()))} or None if isinstance(x, torch.Tensor) else None
                 for i, x in enumerate(example))


@contextlib.contextmanager
def _quiet_jit():
    """TorchScript is this artifact's format on purpose: hide torch's deprecation and tracer chatter."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r".*TorchScript type system")
        yield


def _without_inputs(flat_gm: fx.GraphModule, drop: set) -> fx.GraphModule:
    """The flat graph without the placeholders at ``drop`` (inputs torch.export made constants of the
    graph: nothing reads them)."""
    places = [n for n in flat_gm.graph.nodes if n.op == "placeholder"]
    gm = fx.GraphModule(flat_gm, copy.deepcopy(flat_gm.graph), class_name="GraphoptFlat")
    for i, n in enumerate([n for n in gm.graph.nodes if n.op == "placeholder"]):
        if i in drop and i < len(places):
            if n.users:
                raise GraphoptError(f"input {i} of the graph is not a tensor and the graph reads it; TorchScript "
                                    "takes tensors only: export it as .pt2 (format='pt2')")
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


def _scriptable(flat_gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the flat graph torch.jit.script compiles: it resolves an aten op by its packet
    (``torch.ops.aten.view``), not by an overload (``.default``), and a dim's size as ``x.size(d)``.
    Scripted, the artifact computes sizes at run time, so dynamic dims stay dynamic (a trace
    records them as the example's)."""
    graph = fx.Graph()
    env: dict = {}
    for n in flat_gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int:
            env[n] = graph.call_method("size", fx.map_arg(n.args, env.__getitem__))
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                env[n].target = n.target.overloadpacket
    gm = fx.GraphModule(flat_gm, graph, class_name="GraphoptScript")
    gm.recompile()
    return gm


def _same_outputs(a, b, inputs: list) -> bool:
    """Whether modules a and b give the same outputs on ``inputs`` (the same graph run two ways:
    any difference beyond reassociation is a wrong artifact); False where b raises. Each run gets
    its own copy of the inputs (a graph may write one in place)."""
    fresh = lambda: [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]  # noqa: E731
    with torch.no_grad():
        want = pytree.tree_leaves(a(*fresh()))
        try:
            got = pytree.tree_leaves(b(*fresh()))
        except Exception:
            return False
    return len(got) == len(want) and all(
        not isinstance(w, torch.Tensor) or (isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype
                                            and torch.allclose(g, w, rtol=1e-3, atol=1e-3, equal_nan=True))
        for g, w in zip(got, want))


def _to_torchscript(flat_gm: fx.GraphModule, example: list, dyn: dict | None = None):
    """(the TorchScript module, "script" or "trace"). The runs that check it (and a trace's) leave the
    buffers the graph writes (the model's own: a step counter) as they were."""
    saved = [(b, b.detach().clone()) for b in flat_gm.buffers()]
    try:
        return _scripted_or_traced(flat_gm, example, dyn)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _scripted_or_traced(flat_gm: fx.GraphModule, example: list, dyn: dict | None):
    for make in (lambda: flat_gm, lambda: _scriptable(flat_gm)):
        try:
            scripted = torch.jit.script(make())
        except Exception:
            continue
        if _same_outputs(flat_gm, scripted, example):
            return scripted, "script"
    try:
        with torch.no_grad():
            traced = torch.jit.trace(flat_gm, tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in example),
                                     check_trace=False, strict=False)
    except Exception as e:
        raise GraphoptError(f"TorchScript can neither script nor trace this graph ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160] if str(e) else ''}); export it as .pt2 (format='pt2')",
                            detail=repr(e)) from None
    if dyn:
        _check_trace_dynamic(flat_gm, traced, example, dyn)
    return traced, "trace"


def _grown(example: list, dyn: dict) -> list:
    """The example with every dynamic dim one longer (its first slice repeated: index inputs keep
    values the model accepts, and dims that share a symbol stay equal)."""
    out = []
    for i, x in enumerate(example):
        for d in sorted(dyn.get(i, ())) if isinstance(x, torch.Tensor) else ():
            x = torch.cat([x, x.narrow(d, 0, 1)], d)
        out.append(x)
    return out


def _check_trace_dynamic(flat_gm: fx.GraphModule, traced, example: list, dyn: dict) -> None:
    """A trace records the example's sizes as constants wherever the graph computes with a size
    (a view to [batch, ...]): run it with the dynamic dims grown against the graph, and refuse an
    artifact that would fail or compute something else at other sizes."""
    grown = _grown(example, dyn)
    with torch.no_grad():
        try:
            flat_gm(*[x.clone() if isinstance(x, torch.Tensor) else x for x in grown])
        except Exception:  # the graph itself does not take this size: nothing to compare
            return
    if not _same_outputs(flat_gm, traced, grown):
        raise GraphoptError("TorchScript cannot keep this graph's dynamic dims (torch.jit.script refuses it and "
                            "a trace fixes the sizes it computes with); export it as .pt2 (format='pt2'), or "
                            "optimize without dynamic=")


class LoadedModule(nn.Module):
    """A loaded graphopt artifact: call it with the model's inputs."""

    def __init__(self, inner, meta: dict, report: dict, notes: list[str]):
        super().__init__()
        self.inner = inner
        self.meta = meta
        self.report = report
        self.notes = notes
        self._in_spec = self._load_spec("in_spec")
        self._out_spec = self._load_spec("out_spec")

    def _load_spec(self, key):
        text = self.meta.get(key)
        if text is None:
            self.notes.append(f"{key} not stored ({self.meta.get(key + '_error', 'flat artifact')}); "
                              f"{'outputs' if key == 'out_spec' else 'inputs'} stay flat")
            return None
        missing = _import_spec_types(text)
        try:
            return pytree.treespec_loads(text)
        except Exception as e:
            why = f"needs {', '.join(missing)}" if missing else type(e).__name__
            self.notes.append(f"{key} could not be restored ({why}); flat tuple returned")
            return None

    def _guard(self, flat: list) -> None:
        want = self.meta.get("num_inputs", len(flat))
        if len(flat) != want:
            raise GuardError(f"artifact takes {want} input tensors, got {len(flat)}")
        for i, (x, sig) in enumerate(zip(flat, self.meta.get("inputs") or [])):
            if sig is not None and "type" in sig:  # a non-tensor input the graph holds as a constant
                same = type(x).__name__ == sig["type"] and (
                    repr(x) == sig["repr"] if "repr" in sig
                    else x == sig["value"] or (isinstance(x, float) and x != x and sig["value"] != sig["value"]))
                if not same:
                    was = sig["repr"] if "repr" in sig else repr(sig["value"])
                    raise GuardError(f"input {i} was {was} when optimized, got {x!r}: the artifact holds it as a "
                                     "constant - optimize and export again for this value")
                continue
            if sig is None or not isinstance(x, torch.Tensor):
                continue
            dtype = str(x.dtype).replace("torch.", "")
            if dtype != sig["dtype"]:
                raise GuardError(f"input {i} is {dtype}; the artifact was optimized for {sig['dtype']}")
            dyn = set(sig.get("dynamic", ()))
            shape = sig["shape"]
            if x.dim() != len(shape) or any(a != b for d, (a, b) in enumerate(zip(x.shape, shape)) if d not in dyn):
                raise GuardError(f"input {i} has shape {tuple(x.shape)}; the artifact was optimized for "
                                 f"{tuple(shape)} (dynamic dims: {sorted(dyn) or 'none'})")

    def _keyword_order(self, kwargs: dict) -> dict:
        """The keyword inputs in the order the artifact's flat inputs take them (a call may name them
        in any order, as the model's does)."""
        spec = self._in_spec
        try:
            if spec.type is not tuple or spec.num_children != 2:
                return kwargs
            child = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
            keys = list(child.context) if child.type is dict else None
        except (AttributeError, TypeError, IndexError):
            keys = None
        if not keys or list(kwargs) == keys or set(kwargs) != set(keys):
            return kwargs
        return {k: kwargs[k] for k in keys}

    def _as_captured(self, args: tuple, kwargs: dict):
        """The call spelled as the one the artifact was optimized with: positional arguments by the
        forward's parameter names, keywords in the optimized call's order."""
        call = self.meta.get("call")
        if not call:
            return args, (self._keyword_order(kwargs) if kwargs and self._in_spec is not None else kwargs)
        pos, kws = call["positional"], call["keywords"]
        if len(args) == len(pos) and list(kwargs) == kws:
            return args, kwargs
        params = call["parameters"]
        if len(args) > len(params):
            raise GuardError(f"the artifact takes at most {len(params)} positional arguments, got {len(args)}")
        named = dict(zip(params, args))
        twice = [k for k in kwargs if k in named]
        if twice:
            raise GuardError(f"argument(s) {', '.join(twice)} given by position and by keyword")
        named.update(kwargs)
        want = list(pos) + list(kws)
        if set(named) != set(want):
            raise GuardError(f"the artifact was optimized with arguments {', '.join(want)}; got "
                             f"{', '.join(named) or 'none'} - optimize and export again for this call")
        return tuple(named[k] for k in pos), {k: named[k] for k in kws}

    def forward(self, *args, **kwargs):
        args, kwargs = self._as_captured(args, kwargs)
        flat = pytree.tree_leaves((args, kwargs))
        self._guard(flat)
        constants = set(self.meta.get("constant_inputs", ()))
        out = self.inner(*[x for i, x in enumerate(flat) if i not in constants])
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        if self._out_spec is not None:
            return pytree.tree_unflatten(out, self._out_spec)
        return tuple(out)


def _import_spec_types(text: str) -> list[str]:
    """Import the transformers modules whose types a serialized tree spec names (their
    ModelOutput classes register themselves with pytree on import; graphopt registers
    DynamicCache). Returns the type names still unknown afterwards."""
    try:
        names: set = set()
        stack = [json.loads(text)]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, dict):
                if isinstance(node.get("type"), str):
                    names.add(node["type"])
                stack.extend(node.get("children_spec") or [])
    except (ValueError, TypeError):
        return []
    known = getattr(pytree, "SERIALIZED_TYPE_TO_PYTHON_TYPE", {})
    unknown = sorted(n for n in names if n not in known and "." in n)
    if not unknown:
        return []
    for name in unknown:
        if name.split(".")[0] == "transformers":
            try:
                importlib.import_module(name.rpartition(".")[0])
            except Exception:  # not installed, or a different version
                pass
    if "transformers" in sys.modules:
        from .capture import _register_hf_pytrees

        _register_hf_pytrees()
    return [n for n in unknown if n not in known]


def load(path: str | Path) -> LoadedModule:
    """Load a graphopt artifact (TorchScript or .pt2). Foreign or corrupt files raise ArtifactError."""
    from . import cuda_ext  # noqa: F401  (registers torch.ops.graphopt.* before deserializing)

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} does not exist")
    if path.is_dir():
        raise ArtifactError(f"{path} is a directory, not a graphopt artifact")
    if not zipfile.is_zipfile(path):
        raise ArtifactError(f"{path} is not a graphopt artifact (not a zip archive, or truncated)")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"{path} is corrupt ({e})") from None
    if bad is not None:
        raise ArtifactError(f"{path} is corrupt (bad CRC in {bad})")
    if not any(n.endswith(META) for n in names):
        raise ArtifactError(f"{path} is not a graphopt artifact (no {META}); was it saved by graphopt.export?")
    is_pt2 = any(n.endswith("archive_format") for n in names) or not any(n.endswith("constants.pkl") for n in names)
    try:
        if is_pt2:
            extra = {META: "", REPORT: ""}
            ep = torch.export.load(str(path), extra_files=extra)
            inner = ep.module()
        else:
            extra = {META: "", REPORT: ""}
            with _quiet_jit():
                inner = torch.jit.load(str(path), _extra_files=extra)
    except Exception as e:
        raise ArtifactError(f"{path} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    try:
        meta = json.loads(extra[META])
        report = json.loads(extra[REPORT]) if extra[REPORT] else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ArtifactError(f"{path} has a damaged graphopt metadata record") from None
    if not isinstance(meta, dict) or meta.get("format") != "graphopt":
        raise ArtifactError(f"{path} is not a graphopt artifact")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise ArtifactError(f"{path} was written by a newer graphopt (format {meta['version']})")
    return LoadedModule(inner, meta, report, [])
