"""graphopt::column_sum: the sum of a tensor over every dim but the last, in its dtype (fp32 sums, one
rounding): a linear layer's bias gradient, the backward of ``biased_linear``.

CUDA kernel: ``column_sum_triton.py``: programs over column blocks × row bands, each summing its band
into an fp32 partial row; the last band of a column block to finish adds them up (one launch). It replaces aten's reduction over the outer dim that autograd
runs for a linear's bias (``grad.sum(0)``), which the profile prices at its measured rate
(``op_efficiency["bias_grad_sum"]``); this kernel's rate is ``op_efficiency["column_sum"]``.
"""
from __future__ import annotations

import torch

from graphopt.cost.ops import OpCost

from ..common import check_at_least_1d, check_floating, compute_dtype
from ..registry import define_op

SCHEMA = "column_sum(Tensor x) -> Tensor"


def reference(x: torch.Tensor) -> torch.Tensor:
    """x summed over every dim but the last, in the compute dtype, rounded once to x's dtype."""
    n = x.shape[-1]
    return x.to(compute_dtype(x.dtype)).reshape(-1, n).sum(0).to(x.dtype)


def fake(x):
    return x.new_empty((x.shape[-1],))


def cuda(x):
    from ..column_sum_triton import column_sum_triton

    if x.dtype == torch.float64:
        return reference(x)
    return column_sum_triton(x)


def cost(call, profile):
    """x read once (one launch; the partial rows its bands write are small), at the profile's
    measured rate for this kernel (``op_efficiency["column_sum"]``: ``memory_scale``, ``fixed_s``)."""
    return OpCost(call.inputs[0].numel, call.in_bytes + call.out_bytes, efficiency="column_sum")


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over every dim but the last (a bias gradient), in x's dtype, fp32 sums."""
    check_floating("column_sum", x=x)
    check_at_least_1d("column_sum", "x", x)
    return torch.ops.graphopt.column_sum(x)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=column_sum, cost=cost, kernel="column_sum_triton.py",
               cuda=cuda)
