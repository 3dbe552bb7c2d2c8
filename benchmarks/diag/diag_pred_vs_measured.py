# Answered: how far the cost model's predictions are from the committed H100 rows of 2026-12-06, before and after pricing aten's strided kernels and cuDNN's depthwise convolutions (results/pred_vs_measured_h100_2026-12-06_cpu.md: 28 -> 35 of 40 within +-20%).
"""Committed GPU sweep rows against the cost model's prediction, re-planned on the CPU: each row's
config optimized for the profile the GPU planned with (the h200 profile scaled to the row's GPU, as
graphopt.cost.profiles.scaled_to_device does there) and predicted as a replayed CUDA graph, beside the
measured time and the prediction the row committed; the share within +-20% of measured. Answered:
whether a change to the cost model moves the predictions of rows already measured toward the device
(CPU only, no GPU needed), and by op class (--classes) where the time goes.

    PYTHONPATH=$PWD python benchmarks/diag/diag_pred_vs_measured.py benchmarks/results/perf_sweep_2026-12-06_*h100*.json
"""
import argparse
import collections
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt import ir  # noqa: E402
from graphopt.cost.model import CostModel  # noqa: E402
from graphopt.cost.opclass import op_class  # noqa: E402
from graphopt.cost.profiles import get_profile, scaled_to_device  # noqa: E402
from graphopt.tools import perf_sweep  # noqa: E402

# what CUDA reports for the GPUs the committed rows ran on (memory clock kHz, bus bits, SMs, clock kHz)
GPUS = {"h100": types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000,
                                      memory_bus_width=5120, multi_processor_count=132, clock_rate=1_980_000,
                                      total_memory=85_000_000_000)}


def profile_for(path: str):
    if "h100" in Path(path).name:
        prof, _ = scaled_to_device(get_profile("h200")[0], GPUS["h100"])
        return prof
    return get_profile("h200")[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--only", default="", help="comma-separated configs")
    p.add_argument("--skip", default="", help="comma-separated configs left out (too big for this machine)")
    p.add_argument("--plans", action="store_true", help="print each row's applied passes and graphopt ops")
    p.add_argument("--classes", action="store_true", help="print each row's predicted ms by op class")
    a = p.parse_args(argv)
    seen, rows = set(), []
    for f in a.results:
        for r in json.load(open(f))["rows"]:
            g = (r.get("ms") or {}).get("graphopt")
            if not g or r.get("returned") != "optimized" or r["config"] in seen:
                continue
            if a.only and r["config"].split(":")[0] not in a.only.split(","):
                continue
            if r["config"].split(":")[0] in a.skip.split(","):
                continue
            seen.add(r["config"])
            rows.append((f, r))
    within = total = 0
    for f, r in rows:
        name, batch = r["config"].split(":")
        prof = profile_for(f)
        model, inputs = perf_sweep.build(name, int(batch))
        model = model.to(torch.bfloat16)
        cv = lambda x: x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
        inputs = {k: cv(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(cv(x) for x in inputs)
        try:
            om = graphopt.optimize(model, inputs, target=prof, check_accuracy=False, measure=False)
        except Exception as e:  # noqa: BLE001 (a diagnostic: one row's failure is printed, the rest run)
            print(f"{r['config']:36s} failed: {type(e).__name__}: {e}")
            continue
        gm = next(m for m in om.modules() if hasattr(m, "graph"))
        cm = CostModel(prof)
        pred = float(cm.execution_cost(gm, mode="graphed", reuse_outputs=True).total_s) * 1e3
        meas = r["ms"]["graphopt"]
        total += 1
        within += abs(pred / meas - 1) <= 0.2
        print(f"{r['config']:36s} measured {meas:7.3f}  committed pred {r.get('predicted_ms') or 0:7.3f}  "
              f"pred {pred:7.3f}  pred/meas {pred / meas:5.2f}", flush=True)
        if a.plans:  # the plan: each applied pass and how many nodes of each graphopt op the graph has
            ops = collections.Counter(ir.op_name(n) for n in gm.graph.nodes
                                      if n.op == "call_function" and ir.op_namespace(n) == "graphopt")
            print(f"    plan {[x.name for x in om.report.passes if x.status == 'applied']} {sorted(ops.items())}")
        if a.classes:
            by = collections.defaultdict(float)
            for n in gm.graph.nodes:
                if n.op == "call_function":
                    path = op_class(n, cm.flops_bytes(n)[3])
                    by[" ".join(map(str, path[:3])) if path else ir.op_name(n)] += float(cm.node_cost(n).time_s)
            for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:14]:
                print(f"    {k:48s} {v * 1e3:7.3f}")
    print(f"within +-20%: {within} of {total}")


if __name__ == "__main__":
    main()
