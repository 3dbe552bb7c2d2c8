# Answered: where DPN-68 bs64's host set-up time goes on the CPU planned for the H200 (2026-12-06, check_accuracy off): capture 1.72 s, fake propagation 1.39 s (7 incremental re-propagations re-running 732 nodes: the convolutions and fused ops downstream of each change), passes 0.71 s, cost model 0.52 s; with the accuracy check on, the CPU's bf16 eager and fp64 runs take 113 s of 115.
"""optimize()'s host time by phase for one sweep config planned for a GPU profile, on the CPU (the second
call of the process; the first pays first-use costs). Answered: which host phases a sweep row's set-up time
goes to, without the measured guard (the model runs on the CPU), and an A/B of a change between checkouts.

    PYTHONPATH=$PWD python benchmarks/diag/diag_setup_phases.py timm-dpn68 64 [--target h200] [--no-accuracy] [--cprofile N]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt.tools import perf_sweep  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("batch", type=int)
    p.add_argument("--target", default="h200")
    p.add_argument("--no-accuracy", action="store_true", help="skip the accuracy check (slow on the CPU)")
    p.add_argument("--cprofile", type=int, default=0, help="print the N functions with most cumulative time")
    a = p.parse_args(argv)
    model, inputs = perf_sweep.build(a.config, a.batch)
    model = model.to(torch.bfloat16)
    cv = lambda x: x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
    inputs = {k: cv(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(cv(x) for x in inputs)
    kw = {"check_accuracy": False} if a.no_accuracy else {}
    graphopt.optimize(model, inputs, target=a.target, **kw)  # first use
    prof = cProfile.Profile() if a.cprofile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    opt = graphopt.optimize(model, inputs, target=a.target, **kw)
    if prof:
        prof.disable()
    print(f"total {time.perf_counter() - t0:.2f} s")
    for k, v in sorted(opt.report.optimize_phases.items(), key=lambda x: -x[1]):
        print(f"  {k:40s} {v:.2f}")
    print("applied", [r.name for r in opt.report.passes if r.status == "applied"])
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
