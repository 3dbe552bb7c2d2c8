# Answered: Where does a training stage's predicted time part from measured? The host: device time within 6%, the step 23% over its kernels; led to host_train_op_s (results/archive/diag_stage_time_2026-11-30_111357.json).
"""Diagnostic: where does a pipeline training stage's predicted time part from the measured one?

On 2 H200s the partition benchmark's stage 0 (embedding + decoder layers) ran 25% slower than
predicted at 8 micro-batches of one sequence, and within 5% at 4 micro-batches of two. This runs a
stage-0-like module (GLM-4-9B-shaped embedding + L decoder layers, bf16, eager attention as the
pipeline's training stages use) on one GPU at each batch size given, and sets the planner's
prediction (``graphopt.partition``: each node's forward and traced backward, priced by the cost
model with the target profile) beside the measurement, in total and by op family:

- predicted: forward + backward seconds per family (a node's backward counted in its forward's family);
- measured: the step's wall time (CUDA events, median), its kernel time and the device time by ATen op
  (self time, one profiled step), grouped into the same families.

    python benchmarks/diag/diag_stage_time.py --out DIR [--batches 1,2] [--layers 4] [--seq 1024]
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt import ir  # noqa: E402
from graphopt import partition as part  # noqa: E402
from graphopt.cost.profiles import get_profile  # noqa: E402
from graphopt.examples import zoo  # noqa: E402
from graphopt.pipeline import available as available_passes, registry  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import cuda_median_ms  # noqa: E402
from diag_stage_fusion import Stage0  # noqa: E402  (embedding + decoder layers, the last hidden state)

FAMILIES = (  # (family, substrings of an op name), first match wins
    ("gemm", ("mm", "linear", "matmul", "addmm", "baddbmm", "bmm")),
    ("attention", ("softmax", "scaled_dot_product", "_efficient_attention", "_flash_attention")),
    ("embedding", ("embedding",)),
    ("norm", ("rsqrt", "pow", "mean", "norm")),
    ("copy", ("copy", "clone", "contiguous", "_to_copy", "cat", "expand", "index")),
    ("reduce", ("sum",)),
)


def family(name: str) -> str:
    name = name.replace("aten::", "").replace("aten.", "").split(".")[0]
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "elementwise"


def predicted(gm, profile):
    """(forward s, backward s) per family and in total, as the planner prices a training stage."""
    hints = ir.shape_hints(gm)
    an = part._Analysis(gm, hints)
    fwd = part._compute_prefix(an, profile, hints)
    both, fallback = part._training_prefix(an, gm, profile, hints, fwd)
    f, b = np.diff(fwd), np.diff(both) - np.diff(fwd)
    rows: dict = {}
    for n, fs, bs in zip(an.order, f, b):
        name = str(n.target) if n.op == "call_function" else n.op
        r = rows.setdefault(family(name), [0.0, 0.0, 0])
        r[0] += fs
        r[1] += bs
        r[2] += 1
    return rows, float(fwd[-1]), float(both[-1]), fallback


def measured(fn, ids, g):
    def step():
        fn(ids).backward(g)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    ms = cuda_median_ms(step, reps=10)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows: dict = {}
    for a in prof.key_averages():
        if a.self_device_time_total > 0 and a.key.startswith("aten::"):
            r = rows.setdefault(family(a.key), [0.0, 0])
            r[0] += a.self_device_time_total / 1e6
            r[1] += a.count
    kernels = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return ms / 1e3, kernels, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--target", default="h200")
    args = ap.parse_args()
    from transformers import Glm4Model

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run on the tiny config
    cfg = zoo.glm4_9b_config(args.layers) if dev == "cuda" else zoo.glm4_tiny_config()
    seq = args.seq if dev == "cuda" else 16
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = Stage0(Glm4Model(cfg).to(dt)).train()
    reg = registry()
    passes = [n for n in available_passes() if reg[n].family in ("cleanup", "fusion", "layout")]
    profile, _ = get_profile(args.target)
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
              "layers": args.layers, "seq": seq, "profile": profile.name, "batches": []}
    for bs in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(3, cfg.vocab_size - 1, (bs, seq), device=dev)
        g = torch.randn(bs, seq, cfg.hidden_size, device=dev, dtype=dt)
        t0 = time.perf_counter()
        opt = graphopt.optimize(model, (ids,), training=True, passes=passes, check_accuracy=False, cuda_graphs=False,
                                target=args.target)
        model.train()
        prows, pf, pboth, fallback = predicted(opt.graph_module, profile)
        if dev == "cuda":
            wall, kern, mrows = measured(opt, ids, g)
        else:
            wall, kern, mrows = float("nan"), float("nan"), {}
        row = {"batch": bs, "predicted_s": pboth, "predicted_forward_s": pf, "measured_s": wall, "kernel_s": kern,
               "untraced_backwards": fallback, "optimize_s": time.perf_counter() - t0,
               "families": {f: {"pred_fwd_s": prows.get(f, [0, 0, 0])[0], "pred_bwd_s": prows.get(f, [0, 0, 0])[1],
                                "nodes": prows.get(f, [0, 0, 0])[2], "measured_s": mrows.get(f, [0, 0])[0],
                                "measured_ops": mrows.get(f, [0, 0])[1]}
                            for f in sorted(set(prows) | set(mrows))}}
        result["batches"].append(row)
        print(f"batch {bs}: predicted {pboth * 1e3:.2f} ms (forward {pf * 1e3:.2f}), measured {wall * 1e3:.2f} ms, "
              f"kernels {kern * 1e3:.2f} ms, {fallback} backwards untraced", flush=True)
        for f, r in row["families"].items():
            print(f"   {f:12s} predicted {r['pred_fwd_s'] * 1e3:7.2f} + {r['pred_bwd_s'] * 1e3:7.2f} ms "
                  f"({r['nodes']} nodes)   measured {r['measured_s'] * 1e3:7.2f} ms ({r['measured_ops']} ops)", flush=True)
        del opt
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H%M%S")
    (out / f"diag_stage_time_{stamp}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
