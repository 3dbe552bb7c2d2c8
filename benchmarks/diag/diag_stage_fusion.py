# Answered: Why did fused AOT training stages slow the pipeline? 104 fused launches through Python make the stage host-bound though device time falls 15%: reverted (results/archive/diag_stage_fusion_2026-11-30_h200.md).
"""Diagnostic: why did running a pipeline's training stages as AOT graphs with pointwise fusion make
them slower on the H200, when the same fusion made the checkpointed 8-layer GLM step 12% faster?

One GPU, a stage-0-like module: GLM-4-9B-shaped embedding + 4 decoder layers (no final norm, no LM
head), bf16, batch 2, seq 1024 (a 1F1B micro-batch of the partition benchmark), SDPA attention. A
training step is forward + backward of sum(out * g). Variants: eager; the captured graph after
fold_constants + fuse_attention (what a training stage runs); the same with its ATen ops as AOT
regions (graphopt.checkpoint.fuse_training_graph) without and with pointwise fusion. Step times
(median of CUDA-event timed steps) and each variant's top kernels in one profiled step.

    python benchmarks/diag/diag_stage_fusion.py [--batch 2] [--seq 1024] [--layers 4]
"""
import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import graphopt  # noqa: E402
from graphopt import ir  # noqa: E402
from graphopt.cost.model import CostModel  # noqa: E402
from graphopt.cost.profiles import get_profile  # noqa: E402
from graphopt.examples import zoo  # noqa: E402
from graphopt.checkpoint import fuse_training_graph  # noqa: E402
from graphopt.passes.insert_checkpoints import training_fuser  # noqa: E402
from graphopt.pipeline import PassContext  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import cuda_median_ms  # noqa: E402


class Stage0(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids).last_hidden_state


def step_fn(fn, ids, g):
    def run():
        out = fn(ids)
        out.backward(g)
    return run


def timed(run, reps=10):
    if not torch.cuda.is_available():
        import time

        run()
        t = time.perf_counter()
        for _ in range(2):
            run()
        return (time.perf_counter() - t) / 2 * 1e3
    return cuda_median_ms(run, reps=reps)


def top_kernels(run, n=10):
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return 0.0, []
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = [(e.device_time_total, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return total / 1e3, [(f"{t / 1e3:.2f} ms", c, k[:90]) for t, c, k in rows[:n]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from transformers import Glm4Model

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run on the tiny config
    cfg = zoo.glm4_9b_config(args.layers) if dev == "cuda" else zoo.glm4_tiny_config()
    if dev == "cpu":
        args.seq = 16
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    with torch.device(dev):
        base = Stage0(Glm4Model(cfg).to(dt)).train()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    g = torch.randn(args.batch, args.seq, cfg.hidden_size, device=dev, dtype=dt)
    variants = {"eager": base}
    for label, fuse in (("captured (fold_constants, fuse_attention)", None), ("+ AOT regions, no fusion", False),
                        ("+ AOT regions, fused", True)):
        m = copy.deepcopy(base)
        opt = graphopt.optimize(m, (ids,), training=True, passes=["fold_constants", "fuse_attention"],
                                check_accuracy=False, cuda_graphs=False, target="h200")
        if fuse is not None:
            gm = opt.graph_module
            prof, _ = get_profile("h200")
            ctx = PassContext(profile=prof, cost=CostModel(prof), training=True, hints=ir.shape_hints(gm),
                              scheduled=frozenset({"fuse_elementwise"}))
            r = fuse_training_graph(gm, ctx, training_fuser(ctx), fuse=fuse)
            print(f"{label}: {r.status}; {'; '.join(r.notes)[:300]}", flush=True)
        variants[label] = opt
    for label, fn in variants.items():
        run = step_fn(fn, ids, g)
        ms = timed(run)
        total, top = top_kernels(run)
        print(f"\n{label}: {ms:.2f} ms/step (kernel time {total:.2f} ms)", flush=True)
        for row in top:
            print("   ", *row, flush=True)


if __name__ == "__main__":
    main()
