"""Does a model given in NCHW run slower when planned with a candidate H200 profile than with the
shipped one (a profile fit can change whether convert_channels_last applies)? Each model bf16 on the
GPU, NCHW in, optimized once under each profile, the two results timed in alternating rounds.
Usage: python benchmarks/diag/diag_nchw_profiles.py CANDIDATE.json [MODEL:BATCH ...] --out DIR"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import graphopt
from graphopt.tools.bench import time_call
from graphopt.tools.perf_sweep import build


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("candidate")
    p.add_argument("models", nargs="*", default=["resnet50:64", "mobilenet_v3_large:64", "convnext_tiny:64",
                                                 "resnet18:1", "efficientnet_b0:64"])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = []
    for m in a.models:
        name, batch = m.split(":")
        model, inputs = build(name, int(batch))
        model = model.to("cuda", torch.bfloat16).eval()
        inputs = tuple(x.to("cuda", torch.bfloat16) for x in inputs)
        opts, applied = {}, {}
        for tag, target in (("shipped", "h200"), ("candidate", a.candidate)):
            opt = graphopt.optimize(model, inputs, target=target)
            opts[tag] = opt
            applied[tag] = [q.name for q in opt.report.passes if q.status == "applied"]
        ms = {k: [] for k in opts}
        with torch.inference_mode():
            for _ in range(3):  # alternating rounds
                for tag, opt in opts.items():
                    ms[tag] += [t * 1e3 for t in time_call(lambda: opt(*inputs), reps=10, warmup=3, device="cuda")]
        row = {"model": m, **{f"{k}_ms": statistics.median(v) for k, v in ms.items()},
               "channels_last": {k: "convert_channels_last" in v for k, v in applied.items()}, "applied": applied}
        row["candidate/shipped"] = row["candidate_ms"] / row["shipped_ms"]
        print(json.dumps({k: v for k, v in row.items() if k != "applied"}), flush=True)
        rows.append(row)
        del opts
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"diag_nchw_profiles_{time.strftime('%Y-%m-%d_%H%M%S')}.json").write_text(json.dumps(
        {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
