"""The package's layering (DESIGN.md), read from the source with ast, function-level imports
included:

    base (errors, timing, ir) < cost/ < ops (cuda_ext/) < core < passes/ < runtime/ < api (api, export, generation) < tools/

A module imports only modules of its own layer or below; the layers' import graph has no cycle;
no pass imports a private name of cost/ or reads a device profile (passes price candidates through
the cost model and ask it for device facts); the cost model has no branch on the name of one of
graphopt's own ops (their costs live with the ops).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# package name -> source directory (pyproject's package-dir)
SOURCES = {"graphopt": ROOT / "graphopt", "graphopt.passes": ROOT / "passes",
           "graphopt.cuda_ext": ROOT / "cuda_ext", "graphopt.examples": ROOT / "examples"}
LAYERS = ("base", "cost", "ops", "core", "passes", "runtime", "api", "tools")
BASE = {"graphopt.errors", "graphopt.timing", "graphopt.ir"}
API = {"graphopt", "graphopt.api", "graphopt.export", "graphopt.generation"}


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    for prefix, name in (("graphopt.cost", "cost"), ("graphopt.cuda_ext", "ops"), ("graphopt.passes", "passes"),
                         ("graphopt.runtime", "runtime"), ("graphopt.tools", "tools"), ("graphopt.examples", "tools")):
        if module == prefix or module.startswith(prefix + "."):
            return name
    if module in API:
        return "api"
    if module == "graphopt.__main__":
        return "tools"
    return "core"


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if package == "graphopt" and parts[0] in ("passes", "cuda_ext", "examples"):
                continue  # (a checkout's package-dir mapping; not graphopt/ itself)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package] + parts)] = path
    return out


MODULES = _modules()


class _Trees(dict):
    """Each module's syntax tree, parsed at its first use (parsing them all when the file was
    imported cost every pytest-xdist worker 2 s of its collection)."""

    def __missing__(self, module):
        tree = self[module] = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
        return tree


TREES = _Trees()


def _resolve(name: str) -> str | None:
    """The graphopt module an imported dotted name lives in (``graphopt.ir.info`` -> graphopt.ir)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str):
    """(imported graphopt module, imported name or None, line) for every import in ``module``,
    wherever it is (module level or inside a function)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _resolve(a.name)
                if target:
                    yield target, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == "graphopt" or source.startswith("graphopt.")):
                continue
            for a in node.names:
                sub = _resolve(f"{source}.{a.name}")
                if sub is not None and sub != _resolve(source):  # `from graphopt import ir`: the module ir
                    yield sub, None, node.lineno
                else:
                    yield _resolve(source), a.name, node.lineno


def test_every_module_is_seen():
    assert {"graphopt.ir", "graphopt.cost.model", "graphopt.pipeline", "graphopt.passes.fuse_bias_act",
            "graphopt.cuda_ext.ops", "graphopt.runtime.cuda_graphs", "graphopt.api", "graphopt.tools.cli"} <= set(MODULES)
    assert {layer(m) for m in MODULES} == set(LAYERS)


def _violations(of_layer: str) -> list[str]:
    out = []
    for m in MODULES:
        if layer(m) != of_layer:
            continue
        for target, _, line in imports(m):
            if LAYERS.index(layer(target)) > LAYERS.index(of_layer):
                out.append(f"{MODULES[m].relative_to(ROOT)}:{line} ({of_layer}) imports {target} ({layer(target)})")
    return out


@pytest.mark.parametrize("of_layer", LAYERS)
def test_a_layer_imports_nothing_above_it(of_layer):
    assert _violations(of_layer) == []


def test_the_layers_import_graph_has_no_cycle():
    edges: dict[str, set] = {name: set() for name in LAYERS}
    for m in MODULES:
        for target, _, _ in imports(m):
            if layer(target) != layer(m):
                edges[layer(m)].add(layer(target))
    # Kahn: every layer can be ordered so that it comes after everything it imports
    remaining = {k: set(v) for k, v in edges.items()}
    while remaining:
        free = [k for k, v in remaining.items() if not v]
        assert free, f"the layers import each other in a cycle: {remaining}"
        for k in free:
            del remaining[k]
        for v in remaining.values():
            v.difference_update(free)


PASS_MODULES = [m for m in MODULES if layer(m) == "passes"]


@pytest.mark.parametrize("module", PASS_MODULES)
def test_a_pass_uses_only_the_public_cost_model(module):
    """No private name of graphopt.cost imported or read, no device profile read: passes price
    candidates through the cost model (time_of, replacement, price) and ask it for device facts."""
    tree = TREES[module]
    bad = [f"line {line}: imports {name} from {target}" for target, name, line in imports(module)
           if layer(target) == "cost" and name is not None and name.startswith("_")]
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for a in node.names
               if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphopt.cost"))
               or a.name.startswith("graphopt.cost")}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr == "profile":
            bad.append(f"line {node.lineno}: reads .profile")
        elif isinstance(node.value, ast.Name) and node.value.id == "profile":
            bad.append(f"line {node.lineno}: reads profile.{node.attr}")
        elif isinstance(node.value, ast.Name) and node.value.id in aliases and node.attr.startswith("_"):
            bad.append(f"line {node.lineno}: reads {node.value.id}.{node.attr}")
    assert bad == [], f"{MODULES[module].relative_to(ROOT)}: " + "; ".join(bad)


def _schemas() -> dict:
    """graphopt's op schemas, read from the op modules' ``SCHEMA`` strings (cuda_ext/ops/<op>.py;
    importing graphopt is not needed): {op name: schema}."""
    out = {}
    for path in sorted((SOURCES["graphopt.cuda_ext"] / "ops").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SCHEMA" for t in node.targets)
                    and isinstance(node.value, ast.Constant)):
                out[node.value.value.split("(", 1)[0].strip()] = node.value.value
    return out


def _docstrings(tree) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def graphopt_op_names_in(module: str) -> list[str]:
    """String literals (docstrings aside) naming one of graphopt's own ops: ``short_attention``,
    ``graphopt::short_attention``, ``graphopt.short_attention``. Names aten has too (layer_norm)
    name aten's op as well and do not count."""
    ours = {n for n in _schemas() if not hasattr(torch.ops.aten, n)}
    tree = TREES[module]
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            s = node.value
            for prefix in ("graphopt::", "graphopt."):
                if s.startswith(prefix):
                    s = s[len(prefix):].split(".")[0]
            if s in ours:
                found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_op_name_scan_finds_our_ops_and_not_atens():
    tree = ast.parse('"""short_attention in a docstring"""\nA = {"layer_norm", "graphopt::add_rms_norm"}\n'
                     'if name == "gemm_swiglu": pass\n')
    TREES["<probe>"] = tree
    try:
        assert graphopt_op_names_in("<probe>") == ["line 2: 'graphopt::add_rms_norm'", "line 3: 'gemm_swiglu'"]
    finally:
        del TREES["<probe>"]


def test_the_cost_model_has_no_branch_on_a_graphopt_op():
    found = {m: graphopt_op_names_in(m) for m in MODULES if layer(m) == "cost"}
    assert {m: f for m, f in found.items() if f} == {}
