"""The checkpoint planner's achievable minimum for training_bench's models, and what it is made of.

    python benchmarks/diag/diag_checkpoint_floor.py [--configs llama,glm4,...] [--device cpu|meta]

Builds each config of ``benchmarks/training_bench.py`` (random weights, bf16; on the CPU by default:
on meta, fold_constants cannot fold the causal mask, so fuse_attention keeps the mask and the repeated
K/V and the graph is not the GPU's), runs the bench's passes up to insert_checkpoints planned for the
H200, and prints: the baseline activation memory, the fixed part (outputs and the backward's largest
working set, its node and parameter gradient), the AOT planner's minimum (with the gradients a region
receives held until it returns, as on torch without boxed gradients for custom Functions, and freed)
and the selective checkpoint's, as bytes and fractions of the baseline. Predicted, no device needed."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import training_bench as tb  # noqa: E402

import graphopt  # noqa: E402
import graphopt.checkpoint as ic  # noqa: E402
import graphopt.checkpoint.aot as aotm  # noqa: E402
from graphopt.cost.activations import ActivationModel  # noqa: E402
from graphopt.errors import BudgetError  # noqa: E402

PASSES = ["eliminate_dead_code", "fold_constants", "fuse_attention", "insert_checkpoints"]


class _Stop(Exception):
    pass


def planner_inputs(name: str, device: str):
    """(ActivationModel, PassContext) of ``name``'s training graph as insert_checkpoints sees it."""
    got = {}

    def spy(gm, ctx, budget, backend="auto"):
        got["am"] = ActivationModel.build(gm, ctx.cost, ctx.hints, device_kind=ctx.cost.device_kind)
        got["ctx"] = ctx
        raise _Stop

    orig = ic.plan_checkpoints
    mods = [m for m in list(sys.modules.values()) if getattr(m, "plan_checkpoints", None) is orig]
    for m in mods:
        m.plan_checkpoints = spy
    try:
        model, inputs, *_ = tb.build(tb.ARCHS[name], False, torch.device(device), torch.bfloat16)
        try:
            graphopt.optimize(model, inputs, training=True, memory_budget=0.3, check_accuracy=False,
                              target="h200", passes=PASSES)
        except _Stop:
            pass
    finally:
        for m in mods:
            m.plan_checkpoints = orig
    return got["am"], got["ctx"]


def minimum(am, ctx, offset, caps, aot: bool, held: bool | None = None) -> float:
    if held is not None:
        aotm.frees_incoming_grads = lambda: not held
    sel = ic.planner._Selector(am, ctx.hints, keep_random=aot, aot=aot)
    try:
        sel.select(0.01 * am.step_activation_bytes(), caps, offset, ctx.cost.allocator_headroom)
    except BudgetError as e:
        return e.minimum
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="llama,glm4,qwen2,gpt2,bert")
    ap.add_argument("--device", default="cpu", choices=["cpu", "meta"])
    args = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    probe = aotm.frees_incoming_grads
    for name in args.configs.split(","):
        am, ctx = planner_inputs(name, args.device)
        base = am.step_activation_bytes()
        offset = am.all_output_bytes() + am.backward_working_bytes()
        caps = [max(s * am.baseline_saved_bytes(), 1.0) for s in ic.planner.REGION_SHARES]
        n, work, params = am.largest_working()
        g = lambda b: f"{b / 1e9:.3f} GB ({b / base:.3f})"  # noqa: E731
        print(f"{name}: baseline {base / 1e9:.3f} GB; fixed {g(offset)}: outputs {g(am.all_output_bytes())}, "
              f"largest working set {g(work)} at {n.name if n is not None else '-'}"
              + (f" ({params[0][0]}'s gradient {g(params[0][1])})" if params else ""))
        for held in (True, False):
            low = minimum(am, ctx, offset, caps, True, held)
            print(f"  aot minimum, incoming gradients {'held' if held else 'freed'}: {g(low)}")
        aotm.frees_incoming_grads = probe
        print(f"  selective checkpoint minimum: {g(minimum(am, ctx, offset, caps, False))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
