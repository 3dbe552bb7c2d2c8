"""graphopt::fused_pointwise: any chain of elementwise ops with broadcasting, and row reductions over the
last dim (sum, max: softmaxes, norms) with their prologue and epilogue, or concatenations read in place, written as a program in
the small SSA language of ``pointwise.py`` (build one with ``Program``, read one with ``parse``);
returns the program's outputs, dense in the broadcast shape (in the inputs' memory order where
they agree on one).

CUDA: ``pointwise_triton.py`` generates and caches a Triton kernel per program and layout; the
reference evaluates the program with torch ops (fp64 included).

Differentiable: the backward is another ``fused_pointwise`` call, running the program's derivative
(``pointwise_grad.backward_program``: it recomputes the forward values it needs, so only the
forward inputs it reads are saved), then ``sum_to_size`` for each input that was broadcast.
"""
from __future__ import annotations

from typing import Sequence

import torch

from graphopt.cost.ops import OpCost, fused_cost

from ..common import fresh
from ..pointwise import Program, ProgramError, broadcast_shape, dense_order, empty_in_order, evaluate, parse
from ..pointwise_grad import backward_program
from ..registry import define_op

SCHEMA = "fused_pointwise(str program, Tensor[] inputs) -> Tensor[]"


def reference(program: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate a pointwise program with torch ops."""
    outs = [fresh(o, *inputs) for o in evaluate(program, inputs)]
    p = parse(program)
    order = dense_order(inputs, broadcast_shape(inputs, p), p) if inputs else None
    if order is None:
        return outs
    return [empty_in_order(o.shape, order, o.dtype, o.device).copy_(o) for o in outs]


def fake(program, inputs):
    p = parse(program)
    shape = broadcast_shape(inputs, p)
    device = next((t.device for t in inputs if t.device.type != "cpu"), inputs[0].device if inputs else None)
    order = dense_order(inputs, shape, p)
    return [empty_in_order(shape, order, d, device) for d in p.output_dtypes()]


def cuda(program, inputs):
    from ..pointwise_triton import fused_pointwise_triton

    return fused_pointwise_triton(program, inputs)


def fused_pointwise(program: str | Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a pointwise program (text or :class:`~graphopt.cuda_ext.pointwise.Program`) on
    broadcasting, possibly strided inputs; returns its outputs (contiguous, broadcast shape)."""
    src = program.source if isinstance(program, Program) else program
    return torch.ops.graphopt.fused_pointwise(src, list(inputs))


def setup_context(ctx, inputs, output):
    """Saves the forward inputs the backward program reads (for gradients of every output)."""
    program, tensors = inputs
    ctx.set_materialize_grads(False)  # an unused output's gradient is left out of the backward program
    ctx.program = program
    if not parse(program).differentiable:  # no generated backward: an error if one is asked for
        ctx.saved_index = ()  # (graphopt fuses these only where nothing takes a gradient)
        return
    ctx.in_dtypes = tuple(t.dtype for t in tensors)
    ctx.shapes = [t.shape for t in tensors]
    grads = tuple(o.dtype.is_floating_point for o in output)
    bw = backward_program(program, ctx.in_dtypes, tuple(t.requires_grad for t in tensors), grads)
    ctx.saved_index = bw.inputs
    ctx.save_for_backward(*[tensors[i] for i in bw.inputs])


def backward(ctx, grads):
    if not parse(ctx.program).differentiable:
        raise ProgramError("graphopt::fused_pointwise: a program with row reductions or a catin has no generated "
                           "backward")
    needs = tuple(ctx.needs_input_grad[1])
    bw = backward_program(ctx.program, ctx.in_dtypes, needs, tuple(g is not None for g in grads))
    result: list = [None] * len(ctx.in_dtypes)
    if bw.source is None:
        return None, result
    saved = dict(zip(ctx.saved_index, ctx.saved_tensors))
    outs = torch.ops.graphopt.fused_pointwise(bw.source, [saved[i] for i in bw.inputs] + [grads[j] for j in bw.grads])
    for i, o in zip(bw.outputs, outs):
        shape = ctx.shapes[i]
        result[i] = o if o.shape == shape else o.sum_to_size(shape)
    return None, result


def gathered_inputs(call) -> int:
    """Inputs the kernel reads element by element through their own strides (a broadcast or a layout
    other than the output's), not as vectors at the output's flat index."""
    if not call.outputs:
        return 0
    out = call.outputs[0]
    return sum(1 for t in call.inputs if tuple(t.shape) != tuple(out.shape) or
               (t.stride is not None and out.stride is not None and tuple(t.stride) != tuple(out.stride)))


def cost(call, profile=None) -> OpCost:
    """One memory-bound kernel: its inputs read once, or once per pass where a reducing program
    loops over rows longer than its tile (``pointwise_triton.row_passes``), its outputs written once;
    at least an element load per output element and gathered input at the profile's
    ``op_efficiency["fused_pointwise"]["gather_s"]`` (the unrolled contraction of 16 strided slices)."""
    c = fused_cost(call, profile)
    gather = profile.efficiency("fused_pointwise", "gather_s") if profile is not None else None
    if gather and call.outputs:
        floor = call.outputs[0].numel * gathered_inputs(call) * gather
        c = OpCost(c.flops, c.bytes, device_floor_s=floor or None)
    program = call.arg("program")
    if not isinstance(program, str):
        return c
    p = parse(program)
    if not p.reduces or not call.outputs:
        return c
    from ..pointwise_triton import row_passes

    passes = row_passes(p, call.inputs, call.outputs[0].shape)
    return c if passes == 1 else OpCost(c.flops * passes, call.in_bytes * passes + call.out_bytes,
                                         device_floor_s=c.device_floor_s)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return ("%0 = input 0; %1 = tanh %0; out %1 f32", [torch.randn(24, 32)])


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=fused_pointwise, cost=cost,
               kernel="pointwise_triton.py", cuda=cuda, autograd=(backward, setup_context), example=example)
