"""A model that neither torch.export nor torch.fx.symbolic_trace can capture: its control flow
depends on tensor *values* (``if h.sum() > 0``), not on shapes.

``graphopt.capture``/``optimize`` must raise ``graphopt.CaptureError`` naming the line of that
``if`` (``BRANCH_LINE`` below) and suggesting a rewrite (``torch.where`` or ``torch.cond``).

    graphopt explain examples/data_dependent.py:build     # one-line error, exit 2
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


class DataDependent(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent branch: the value decides, not the shape
            return torch.relu(h)
        return -h


def _branch_line() -> int:
    lines, start = inspect.getsourcelines(DataDependent.forward)
    return start + next(i for i, line in enumerate(lines) if "if h.sum() > 0" in line)


#: line number (in this file) of the value-dependent ``if``
BRANCH_LINE: int = _branch_line()


def build(seed: int = 0, batch: int = 4) -> tuple[nn.Module, tuple]:
    """Factory for ``graphopt explain examples/data_dependent.py:build``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DataDependent().eval()
        x = torch.randn(batch, 16)
    return model, (x,)
