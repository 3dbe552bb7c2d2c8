# Answered: Where does a sweep config's H200 plan price its time, by op class, to hold against a kernel profile? FocalNet-T bs64 (2026-12-06, before align_gemm): GEMMs on the align1 fallback 1.50 ms (fit from that profile), other GEMMs 0.88 predicted against 1.24 measured, aten's strided elementwise ops 0.31 against 0.62 and the mean reductions 0.18 against 0.32 (the H100 profile results/profile_hf-focalnet_bs64_2026-12-06_h100.md, whose copy rate is below the H200 profile's).
"""Predicted time of a sweep config's optimized graph by op class (planned on the CPU for a GPU profile).

    python benchmarks/diag/diag_pred_by_class.py hf-focalnet 64 [--target h200] [--disable align_gemm,...]
"""
import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt import ir  # noqa: E402
from graphopt.cost.model import CostModel, gemm_align1  # noqa: E402
from graphopt.cost.profiles import get_profile  # noqa: E402
from graphopt.tools import perf_sweep  # noqa: E402

GEMMS = ("linear", "addmm", "_addmm_activation", "mm")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("batch", type=int)
    p.add_argument("--target", default="h200")
    p.add_argument("--disable", default="")
    a = p.parse_args()
    model, inputs = perf_sweep.build(a.config, a.batch)
    model = model.to(torch.bfloat16)
    cv = lambda x: x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
    inputs = {k: cv(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(cv(x) for x in inputs)
    om = graphopt.optimize(model, inputs, target=a.target, check_accuracy=False, measure=False,
                           disable=[d for d in a.disable.split(",") if d])
    gm = next(m for m in om.modules() if hasattr(m, "graph"))
    cm = CostModel(get_profile(a.target)[0])
    by_class = collections.defaultdict(lambda: [0, 0.0])
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = cm.node_cost(n).time_s
        if t <= 0:
            continue
        key = ir.op_name(n)
        if key in GEMMS:
            key = "gemm (align1)" if gemm_align1(n) else "gemm"
        by_class[key][0] += 1
        by_class[key][1] += t
    print("| op class | nodes | predicted ms |\n| --- | ---: | ---: |")
    for k, (count, t) in sorted(by_class.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {count} | {t * 1e3:.3f} |")
    print(f"\nsum of node times {sum(t for _, t in by_class.values()) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
