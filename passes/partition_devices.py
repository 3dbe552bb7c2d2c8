"""partition_devices: plan contiguous pipeline stages over several devices.

Runs last (family "partition"): the graph the other passes produced is split, by dynamic
programming over cut positions in its topological order, into one stage per device so that the
slowest stage's predicted time (its nodes on that device's profile plus the transfer of the
tensors crossing its boundaries at the link's bandwidth) is as small as possible, within each
device's memory. The pass plans; it does not rewrite the graph. ``optimize`` then places the
stages (graphopt.runtime.placement.PlacedModule) and graphopt.runtime.distributed runs them as a pipeline.
Options (``ctx.options``, graphopt.options.OptimizeOptions): ``partition_devices`` (the devices
resolved), ``microbatches``, ``schedule`` ("gpipe" | "1f1b" | "interleaved1f1b"),
``virtual_stages`` (stages per device, interleaved1f1b only; default 2). A single device (or none)
leaves it a no-op, with the reason. The plan comes back in the result (:class:`PartitionResult`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from graphopt.partition import StagePlan, plan_stages
from graphopt.pipeline import Pass, PassContext, PassResult, register


@dataclass
class PartitionResult(PassResult):
    plan: StagePlan | None = None  # the stages, for optimize() to place


@register
class PartitionDevices(Pass):
    name = "partition_devices"
    family = "partition"
    description = "split the graph into cost-balanced pipeline stages, one per device, within each device's memory"

    def result(self) -> PartitionResult:
        return PartitionResult(self.name, self.family)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PartitionResult:
        res = self.result()
        opts = ctx.options
        devices = list(opts.partition_devices or ())
        if len(devices) < 2:
            res.notes.append("one device: nothing to partition" if devices else
                             "no devices= given: nothing to partition")
            return res
        plan = plan_stages(gm, devices, hints=ctx.hints, schedule=opts.schedule, microbatches=opts.microbatches,
                           training=ctx.training, virtual_stages=opts.virtual_stages)
        res.plan = plan
        res.status = "planned"
        res.details["partition"] = plan.as_dict()
        slow = max(plan.stages, key=lambda s: s.time_s)
        res.notes.append(
            f"{plan.num_stages} stages on {', '.join(s.device for s in plan.stages)}: slowest stage {slow.index} "
            f"{slow.time_s * 1e3:.3f} ms per micro-batch; {plan.schedule} with {plan.microbatches} micro-batch(es), "
            f"bubble {plan.bubble_fraction:.0%}, predicted {plan.predicted_speedup:.2f}× one device")
        res.notes.extend(plan.notes)
        return res
