"""graphopt::fused_pointwise: any chain of elementwise ops with broadcasting, written as a program in
the small SSA language of ``pointwise.py`` (build one with ``Program``, read one with ``parse``);
returns the program's outputs, dense in the broadcast shape (in the inputs' memory order where
they agree on one).

CUDA: ``pointwise_triton.py`` generates and caches a Triton kernel per program and layout; the
reference evaluates the program with torch ops (fp64 included).
"""
from __future__ import annotations

from typing import Sequence

import torch

from graphopt.cost.ops import fused_cost

from ..common import fresh
from ..pointwise import Program, broadcast_shape, dense_order, empty_in_order, evaluate, parse
from ..registry import define_op

SCHEMA = "fused_pointwise(str program, Tensor[] inputs) -> Tensor[]"


def reference(program: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate a pointwise program with torch ops."""
    outs = [fresh(o, *inputs) for o in evaluate(program, inputs)]
    order = dense_order(inputs, broadcast_shape(inputs)) if inputs else None
    if order is None:
        return outs
    return [empty_in_order(o.shape, order, o.dtype, o.device).copy_(o) for o in outs]


def fake(program, inputs):
    p = parse(program)
    shape = broadcast_shape(inputs)
    device = next((t.device for t in inputs if t.device.type != "cpu"), inputs[0].device if inputs else None)
    order = dense_order(inputs, shape)
    return [empty_in_order(shape, order, d, device) for d in p.output_dtypes()]


def cuda(program, inputs):
    from ..pointwise_triton import fused_pointwise_triton

    return fused_pointwise_triton(program, inputs)


def fused_pointwise(program: str | Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a pointwise program (text or :class:`~graphopt.cuda_ext.pointwise.Program`) on
    broadcasting, possibly strided inputs; returns its outputs (contiguous, broadcast shape)."""
    src = program.source if isinstance(program, Program) else program
    return torch.ops.graphopt.fused_pointwise(src, list(inputs))


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=fused_pointwise, cost=fused_cost,
               kernel="pointwise_triton.py", cuda=cuda)
