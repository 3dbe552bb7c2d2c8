"""graphopt: a torch.fx computation-graph optimizer for PyTorch.

    import graphopt
    opt = graphopt.optimize(model, example_inputs)   # an nn.Module
    print(opt.report)                                # or graphopt.explain(...)
    graphopt.export(opt, "model.pt")                 # TorchScript, report embedded
    loaded = graphopt.load("model.pt")
"""

from pathlib import Path as _Path

# passes/, cuda_ext/ and examples/ sit beside graphopt/ in the source tree and are mapped into
# the package by pyproject's package-dir. When graphopt is imported straight from a checkout
# (the repo root on sys.path, no install), the same mapping holds through __path__.
_root = _Path(__file__).resolve().parent.parent
if (_root / "passes" / "__init__.py").exists() and (_root / "pyproject.toml").exists():
    __path__.append(str(_root))  # noqa: F821  (package __path__)

from .api import OptimizedModule, explain, optimize  # noqa: E402
from .capture import capture  # noqa: E402
from .errors import (  # noqa: E402
    AccuracyError, ArtifactError, BudgetError, CaptureError, GenerationError, GraphoptError, GuardError, KernelBuildError,
    ModelSpecError, PassConfigError, ReferenceRunError, UnsupportedOpError)
from .export import export, load  # noqa: E402
from .options import OptimizeOptions  # noqa: E402
from .generation import Generator, optimize_generation  # noqa: E402
from .report import Report  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "optimize", "explain", "export", "load", "capture", "OptimizedModule", "OptimizeOptions", "Report",
    "optimize_generation", "Generator",
    "GraphoptError", "CaptureError", "UnsupportedOpError", "BudgetError", "ArtifactError", "ModelSpecError",
    "PassConfigError", "KernelBuildError", "AccuracyError", "ReferenceRunError", "GuardError", "GenerationError",
]

# registers torch.ops.graphopt.* (CUDA kernels when built, reference implementations otherwise),
# so graphs and TorchScript artifacts that call them work after `import graphopt`
from . import cuda_ext  # noqa: E402,F401

# registers every pass with graphopt.pipeline (whose PIPELINE declares their order): importing
# any graphopt module imports this package first, so the registry is full wherever it is read
from . import passes  # noqa: E402,F401
