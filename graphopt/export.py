"""Export an optimized module as TorchScript (report embedded) or a torch.export ``.pt2``, and
load either back.

Artifacts take and return flat tensors (the model's inputs and outputs flattened with
torch.utils._pytree); ``graphopt.load`` restores the nesting from the stored tree specs when
they can be deserialized (Hugging Face ``ModelOutput``/``DynamicCache`` need ``import
transformers`` first), else returns the flat tuple and says so in ``.notes``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import ArtifactError, GraphoptError

FORMAT_VERSION = 1
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
    meta = {"format": "graphopt", "version": FORMAT_VERSION, "artifact": format, "torch": torch.__version__,
            "num_inputs": len(example), **_specs(gm)}
    report = module.report.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    if format == "torchscript":
        scripted, how = _to_torchscript(flat_gm, example)
        meta["torchscript"] = how
        torch.jit.save(scripted, str(path), _extra_files={META: json.dumps(meta), REPORT: report})
    else:
        with torch.no_grad():
            ep = torch.export.export(flat_gm, tuple(example), strict=False)
        torch.export.save(ep, str(path), extra_files={META: json.dumps(meta), REPORT: report})
    return path


def _to_torchscript(flat_gm: fx.GraphModule, example: list):
    try:
        return torch.jit.script(flat_gm), "script"
    except Exception:
        pass
    with torch.no_grad():
        traced = torch.jit.trace(flat_gm, tuple(example), check_trace=False, strict=False)
    return traced, "trace"


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
        try:
            return pytree.treespec_loads(text)
        except Exception as e:
            self.notes.append(f"{key} could not be restored ({type(e).__name__}); flat tuple returned")
            return None

    def forward(self, *args, **kwargs):
        flat = pytree.tree_leaves((args, kwargs))
        if len(flat) != self.meta.get("num_inputs", len(flat)):
            raise GraphoptError(f"artifact takes {self.meta['num_inputs']} input tensors, got {len(flat)}")
        out = self.inner(*flat)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        if self._out_spec is not None:
            return pytree.tree_unflatten(out, self._out_spec)
        return tuple(out)


def load(path: str | Path) -> LoadedModule:
    """Load a graphopt artifact (TorchScript or .pt2). Foreign or corrupt files raise ArtifactError."""
    from . import cuda_ext  # noqa: F401  (registers torch.ops.graphopt.* before deserializing)

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} does not exist")
    if not zipfile.is_zipfile(path):
        raise ArtifactError(f"{path} is not a graphopt artifact (not a zip archive)")
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
            inner = torch.jit.load(str(path), _extra_files=extra)
    except Exception as e:
        raise ArtifactError(f"{path} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    try:
        meta = json.loads(extra[META])
        report = json.loads(extra[REPORT]) if extra[REPORT] else {}
    except json.JSONDecodeError:
        raise ArtifactError(f"{path} has a damaged graphopt metadata record") from None
    if meta.get("format") != "graphopt":
        raise ArtifactError(f"{path} is not a graphopt artifact")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise ArtifactError(f"{path} was written by a newer graphopt (format {meta['version']})")
    return LoadedModule(inner, meta, report, [])
