# Answered: Does the candidate timer (graphopt.runtime.candidates) build and run the old and new subgraphs of every lowering candidate on real models, or fall back to the cost model (None) for some? Run on the CPU with the H200's plan (graphopt's ops run their reference implementations: the times decide nothing here). (results/diag_candidate_timer_cpu_<date>.md)
"""Every lowering candidate of the given sweep configs, timed by CandidateTimer on the CPU.

    PYTHONPATH=$PWD python benchmarks/diag/diag_candidate_timer_cpu.py timm-convmixer_768_32:2 resnet50:2 ...
"""
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt import ir  # noqa: E402
from graphopt.cost.model import CostModel  # noqa: E402
from graphopt.cost.profiles import get_profile  # noqa: E402
from graphopt.pipeline import PassContext, PassManager, assemble  # noqa: E402
from graphopt.runtime import candidates  # noqa: E402
from graphopt.tools.perf_sweep import build  # noqa: E402


class Counting(candidates.CandidateTimer):
    """Records the candidates left to the cost model (the timer gave None)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.none = []

    def _time(self, nodes, r):
        out = super()._time(nodes, r)
        if out is None:
            self.none.append(nodes[0].name)
        return out


def main(argv=None):
    warnings.filterwarnings("ignore")
    print("| config | distinct candidates timed | left to the cost model | per pass: timed / applied / refused as slower |")
    print("| --- | ---: | ---: | --- |")
    for name in (argv or sys.argv[1:]):
        cfg, bs = name.split(":")
        model, inputs = build(cfg, int(bs))
        gm = graphopt.capture(model.eval(), inputs)
        timer = Counting("cpu", rounds=1, most_reps=1)
        ctx = PassContext(cost=CostModel(get_profile("h200")[0]), hints=ir.shape_hints(gm), candidate_timer=timer)
        results = PassManager(assemble(None)).run(gm, ctx)
        per = ", ".join(f"{r.name} {len(r.details['timed_candidates'])} / {len(r.rewrites)} / "
                        f"{sum(t['refused'] for t in r.details['timed_candidates'])}"
                        for r in results if r.details.get("timed_candidates"))
        print(f"| {name} | {timer.timed} | {len(timer.none)} {timer.none[:3] or ''} | {per} |", flush=True)


if __name__ == "__main__":
    main()
