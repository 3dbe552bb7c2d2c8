"""Host time of one call of an optimized module on the CPU against the model as given, on models small
enough that the per-call work around the graph shows (a 2-layer MLP, bert-tiny, a 1-layer GLM-4-tiny).
Answered: what export's per-call checks (its forward hooks and ``_guards_fn``, dropped on static graphs)
cost a call; run in two checkouts for an A/B. One thread, medians of 2000 calls, measure=False (so the
optimized module is what runs).

    PYTHONPATH=$PWD python benchmarks/diag/diag_call_overhead.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt.examples import zoo  # noqa: E402


def per_call_us(fn, calls=2000, rounds=5):
    with torch.inference_mode():
        for _ in range(200):
            fn()
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls // rounds):
                fn()
            out.append((time.perf_counter() - t0) / (calls // rounds) * 1e6)
    return statistics.median(out)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = [("mlp-2", nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval(), (torch.randn(2, 16),))]
    for name in ("bert-tiny", "mlp"):
        model, inputs = zoo.get(name)
        cases.append((name, model.eval(), inputs if isinstance(inputs, tuple) else (inputs,)))
    print(f"torch {torch.__version__}, graphopt at {Path(graphopt.__file__).parent.parent}")
    print("| model | eager us | optimized us | graph nodes |")
    print("| --- | ---: | ---: | ---: |")
    for name, model, inputs in cases:
        args, kwargs = (inputs, {}) if not isinstance(inputs[0], dict) else ((), inputs[0])
        opt = graphopt.optimize(model, (args, kwargs) if kwargs else args, measure=False)
        eager = per_call_us(lambda: model(*args, **kwargs))
        ours = per_call_us(lambda: opt(*args, **kwargs))
        print(f"| {name} | {eager:.1f} | {ours:.1f} | {len(opt.graph_module.graph.nodes)} |")


if __name__ == "__main__":
    main()
