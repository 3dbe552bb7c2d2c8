"""Compile the Triton kernels a graph's first call would compile, on a pool of threads, before that call.

A graph's first call compiles every Triton kernel it launches for the first time, one after the
other on the calling thread: generated pointwise kernels, norms, attention, GEMVs, each once per
specialization (dtypes, 16-byte alignment, integer arguments equal to 1 or divisible by 16).
:func:`precompile` does that work first, in parallel: each node that calls a graphopt op whose CUDA
implementation is Python (a Triton dispatch, ``OpDef.cuda``) runs that implementation on fake
tensors with the node's shapes, strides, storage offsets, dtypes and device, with every Triton
launch made a warm-up instead (``JITFunction.run(warmup=True)``: specialize and compile, launch
nothing) under Triton's ``AsyncCompileMode``, so the compiles run on a thread pool, overlapping
where Triton leaves the GIL (its native passes, ptxas); then each kernel's launcher (a C stub Triton builds
with the host's compiler, once per argument signature) is built on the pool and the kernel loaded, work
its first launch would do on the calling thread. The call after it finds each kernel in Triton's cache,
ready. Nothing is computed and no tensor is written.

Best effort: a node whose implementation cannot run on fake tensors (it reads a pointer or a value)
or whose shapes are symbolic is left to compile at its first call, and :class:`Precompiled` names
it with the reason. A node signature (op, tensor metadata, other arguments) handled once in this
process is not run again, so a graph lowered again (the measured guard lowers one per pass) costs
a signature per node. ``GRAPHOPT_COMPILE_THREADS`` sets the pool's size (0: no precompilation).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import ir, timing

THREADS_ENV = "GRAPHOPT_COMPILE_THREADS"
MAX_THREADS = 16

_WARMING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphopt_precompile_warming", default=False)
_done: set = set()  # node signatures whose kernels this process compiled or tried to
_done_lock = threading.Lock()
_patch_lock = threading.Lock()
_patch: dict = {"users": 0}  # the threads inside warm_launches, and JITFunction.run as it was before them


@dataclass
class Precompiled:
    """What :func:`precompile` did: ``nodes`` run as warm-ups (their kernels compiled, or already in
    the cache), ``kernels`` compiled by the pool, ``left`` {node: why it compiles at its first call},
    ``seconds`` of wall time, ``note`` why nothing ran (no CUDA, no Triton, the pool set to 0)."""

    nodes: int = 0
    kernels: int = 0
    left: dict = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""


def threads() -> int:
    """The pool's size: ``GRAPHOPT_COMPILE_THREADS`` where set, else the cores this process may run
    on, at most MAX_THREADS."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            return 0
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


def triton_ops() -> dict:
    """{op name: its Python CUDA implementation} for the graphopt ops whose CUDA kernel is a Triton
    dispatch (graphopt.cuda_ext.registry: ``OpDef.cuda``)."""
    from graphopt.cuda_ext.registry import all_ops

    return {name: op.cuda for name, op in all_ops().items() if op.cuda is not None}


def _concrete(v) -> bool:
    return all(isinstance(x, int) for x in (*v.shape, *v.stride(), v.storage_offset()))


def _arg_vals(node: fx.Node):
    """The node's arguments with each fx.Node replaced by its ``meta["val"]`` (None where one has none)."""
    missing = []

    def val(a):
        v = a.meta.get("val")
        if v is None:
            missing.append(a.name)
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), val)
    return args, kwargs, missing


def _misalignment(t: torch.Tensor) -> int:
    """Bytes past a 16-byte boundary where ``t`` starts in its storage (its base taken as aligned, as the
    allocator makes it): the pointer alignment Triton specializes a kernel on."""
    return t.storage_offset() * t.element_size() % 16


def _signature(name: str, args, kwargs):
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), tuple(v.stride()), _misalignment(v), v.dtype, str(v.device))
        return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)

    return (name, tuple(key(v) for v in pytree.tree_leaves((args, kwargs))))


def _fake_like(v: torch.Tensor, mode) -> torch.Tensor:
    """A tensor of ``mode`` with ``v``'s shape, strides, storage offset, dtype and device."""
    extent = v.storage_offset() + sum((s - 1) * st for s, st in zip(v.shape, v.stride())) + 1 if v.numel() else 1
    with mode:
        base = torch.empty(max(extent, 1), dtype=v.dtype, device=v.device)
        return base.as_strided(tuple(v.shape), tuple(v.stride()), v.storage_offset())


def _pointer(t: torch.Tensor):
    """A launch argument standing in for a tensor at a Triton warm-up (Triton's MockTensor): its
    dtype, and a ``data_ptr`` with the tensor's alignment to 16 bytes (the specialization Triton keys
    a kernel on)."""
    from triton.runtime.jit import MockTensor

    m = MockTensor(t.dtype, list(t.shape))
    off = _misalignment(t)
    if off:
        m.data_ptr = lambda: off
    return m


