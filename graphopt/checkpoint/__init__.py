"""Activation checkpointing: fit a training step into a memory budget by recomputing activations.

:func:`plan_checkpoints` chooses what to keep (:mod:`.planner`); :func:`apply_plan` rewrites the
graph with one of two backends:

* ``aot`` (:mod:`.aot`): each region becomes one module that AOTAutograd traces into a joint
  forward+backward graph, cut by graphopt's own partition (the backward gets the kept values and
  reruns the rest; random ops are always kept). Forward and backward run as plain ATen graphs.
* ``sac`` (:mod:`.sac`): each region runs under ``torch.utils.checkpoint`` with a selective
  policy (:mod:`.runtime`); random ops replay the saved RNG state.

``"auto"`` takes the AOT rewrite where it traces the graph and falls back to the selective
checkpoint, saying why. :func:`fuse_training_graph` compiles a training graph into AOT regions
that recompute nothing, so that its forward and backward graphs can be fused.

Pointwise fusion of the AOT graphs is passed in as a callable (``fuser(graph) -> groups fused``):
this package does not import the passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from graphopt import ir
from graphopt.cost.activations import ActivationModel, format_bytes, resolve_budget
from graphopt.errors import BudgetError, GraphoptError
from graphopt.pipeline import PassContext, PassResult

from . import aot, planner, sac
from .aot import AotRecompute, AotUnavailable, fuse_training_graph
from .planner import Plan
from .runtime import CheckpointRegion, OuterCheckpoint

__all__ = ["BACKENDS", "AotRecompute", "AotUnavailable", "CheckpointPlan", "CheckpointRegion", "OuterCheckpoint",
           "Plan", "apply_plan", "fuse_training_graph", "option", "plan_checkpoints"]

BACKENDS = ("auto", "aot", "sac")


def option(ctx: PassContext, name: str, default=None):
    """The run's setting ``name`` (``memory_budget``, ``checkpoint_backend``): the one place this
    package reads the context's options."""
    value = getattr(ctx.options, name, None)
    return default if value is None else value


@dataclass
class CheckpointPlan:
    """What :func:`plan_checkpoints` chose. ``plan`` is None when the baseline already fits."""

    am: ActivationModel
    budget: float  # bytes
    requested: str  # the backend asked for: auto | aot | sac
    backend: str  # the backend planned for: aot | sac ("" when nothing is recomputed)
    plan: Plan | None
    details: dict  # the report's numbers (budget, baseline, prediction)
    notes: list = field(default_factory=list)
    why_not_aot: str | None = None
    caps: list = field(default_factory=list)
    offset: float = 0.0
    headroom: float = 0.0


