"""The graphopt ops, declared one per module in ``ops/`` and registered with torch here.

An op module calls :func:`define_op` once with its schema, reference, fake, wrapper, cost
function and kernel; :func:`all_ops` imports every module in ``ops/`` and returns what they
declared, so the op list (``graphopt.cuda_ext.__all__``, :func:`schemas`) is never written by
hand. :func:`define_schemas` defines the ops from Python (``torch.library``); the compiled CUDA
library, loaded after that, adds the CUDA kernels of the ops whose kernel is in ``csrc/`` (each
``.cu``/``.cpp`` has its own ``TORCH_LIBRARY_IMPL(graphopt, CUDA, m)``); :func:`register_impls`
adds the rest: the reference on the CPU (and on CUDA where no kernel serves), the Python CUDA
dispatch of the Triton ops, every fake, and the autograd formulas of the ops that declare one.
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from graphopt.cost.ops import register_op_class, register_op_cost

NAMESPACE = "graphopt"
ROOT = Path(__file__).resolve().parent

_OPS: dict[str, "OpDef"] = {}
_lock = threading.RLock()
_state = {"loaded": False, "defined": False, "impls": False}
_libs: list[torch.library.Library] = []  # keep the registrations alive


@dataclass(frozen=True)
class OpDef:
    """One op, as its module declares it."""

    name: str
    schema: str  # the torch schema, without the namespace
    reference: Callable  # plain torch, fp64-capable: the CPU implementation, and CUDA's where no kernel serves
    fake: Callable  # output shapes, dtypes and strides (FakeTensor, Meta, torch.export)
    wrapper: Callable  # graphopt.cuda_ext.<name>: argument checks, then torch.ops.graphopt.<name>
    cost: Callable  # (graphopt.cost.ops.OpCall, DeviceProfile) -> OpCost, registered with the cost model
    kernel: str  # the CUDA kernel's source, relative to cuda_ext/ (csrc/<file> or <file>.py)
    cuda: Callable | None  # the CUDA implementation in Python (a Triton kernel's dispatch); None: csrc/ registers it
    module: str
    # (graphopt.cost.ops.OpCall) -> the op class of the ATen op it replaces (graphopt.cost.opclass), or None
    op_class: Callable | None = None
    # (backward, setup_context) for torch.library.register_autograd, or None: not differentiable
    autograd: tuple[Callable, Callable] | None = None
    # () -> the arguments of a small fp32 call on the CPU: the cost tests call every op with its own
    example: Callable | None = None

    @property
    def compiled(self) -> bool:
        """Its CUDA kernel is compiled from csrc/ (registered by the library, not from Python)."""
        return self.cuda is None


def define_op(schema: str, *, reference: Callable, fake: Callable, wrapper: Callable, cost: Callable, kernel: str,
              example: Callable, cuda: Callable | None = None, op_class: Callable | None = None,
              autograd: tuple[Callable, Callable] | None = None) -> OpDef:
    """Declare the op ``schema`` names (called once, at the end of its module in ``ops/``, which
    is named after the op). ``kernel``: where its CUDA kernel is, relative to cuda_ext/; a
    ``csrc/`` source registers the CUDA implementation itself (``TORCH_LIBRARY_IMPL``), else
    ``cuda`` is the Python function that dispatches to it (calling ``reference`` where the kernel
    does not take the arguments). ``op_class``: for an op that replaces a convolution, GEMM or
    attention, the class of that ATen op for a call (graphopt.cost.ops.register_op_class), so
    the cost model's per-class corrections keep, say, grouped convolutions apart from dense ones.
    ``autograd``: ``(backward, setup_context)``, registered with ``torch.library.register_autograd``
    (eager autograd and AOTAutograd's joint graphs then differentiate through the op). ``example``: a
    function returning the arguments of a small fp32 call on the CPU (the cost tests call every op
    with its own, so adding an op touches only its module, its kernel and its test)."""
    name = schema.split("(", 1)[0].strip()
    module = wrapper.__module__
    if module.rsplit(".", 1)[-1] != name:
        raise RuntimeError(f"graphopt::{name} is declared in {module}: each op's module is named after it")
    if (cuda is None) != kernel.startswith("csrc/"):
        raise RuntimeError(f"graphopt::{name}: a csrc/ kernel registers its own CUDA implementation; any other "
                           f"kernel needs a Python cuda= dispatch (kernel={kernel!r})")
    if not (ROOT / kernel).is_file():
        raise RuntimeError(f"graphopt::{name}: kernel source {kernel} does not exist")
    op = OpDef(name, schema, reference, fake, wrapper, cost, kernel, cuda, module, op_class, autograd, example)
    _OPS[name] = op
    register_op_cost(name, cost)
    if op_class is not None:
        register_op_class(name, op_class)
    return op


def all_ops() -> dict[str, OpDef]:
    """Every op, by name (sorted), importing the modules in ``ops/`` on the first call."""
    with _lock:
        if not _state["loaded"]:
            from . import ops

            for m in sorted(pkgutil.iter_modules(ops.__path__), key=lambda m: m.name):
                if not m.name.startswith("_"):
                    importlib.import_module(f"{ops.__name__}.{m.name}")
            _state["loaded"] = True
    return dict(sorted(_OPS.items()))


def schemas() -> dict[str, str]:
    """{op name: schema string}."""
    return {name: op.schema for name, op in all_ops().items()}


def op_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", "")
        return True
    except RuntimeError:
        return False


def has_cuda_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CUDA")


def csrc_registrations() -> dict[str, str]:
    """{op name: csrc file} for every ``m.impl("<op>", ...)`` in the C++ sources (what the
    compiled library registers for CUDA)."""
    out = {}
    for p in sorted((ROOT / "csrc").iterdir()):
        if p.suffix in (".cu", ".cpp"):
            for name in re.findall(r'm\.impl\(\s*"(\w+)"', p.read_text()):
                out[name] = f"csrc/{p.name}"
    return out


def define_schemas() -> bool:
    """Define every op from its module's schema (pt2-compliant). False when the ops were
    already defined in this process."""
    with _lock:
        if _state["defined"]:
            return False
        ops = all_ops()
        _state["defined"] = True
        if any(op_exists(n) for n in ops):
            return False
        lib = torch.library.Library(NAMESPACE, "DEF")
        for op in ops.values():
            lib.define(op.schema, tags=(torch.Tag.pt2_compliant_tag,))
        _libs.append(lib)
        return True


def register_impls(cuda_kernels: bool, triton: bool) -> None:
    """CPU: the reference of every op. CUDA: the compiled kernel where the library is loaded
    (``cuda_kernels``), the Python dispatch of the others where Triton runs (``triton``), the
    reference elsewhere. The fake of every op."""
    with _lock:
        if _state["impls"]:
            return
        lib = torch.library.Library(NAMESPACE, "IMPL")
        for op in all_ops().values():
            lib.impl(op.name, op.reference, "CPU")
            if op.cuda is not None:
                lib.impl(op.name, op.cuda if triton else op.reference, "CUDA")
            elif not cuda_kernels:
                lib.impl(op.name, op.reference, "CUDA")
            torch.library.register_fake(f"{NAMESPACE}::{op.name}", op.fake, lib=lib)
            if op.autograd is not None:
                backward, setup_context = op.autograd
                torch.library.register_autograd(f"{NAMESPACE}::{op.name}", backward, setup_context=setup_context,
                                                lib=lib)
        _libs.append(lib)
        _state["impls"] = True
