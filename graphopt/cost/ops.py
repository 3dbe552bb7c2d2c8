"""The price of graphopt's own ops (``torch.ops.graphopt.*``): a registry of cost functions.

Each op's module in ``graphopt.cuda_ext.ops`` registers one with :func:`register_op_cost`; the
cost model prices a node in the ``graphopt`` namespace by looking its op up here, never by a
branch on its name. A cost function takes an :class:`OpCall` (the node's tensor inputs and
outputs, its arguments by schema name) and the :class:`~graphopt.cost.profiles.DeviceProfile`,
and returns an :class:`OpCost`: FLOPs, bytes, launches and which efficiency the device runs it
at; :class:`~graphopt.cost.model.CostModel` turns that into time the same way for every op.
Corrections measured for one op live in the profile's ``op_efficiency`` table under a key the
op's cost function names (``profile.efficiency(key, field)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from .. import ir
from ..errors import GraphoptError

NAMESPACE = "graphopt"


@dataclass
class OpCall:
    """One call of an op, as its cost function sees it."""

    node: fx.Node
    inputs: list  # TensorInfo of every tensor input, each input node once (ir.arg_infos)
    outputs: list  # TensorInfo of every tensor output

    def arg(self, name: str, default=None):
        """The argument ``name`` of the op's schema as the node passes it (an fx.Node for a
        tensor, its value for a literal), or ``default`` when left out."""
        target = self.node.target
        if name in self.node.kwargs:
            return self.node.kwargs[name]
        if isinstance(target, torch._ops.OpOverload):
            for i, a in enumerate(target._schema.arguments):
                if a.name == name:
                    if i < len(self.node.args):
                        return self.node.args[i]
                    return a.default_value if a.has_default_value() else default
        raise GraphoptError(f"{self.node.target} has no argument {name!r}")

    def info(self, name: str) -> ir.TensorInfo | None:
        """TensorInfo of the tensor argument ``name`` (None when it is left out or None)."""
        a = self.arg(name)
        return ir.info(a) if isinstance(a, fx.Node) else None

    @property
    def in_bytes(self):
        return sum(i.nbytes for i in self.inputs)

    @property
    def out_bytes(self):
        return sum(o.nbytes for o in self.outputs)


@dataclass
class OpCost:
    """What one call costs, for :class:`~graphopt.cost.model.CostModel` to time.

    compute = flops / rate, memory = bytes / bandwidth, both times ``slowdown``; the device time
    is ``profile.gpu_seconds(compute, memory, efficiency)`` and the eager time
    ``profile.kernel_seconds(...)``, at least ``floor_s``. An op that runs several kernels of
    different kinds prices them itself and gives their eager time as ``time_s``."""

    flops: object
    bytes: object
    launches: int = 1
    # "matmul": tensor-core work (its flops count at the matmul rate in the roofline floor);
    # "fused": one of our memory-bound kernels; any other name is reported as is
    kind: str = "fused"
    # the profile's efficiency the device runs it at (DeviceProfile.gpu_seconds): "memory",
    # "matmul", "conv", "attention", or a key of profile.op_efficiency
    efficiency: str = "memory"
    # FLOP/s its flops run at; None: the matmul rate of its first input's dtype for kind
    # "matmul", the elementwise rate otherwise
    rate: object = None
    # time spent idle, as a factor on compute and memory time (a persistent kernel's last round)
    slowdown: float = 1.0
    # the least eager time (block scheduling of a kernel that gives each row a block)
    floor_s: object = None
    # the least device time, eager or replayed (waves of tiny programs, element loads of gathered inputs)
    device_floor_s: object = None
    # the eager time of an op whose kernels are priced one by one (None: the roofline above)
    time_s: object = None
    # device seconds beyond the roofline, added to the memory time (another kernel's fixed time)
    extra_s: float = 0.0
    # bytes (read and written) of the copy its library call makes first of an input it cannot read
    # as laid out (cuDNN's of a channel slice): a strided copy kernel of its own (cost.model.input_copy_s)
    copy_bytes: object = 0.0


CostFn = Callable[[OpCall, "object"], OpCost]
_COSTS: dict[str, CostFn] = {}


def register_op_cost(name: str, fn: CostFn) -> None:
    """Price ``graphopt::<name>`` with ``fn(call, profile) -> OpCost`` (replaces an earlier one)."""
    _COSTS[name.split("::")[-1]] = fn


def op_cost_fn(name: str) -> CostFn:
    """The cost function of ``graphopt::<name>``."""
    try:
        return _COSTS[name.split("::")[-1]]
    except KeyError:
        raise GraphoptError(f"{NAMESPACE}::{name} has no cost function: its module in graphopt.cuda_ext.ops "
                            "registers one with graphopt.cost.ops.register_op_cost") from None


ClassFn = Callable[[OpCall], "tuple | None"]
_CLASSES: dict[str, ClassFn] = {}


def register_op_class(name: str, fn: ClassFn) -> None:
    """Class ``graphopt::<name>`` as the ATen op it replaces: ``fn(call)`` returns that op's class
    path (graphopt.cost.opclass.conv_tags, gemm_tags, sdpa_tags over the call's tensors), or None
    where it cannot tell; graphopt.cost.opclass.op_class keys the op by its name and those tags."""
    _CLASSES[name.split("::")[-1]] = fn


def op_class_fn(name: str) -> ClassFn | None:
    """The class function ``graphopt::<name>`` registered, or None (classed by its name alone)."""
    return _CLASSES.get(name.split("::")[-1])


def registered() -> list[str]:
    """The ops with a cost function, in registration order."""
    return list(_COSTS)


def op_call(node: fx.Node) -> OpCall:
    return OpCall(node, ir.arg_infos(node), ir.infos(node))


def fused_cost(call: OpCall, profile=None, *, flops_per_element=1, floor_s=None) -> OpCost:
    """One memory-bound kernel that reads every input once and writes every output once,
    ``flops_per_element`` FLOPs per element of its first output."""
    numel = call.outputs[0].numel if call.outputs else 0
    return OpCost(numel * flops_per_element, call.in_bytes + call.out_bytes, floor_s=floor_s)
