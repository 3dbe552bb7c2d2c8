"""graphopt: a torch.fx computation-graph optimizer for PyTorch.

    import graphopt
    opt = graphopt.optimize(model, example_inputs)   # an nn.Module
    print(opt.report)                                # or graphopt.explain(...)
    graphopt.export(opt, "model.pt")                 # TorchScript, report embedded
    loaded = graphopt.load("model.pt")
"""

from .api import OptimizedModule, explain, optimize
from .capture import capture
from .errors import (AccuracyError, ArtifactError, BudgetError, CaptureError, GraphoptError, GuardError,
                     KernelBuildError, ModelSpecError, PassConfigError, UnsupportedOpError)
from .export import export, load
from .report import Report

__version__ = "0.1.0"

__all__ = [
    "optimize", "explain", "export", "load", "capture", "OptimizedModule", "Report",
    "GraphoptError", "CaptureError", "UnsupportedOpError", "BudgetError", "ArtifactError", "ModelSpecError",
    "PassConfigError", "KernelBuildError", "AccuracyError", "GuardError",
]
