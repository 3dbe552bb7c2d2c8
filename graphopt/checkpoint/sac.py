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


def writes_below_the_graph(n: fx.Node) -> bool:
    """Does the op of ``n``, a composite that dispatch decomposes (CompositeImplicitAutograd: nn.GRU's
    ``aten.gru``), both take views and write tensors in place among the ops it runs, with gradients
    recorded as in a training step (GRU's gates: sigmoid_ and tanh_ on chunks of one GEMM's output;
    CPU dropout's bernoulli_ into a fresh tensor takes no view)? Found by running it on the node's
    fake inputs under a recording mode (once per op and input signature). False for ops that dispatch
    as themselves and where it cannot tell (a region where that is wrong fails loudly in backward:
    torch's selective checkpoint checks the ops it reruns)."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload) or not torch._C._dispatch_has_kernel_for_dispatch_key(
            t.name(), "CompositeImplicitAutograd"):
        return False
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode

    vals = [a.meta.get("val") for a in n.all_input_nodes]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return False
    key = (t, ir._signature(fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))))
    if key in _WRITES_BELOW:
        return _WRITES_BELOW[key]

    class Record(TorchDispatchMode):
        wrote = viewed = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Record.wrote |= func._schema.is_mutable
            Record.viewed |= bool(getattr(func, "is_view", False))
            return func(*args, **(kwargs or {}))

    def grad_leaf(v):  # the training step's fakes: what required grad still does
        return v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v

    try:
        with mode, torch.enable_grad():
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: grad_leaf(a.meta.get("val")))
            with Record():
                t(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not runnable on its fakes: treated as dispatching as itself
        return False
    _WRITES_BELOW[key] = Record.wrote and Record.viewed
    return _WRITES_BELOW[key]


_WRITES_BELOW: dict = {}


def split_at_uncachable(nodes: list, keep: set) -> list:
    """``nodes`` without the kept nodes a selective policy cannot cache (:func:`writes_below_the_graph`:
    torch's selective checkpoint, caching the ops nn.GRU decomposes into, hands the rerun tensors
    whose strides differ from the forward's, and the rerun takes another path and fails). Such a node
    is kept by running outside any region, where autograd saves what it needs: the runs of nodes
    between them are the regions."""
    out, run = [], []
    for n in nodes:
        if n in keep and writes_below_the_graph(n):
            if run:
                out.append(run)
            run = []
            continue
        run.append(n)
    if run:
        out.append(run)
    return out


def checkpoint_regions(gm: fx.GraphModule, ctx: PassContext, am: ActivationModel, plan: Plan, res: PassResult,
                       details: dict, regions: list, prefix: str = "ckpt_region_") -> None:
    """Each of ``regions`` (kept nodes a policy cannot cache left outside, :func:`split_at_uncachable`;
    split after kept GEMMs, :func:`split_at_kept_gemms`) that recomputes something becomes one
    CheckpointRegion call, selective where it keeps nodes inside."""
    subregions = [sub for nodes in regions for part in split_at_uncachable(nodes, plan.keep)
                  for sub in split_at_kept_gemms(part, plan.keep)]
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
