"""The selective-checkpoint backend: each region of a plan becomes a ``CheckpointRegion`` call
(``torch.utils.checkpoint``, non-reentrant, RNG state preserved where the region draws random
numbers) whose policy caches the kept nodes' outputs and reruns the rest in backward."""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.activations import ActivationModel
from graphopt.pipeline import PassContext, PassResult

from .extract import extract_region
from .planner import Plan
from .runtime import CheckpointRegion

# kept nodes whose backward saves only their inputs (and weights): ending a plain-checkpoint region
# with one costs no recomputation of it (the early stop comes before the kernel would run)
_INPUT_SAVING = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "conv1d", "conv2d", "conv3d", "convolution",
                 "_convolution"}


def _input_saving(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and ir.op_name(n) in _INPUT_SAVING


def split_at_kept_gemms(nodes: list, keep: set) -> list:
    """Split a region after each kept GEMM/convolution where only kept values (or the region's
    own inputs) cross the cut. Returns [(sub-region, selective)]: ``selective`` is False when no
    kept node sits inside the sub-region except an input-saving one at its end, so a plain
    checkpoint realizes it with the same saved memory and no per-op dispatch mode."""
    pos = {n: i for i, n in enumerate(nodes)}
    # last position (inside the region) that reads each node
    last_use = {n: max([pos[u] for u in n.users if u in pos], default=-1) for n in nodes}
    out, start = [], 0
    for i, n in enumerate(nodes):
        if i == len(nodes) - 1 or n not in keep or not _input_saving(n):
            continue
        crossing = [m for m in nodes[start:i + 1] if last_use[m] > i]
        if all(m in keep for m in crossing):
            out.append(nodes[start:i + 1])
            start = i + 1
    out.append(nodes[start:])
    result = []
    for sub in out:
        inner_kept = [n for n in sub[:-1] if n in keep]
        last_ok = sub[-1] not in keep or _input_saving(sub[-1])
        result.append((sub, bool(inner_kept) or not last_ok))
    return result


def checkpoint_regions(gm: fx.GraphModule, ctx: PassContext, am: ActivationModel, plan: Plan, res: PassResult,
                       details: dict, regions: list, prefix: str = "ckpt_region_") -> None:
    """Each of ``regions`` (split after kept GEMMs, :func:`split_at_kept_gemms`) that recomputes
    something becomes one CheckpointRegion call, selective where it keeps nodes inside."""
    subregions = [sub for nodes in regions for sub in split_at_kept_gemms(nodes, plan.keep)]
    for i, (nodes, selective) in enumerate(subregions):
        recomputed = [n for n in nodes if n not in plan.keep]
        if not recomputed:
            continue
        extra = sum(am.seconds[n] for n in recomputed)
        call = extract_region(gm, nodes, plan.keep, f"{prefix}{i}", ctx, selective)
        if call is None:
            res.reject(f"checkpoint region {i} ({nodes[0].name}…{nodes[-1].name})",
                       "a node outside the region both reads it and feeds it; left as it is")
            continue
        details["selective_regions"] = details.get("selective_regions", 0) + int(selective)
        kind = "selective" if selective else "plain"
        res.record(f"checkpoint region, {kind} ({len(recomputed)} of {len(nodes)} nodes recomputed)",
                   recomputed[:6], [call], -extra)


def rewrite_sac(gm: fx.GraphModule, ctx: PassContext, am: ActivationModel, plan: Plan, res: PassResult,
                details: dict) -> None:
    """Every region of the plan that recomputes something becomes checkpoint calls."""
    details["selective_regions"] = 0
    checkpoint_regions(gm, ctx, am, plan, res, details, plan.regions)
    details["regions"] = sum(1 for n in gm.graph.nodes if n.op == "call_module"
                             and isinstance(gm.get_submodule(n.target), CheckpointRegion))
    gm.recompile()
