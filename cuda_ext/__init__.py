"""graphopt.cuda_ext: fused kernels registered as PyTorch custom ops (``torch.ops.graphopt.*``).

Each op is one module in ``ops/`` (schema, reference, fake, CUDA dispatch, wrapper, cost); its
wrapper is ``graphopt.cuda_ext.<op>``. Importing this package makes the ops exist
(``ensure_loaded``): backed by the compiled CUDA kernels when a GPU and a CUDA toolkit are
present, by the plain-torch reference implementations otherwise. See README.md in this folder.
"""
from . import reference, registry
from ._loader import backend, backend_info, ensure_loaded
from .pointwise import Program, ProgramError, evaluate, parse
from .registry import schemas

for _op in registry.all_ops().values():
    globals()[_op.name] = _op.wrapper  # graphopt.cuda_ext.<op>: the op's wrapper
del _op

__all__ = [
    "ensure_loaded", "backend", "backend_info", "schemas", "reference", "registry",
    *registry.all_ops(), "Program", "ProgramError", "parse", "evaluate",
]

ensure_loaded()
