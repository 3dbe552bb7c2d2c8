# Answered: Where did precision='auto' lose to the hand-converted GLM? An fp32 GEMM per layer from the autocast-wrapped rotary table; higher-order ops are now opaque to assign_precision (results/archive/precision_2026-11-29_h200_run4.md).
"""Diagnostic: where precision="auto" alone spends its time against the hand-converted model.

    python benchmarks/diag/diag_precision_profile.py glm4-9b-4l --batch 8 --seq-len 1024

Builds the zoo model in fp32, the hand-converted bf16 copy, and graphopt with only the cleanup
passes and assign_precision (no CUDA graph); prints the wall time and the top CUDA kernels of each
(torch.profiler, 3 calls).
"""
import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt.tools.bench import time_call  # noqa: E402
from graphopt.examples import zoo  # noqa: E402
from profile_model import top_kernels  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int)
    a = ap.parse_args()
    model, inputs = zoo.get(a.model, batch=a.batch, seq_len=a.seq_len, device="cuda")
    hand = copy.deepcopy(model).to(torch.bfloat16)
    opt = graphopt.optimize(model, inputs, precision="auto", cuda_graphs=False, check_accuracy=False,
                            passes=["eliminate_dead_code", "fold_constants", "assign_precision"])
    del model
    torch.cuda.empty_cache()
    from graphopt import ir

    big = []
    for n in opt.graph_module.graph.nodes:
        i = ir.info(n) if n.op == "call_function" else None
        if i is not None and i.dtype == torch.float32 and ir.concrete(i.numel, {}) >= 1 << 20:
            big.append(f"{n.name} = {n.target}({', '.join(f'{a.name}:{ir.info(a).dtype}' for a in n.all_input_nodes if ir.info(a) is not None)}) {tuple(i.shape)}")
    print(f"fp32 nodes with >= 1M elements ({len(big)}):")
    for line in big[:40]:
        print("  ", line)
    with torch.no_grad():
        for name, fn in (("hand bf16", lambda: hand(*inputs)), ("graphopt precision-only", lambda: opt(*inputs))):
            ms = sorted(time_call(fn, reps=10, warmup=2, device="cuda"))[5] * 1e3
            total, rows = top_kernels(fn, n=14)
            print(f"## {name}: {ms:.2f} ms wall, {total:.2f} ms kernels")
            for t, c, k in rows:
                print(f"{t:8.3f} ms {c:5d}  {k}")


if __name__ == "__main__":
    main()
