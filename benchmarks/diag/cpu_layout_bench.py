# Answered: Does channels_last pay on the CPU when the cost model picks it? ResNet-50 418 against 508 ms eager, MobileNetV3 40 against 85; ConvNeXt-T 2% behind without it (results/archive/cpu_layout_2026-11-29.md).
"""Issue 6 on the CPU: channels_last where oneDNN is faster, chosen by the cost model.

    python benchmarks/diag/cpu_layout_bench.py [--models resnet50,mobilenet_v3_large,convnext_tiny] [--batch 8] [--out DIR]

fp32 on this machine's CPU, median of --reps forwards (perf_counter, no_grad): the eager model
(NCHW), the eager model hand-converted to channels_last, graphopt (whole pipeline; its CPU
profile measures oneDNN's NCHW slowdown at first use), and graphopt without
convert_channels_last. Every graphopt row passed its fp64 accuracy guard (reported).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt.tools.bench import environment  # noqa: E402
from graphopt.cost.profiles import cpu_profile  # noqa: E402
from graphopt.examples import zoo  # noqa: E402


def timed(f, args, reps):
    with torch.no_grad():
        f(*args)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f(*args)
            ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v3_large,convnext_tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    env = environment(torch.device("cpu"))
    prof = cpu_profile()
    rows = []
    for name in a.models.split(","):
        m, i = zoo.get(name, batch=a.batch)
        mcl = copy.deepcopy(m).to(memory_format=torch.channels_last)
        icl = tuple(x.to(memory_format=torch.channels_last) for x in i)
        opt = graphopt.optimize(m, i, model_name=name)
        nocl = graphopt.optimize(m, i, disable=["convert_channels_last"], model_name=name)
        p = opt.report.pass_result("convert_channels_last")
        r = {"model": name, "batch": a.batch, "eager_ms": timed(m, i, a.reps), "eager_cl_ms": timed(mcl, icl, a.reps),
             "graphopt_ms": timed(opt, i, a.reps), "graphopt_no_cl_ms": timed(nocl, i, a.reps),
             "channels_last": p.status, "why": (p.notes or [r.reason for r in p.rejected] or [""])[0],
             "accuracy": opt.report.accuracy.get("passed"), "optimize_s": opt.report.optimize_seconds}
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_layout_{env['date'][:10]}"
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "cpu_conv_nchw_slowdown": prof.conv_nchw_slowdown,
                                                     "rows": rows}, indent=1))
    lines = [f"# channels_last on the CPU, {env['date']}, {env['device_name']}", "",
             f"torch {env['versions']['torch']}, fp32, batch {a.batch}, median of {a.reps} forwards. The CPU profile "
             f"measured oneDNN's NCHW convolutions {prof.conv_nchw_slowdown:.2f}× slower than channels_last "
             "(ResNet-shaped convs at batch 2).", "",
             "| model | eager NCHW ms | eager channels_last ms | graphopt ms | graphopt without convert_channels_last ms | × eager | convert_channels_last | accuracy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['eager_ms']:.0f} | {r['eager_cl_ms']:.0f} | {r['graphopt_ms']:.0f} | "
                     f"{r['graphopt_no_cl_ms']:.0f} | {r['eager_ms'] / r['graphopt_ms']:.2f} | {r['channels_last']}: {r['why'][:90]} | "
                     f"{'passed' if r['accuracy'] else r['accuracy']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
