"""Which backend the graphopt ops run on, and loading it (see README.md, "Build and fallback")."""
from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from graphopt.errors import KernelBuildError

from . import registry

_lock = threading.RLock()
_state: dict = {"backend": None, "reason": "", "library": None, "pointwise": None, "error": None}


def _progress(done: int, total: int, msg: str) -> None:
    if done == 1:
        print(f"graphopt: building the CUDA kernels once (cached; `graphopt build-kernels` does this "
              f"ahead of time) ...", file=sys.stderr, flush=True)


def _load_library() -> str:
    """Build (or take from the cache) and load the compiled CUDA kernels; every op whose kernel is
    in csrc/ must then have one. Returns the library's path."""
    from . import build

    so = build.cached_library() or build.build_kernels(_progress)
    torch.ops.load_library(str(so))
    missing = [n for n, op in registry.all_ops().items() if op.compiled and not registry.has_cuda_kernel(n)]
    if missing:
        raise KernelBuildError(f"{so} registers no CUDA kernel for {', '.join(missing)} (a csrc/ source without "
                               f"its TORCH_LIBRARY_IMPL(graphopt, CUDA, m) m.impl)")
    return str(so)


def ensure_loaded() -> str:
    """Make ``torch.ops.graphopt.*`` exist; return the backend name. Idempotent and cheap:
    the ops are defined from their modules' schemas (``registry``); without a GPU (or with
    ``GRAPHOPT_KERNELS=reference``) nothing is compiled and the reference implementations serve.
    With a GPU it loads the cached CUDA library, building it first if this (torch, CUDA, arch,
    sources) has none yet; the library registers the CUDA kernels of the csrc/ ops.

    ``GRAPHOPT_KERNELS``: ``auto`` (default: CUDA kernels when a GPU and toolkit are there,
    else the reference, with a warning if a build failed), ``cuda`` (a failed build raises
    KernelBuildError), ``reference`` (never build)."""
    if _state["backend"] is not None:
        return _state["backend"]
    with _lock:
        if _state["backend"] is not None:
            return _state["backend"]
        mode = os.environ.get("GRAPHOPT_KERNELS", "auto").strip().lower() or "auto"
        if mode not in ("auto", "cuda", "reference"):
            raise KernelBuildError(f"GRAPHOPT_KERNELS={mode!r}: use auto, cuda or reference")
        ops = registry.all_ops()
        registry.define_schemas()  # before the library: its kernels are checked against the schemas
        loaded = False
        reason = ""
        compiled = [n for n, op in ops.items() if op.compiled]
        if any(registry.has_cuda_kernel(n) for n in compiled):
            # registered by an earlier load in this process (e.g. the library loaded by hand)
            loaded = True
            reason = "CUDA kernels already registered in this process"
        elif mode == "reference":
            reason = "GRAPHOPT_KERNELS=reference"
        elif not torch.cuda.is_available():
            reason = "no CUDA GPU visible"
            if mode == "cuda":
                raise KernelBuildError("GRAPHOPT_KERNELS=cuda but no CUDA GPU is visible")
        else:
            try:
                so = _load_library()
                _state["library"] = so
                loaded = True
                reason = f"CUDA kernels from {so}"
            except (KernelBuildError, OSError, RuntimeError) as e:
                err = e if isinstance(e, KernelBuildError) else KernelBuildError(f"loading the CUDA kernels failed: {e}")
                if mode == "cuda":
                    raise err from e
                _state["error"] = err
                reason = f"CUDA kernels unavailable: {err}"
                warnings.warn(f"graphopt: {reason}; running the torch reference implementations", stacklevel=2)
        from . import pointwise_triton

        pw = torch.cuda.is_available() and pointwise_triton.available()
        registry.register_impls(cuda_kernels=loaded, triton=pw)
        _state.update(backend="cuda" if loaded else "reference", reason=reason,
                      pointwise="triton" if pw else "reference")
        return _state["backend"]


def backend() -> str:
    """``"cuda"`` (the compiled kernels serve CUDA tensors) or ``"reference"`` (every op runs
    the plain-torch reference, on whatever device its inputs are; CPU tensors always do)."""
    return ensure_loaded()


def backend_info() -> dict:
    """backend, the reason it was chosen, the library path, fused_pointwise's CUDA path
    (``"triton"`` or ``"reference"``) and the build error if one happened (for explain)."""
    ensure_loaded()
    info = dict(_state)
    info["error"] = str(info["error"]) if info["error"] else None
    return info
