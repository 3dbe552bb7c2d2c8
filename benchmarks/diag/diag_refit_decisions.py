"""Which pass decisions change between two H200 profiles (the shipped one and a candidate corpus
fit): each sweep model optimized on meta with target= each profile, per pass its status and
rewrite count, and the predicted call time. Usage:
    python benchmarks/diag/diag_refit_decisions.py CANDIDATE.json MODEL:BATCH [...]"""

import json
import sys

import torch

import graphopt
from graphopt.tools.perf_sweep import build


def decisions(name: str, batch: int, target: str) -> dict:
    model, inputs = build(name, batch)
    model = model.to(device="meta", dtype=torch.bfloat16)
    cast = lambda x: x.to(device="meta", dtype=torch.bfloat16) if x.is_floating_point() else x.to("meta")  # noqa: E731
    inputs = {k: cast(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(cast, inputs))
    opt = graphopt.optimize(model, inputs, device="meta", target=target, check_accuracy=False)
    rep = opt.report
    return {"passes": {p.name: (p.status, len(p.rewrites)) for p in rep.passes},
            "predicted_ms": getattr(rep, "predicted_ms", None)}


if __name__ == "__main__":
    cand, models = sys.argv[1], sys.argv[2:]
    out = {}
    for m in models:
        name, batch = m.split(":")
        a, b = decisions(name, int(batch), "h200"), decisions(name, int(batch), cand)
        changed = {k: (a["passes"].get(k), b["passes"].get(k)) for k in set(a["passes"]) | set(b["passes"])
                   if a["passes"].get(k) != b["passes"].get(k)}
        out[m] = changed
        print(m, "changed:", changed or "none", flush=True)
    print(json.dumps(out))