@contextlib.contextmanager
def warm_launches():
    """While active on this thread, a Triton kernel launch (``kernel[grid](...)``) specializes and
    compiles the kernel (under an active ``AsyncCompileMode``: submits its compile) and launches
    nothing; its tensor arguments are read for their dtype and alignment only. Other threads'
    launches go through unchanged; ``JITFunction.run`` is wrapped while any thread is inside."""
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        if not _patch["users"]:
            real = _patch["real"] = JITFunction.run

            def run(self, *args, grid, warmup, **kwargs):
                if not _WARMING.get():
                    return real(self, *args, grid=grid, warmup=warmup, **kwargs)
                wrap = lambda a: _pointer(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
                return real(self, *[wrap(a) for a in args], grid=grid, warmup=True,
                            **{k: wrap(v) for k, v in kwargs.items()})

            JITFunction.run = run
        _patch["users"] += 1
    token = _WARMING.set(True)
    try:
        yield
    finally:
        _WARMING.reset(token)
        with _patch_lock:
            _patch["users"] -= 1
            if not _patch["users"]:
                JITFunction.run = _patch.pop("real")


def _graphs(gm: fx.GraphModule):
    seen = set()
    for m in gm.modules():
        if isinstance(m, fx.GraphModule) and id(m.graph) not in seen:
            seen.add(id(m.graph))
            yield m.graph


def plan(gm: fx.GraphModule, impls: dict, device_type: str = "cuda") -> tuple[list, dict]:
    """(the nodes to warm up: (name, implementation, args, kwargs) with each fx.Node argument as
    its ``meta["val"]``, {node: why it is left to its first call}): the nodes of ``gm`` and of its
    submodules' graphs that call an op of ``impls`` on ``device_type`` tensors, each signature once
    per process."""
    todo, left = [], {}
    for graph in _graphs(gm):
        for node in graph.nodes:
            name = ir.op_name(node) if ir.op_namespace(node) == "graphopt" else None
            if name not in impls:
                continue
            args, kwargs, missing = _arg_vals(node)
            if missing:
                left[node.name] = f"no shapes recorded for {', '.join(missing[:3])}"
                continue
            tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
            if not any(v.device.type == device_type for v in tensors):
                continue
            if not all(_concrete(v) for v in tensors):
                left[node.name] = "symbolic shapes"
                continue
            sig = _signature(name, args, kwargs)
            with _done_lock:
                if sig in _done:
                    continue
                _done.add(sig)
            todo.append((node.name, impls[name], args, kwargs))
    return todo, left


def run_on_fakes(todo: list, out: Precompiled) -> None:
    """Run each entry's implementation on fresh fake tensors like its values (a node that raises is
    named in ``out.left``; the others counted in ``out.nodes``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    for name, impl, args, kwargs in todo:
        fargs, fkwargs = pytree.tree_map_only(torch.Tensor, lambda v: _fake_like(v, mode), (args, kwargs))
        try:
            with mode:
                impl(*fargs, **fkwargs)
            out.nodes += 1
        except Exception as e:  # noqa: BLE001 (left to its first call, which raises its own error)
            first = str(e).splitlines()[0][:120] if str(e) else ""
            out.left[name] = f"{type(e).__name__}: {first}"


def precompile(gm: fx.GraphModule, *, pool: int | None = None) -> Precompiled:
    """Compile, on ``pool`` threads (default :func:`threads`), the Triton kernels ``gm``'s graphopt
    ops would compile at its first call on a CUDA device (see the module docstring)."""
    out = Precompiled()
    t0 = time.perf_counter()
    n = threads() if pool is None else pool
    if n <= 0:
        out.note = f"{THREADS_ENV}=0"
        return out
    if not torch.cuda.is_available():
        out.note = "no CUDA device"
        return out
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        out.note = "this Triton has no AsyncCompileMode"
        return out
    todo, out.left = plan(gm, triton_ops())
    if todo:
        from concurrent.futures import ThreadPoolExecutor

        try:
            with timing.phase("kernel compilation"), \
                    ThreadPoolExecutor(max_workers=n, thread_name_prefix="graphopt-compile") as ex:
                compiles = AsyncCompileMode(ex, ignore_errors=True)
                with compiles, warm_launches():
                    run_on_fakes(todo, out)
                kernels = [k for k in (f.result(ignore_errors=True) for f in compiles.future_kernels.values())
                           if k is not None]
                out.kernels = len(kernels)
                load(kernels, ex)
        except Exception as e:  # noqa: BLE001 (an AsyncCompileMode the caller holds open, a Triton it does not
            # know): the kernels compile at their first launches, as without it
            out.note = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    out.seconds = time.perf_counter() - t0
    return out


def load(kernels: list, pool) -> None:
    """Make compiled kernels ready to launch: each one's launcher (a C stub Triton builds with the host's
    compiler at a kernel's first launch, one per argument signature, cached on disk) built on ``pool``,
    then each kernel loaded onto the current device on this thread (what its first launch would do; a
    kernel that cannot load, out of shared memory say, raises at its launch as it would have)."""
    from triton.runtime.driver import driver

    stubs = {}
    for k in kernels:
        src = getattr(k, "src", None)
        if src is None or not hasattr(k, "_init_handles"):
            continue
        key = (repr(sorted(getattr(src, "signature", {}).items(), key=repr)),
               repr(sorted(getattr(src, "constants", {}).items(), key=repr)), repr(getattr(k.metadata, "tensordesc_meta", None)))
        stubs.setdefault(key, k)
    for f in [pool.submit(driver.active.launcher_cls, k.src, k.metadata) for k in stubs.values()]:
        try:
            f.result()
        except Exception:  # noqa: BLE001 (the kernel's first launch builds it, or raises, as before)
            pass
    for k in kernels:
        try:
            k._init_handles()
        except Exception:  # noqa: BLE001
            pass