def plan_checkpoints(gm: fx.GraphModule, ctx: PassContext, budget, backend: str | None = "auto") -> CheckpointPlan:
    """Plan the recomputation of training graph ``gm`` under ``budget`` (a fraction of the
    captured graph's step activation memory, ``ctx.captured_activation_bytes``, else of ``gm``'s;
    or bytes). Raises ``BudgetError`` stating the achievable minimum when
    no plan fits, ``GraphoptError`` for an unknown or unusable ``backend``."""
    am = ActivationModel.build(gm, ctx.cost, ctx.hints, device_kind=ctx.cost.device_kind)
    # the budget covers a step's activation memory (what max_memory_allocated measures beyond
    # parameters, gradients and inputs): saved tensors, the outputs, the backward's working set
    base = am.step_activation_bytes()
    budget_bytes = resolve_budget(budget, ctx.captured_activation_bytes or base)
    offset = am.all_output_bytes() + am.backward_working_bytes()
    details = {
        "checkpoint": True,
        "budget_bytes": budget_bytes,
        "budget": budget if isinstance(budget, (int, float)) else str(budget),
        "baseline_saved_bytes": am.baseline_saved_bytes(),
        "baseline_activation_bytes": base,
        "captured_activation_bytes": ctx.captured_activation_bytes or base,
        "baseline_peak_bytes": am.step_peak_bytes(),
        "output_bytes": am.all_output_bytes(),
        "baseline_held_bytes": am.held_bytes(),
        "backward_working_bytes": am.backward_working_bytes(),
    }
    requested = str(backend or "auto").lower()
    out = CheckpointPlan(am, budget_bytes, requested, "", None, details, offset=offset)
    if base <= budget_bytes:
        details.update(predicted_saved_bytes=details["baseline_saved_bytes"],
                       predicted_held_bytes=details["baseline_held_bytes"],
                       predicted_activation_bytes=details["baseline_activation_bytes"],
                       predicted_peak_bytes=details["baseline_peak_bytes"], extra_ms=0.0, regions=0)
        out.notes.append(f"the baseline activations ({format_bytes(base)}) fit the budget "
                         f"({format_bytes(budget_bytes)}): nothing recomputed")
        return out
    if requested not in BACKENDS:
        raise GraphoptError(f"checkpoint_backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    why_not_aot = None
    if requested in ("auto", "aot"):
        why_not_aot = aot.available()
        if why_not_aot is not None and requested == "aot":
            raise GraphoptError(f"checkpoint_backend 'aot' cannot run: {why_not_aot}")
    use_aot = requested in ("auto", "aot") and why_not_aot is None
    out.caps = [max(share * am.baseline_saved_bytes(), 1.0) for share in planner.REGION_SHARES]
    # plans leave the profile's allocator headroom free (room for the prediction's error)
    out.headroom = ctx.cost.allocator_headroom
    details["planned_bytes"] = budget_bytes * (1.0 - out.headroom)
    try:
        plan = planner._Selector(am, ctx.hints, keep_random=use_aot, aot=use_aot).select(
            budget_bytes, out.caps, offset, out.headroom)
    except BudgetError as e:
        if not use_aot or requested == "aot":
            raise
        # the AOT rewrite keeps every random op's output; the selective checkpoint replays RNG
        try:
            plan = planner._Selector(am, ctx.hints).select(budget_bytes, out.caps, offset, out.headroom)
        except BudgetError as e_sac:
            # neither fits: the error states the lower of the two backends' minimums (the selective
            # checkpoint's upper-bound accounting and one-level plans usually need more)
            if e_sac.minimum is not None and e.minimum is not None and e_sac.minimum < e.minimum:
                raise
            if e_sac.minimum is None:
                raise e from None
            # the AOT minimum holds where the AOT rewrite can trace the graph (apply_plan finds out)
            raise BudgetError(f"{e}; where the AOT rewrite cannot trace the graph, the selective checkpoint "
                              f"needs at least {format_bytes(e_sac.minimum)}", minimum=e.minimum) from None
        use_aot = False
        if any(ir.is_random(n) for n in am.body):
            why_not_aot = f"the budget needs recomputing random ops, which the AOT rewrite never does ({e})"
        else:
            why_not_aot = f"no AOT plan fits the budget ({e}); a selective-checkpoint plan does"
    details.update(planner.plan_details(am, plan))
    out.notes.extend(plan.notes)
    out.plan, out.backend, out.why_not_aot = plan, "aot" if use_aot else "sac", why_not_aot
    return out


def apply_plan(gm: fx.GraphModule, ctx: PassContext, cp: CheckpointPlan, res: PassResult, fuser=None) -> None:
    """Rewrite ``gm`` as ``cp`` plans, recording the plan's details and notes, and the rewrites,
    in ``res``. The AOT backend, when it cannot trace the graph, leaves it unchanged and the plan
    is made again for the selective checkpoint (``checkpoint_backend="aot"``: ``GraphoptError``).
    ``fuser``: pointwise fusion for the AOT graphs, or None."""
    res.details = cp.details
    res.notes.extend(cp.notes)
    if cp.plan is None:
        return
    details, backend = cp.details, cp.requested
    why_not_aot = cp.why_not_aot
    if cp.backend == "aot":
        snapshot = gm.graph.python_code("self").src
        try:
            # a plan that fits by recomputing nothing fits by the AOT graphs' own saved tensors (their
            # partition saves less than eager autograd): its regions are compiled all the same
            recomputes = any(n not in cp.plan.keep for nodes in cp.plan.regions for n in nodes)
            aot.rewrite_aot(gm, ctx, cp.am, cp.plan, res, details, strict=backend == "aot", fuser=fuser,
                            every_region=not recomputes)
            details["backend"] = "aot" if not details.get("aot_fallbacks") else "aot+sac"
            res.notes.append("backend aot: recomputation is a graph rewrite (AOTAutograd joint graph of each "
                             "region cut by graphopt's partition); forward and backward run as plain ATen graphs"
                             + ("" if backend == "aot" else " (chosen by default: it traced this graph)"))
            return
        except AotUnavailable as e:
            if gm.graph.python_code("self").src != snapshot:  # never half-rewritten
                raise GraphoptError(f"the AOT checkpoint rewrite failed after changing the graph: {e}") from e
            if backend == "aot":
                raise GraphoptError(f"checkpoint_backend 'aot' cannot run: {e}") from e
            why_not_aot = str(e)
            # the plan kept random ops for AOT; the selective backend replays RNG instead
            try:
                sac_plan = planner._Selector(cp.am, ctx.hints).select(cp.budget, cp.caps, cp.offset, cp.headroom)
            except BudgetError as e_sac:
                raise BudgetError(f"an AOT plan fits memory budget {format_bytes(cp.budget)}, but the AOT rewrite "
                                  f"cannot run on this graph ({why_not_aot}); and {e_sac}",
                                  minimum=e_sac.minimum) from None
            cp.plan, cp.backend, cp.why_not_aot = sac_plan, "sac", why_not_aot
            details.update(planner.plan_details(cp.am, cp.plan))
    details["backend"] = "sac"
    why = ("asked for (checkpoint_backend='sac')" if backend == "sac"
           else f"the AOT rewrite could not run: {why_not_aot}")
    res.notes.append(f"backend sac: torch.utils.checkpoint regions with a selective policy; {why}")
    details["backend_reason"] = why
    sac.rewrite_sac(gm, ctx, cp.am, cp.plan, res, details)
