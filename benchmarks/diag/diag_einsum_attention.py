"""Does einsum / 5-D attention fuse (issue 27, MaxViT)? Per torchvision model: the captured graph's op
counts (einsum, matmul, softmax, SDPA), the same after eliminate_dead_code + fold_constants +
fuse_attention and after optimize(), fuse_attention's rewrites and refusals, and the accuracy rule
against fp64 for both. Needs torchvision; runs on the CPU (fp32) or a device.

    python benchmarks/diag/diag_einsum_attention.py --out DIR [--models maxvit_t,swin_t] [--batch 2]
        [--device cpu|cuda] [--dtype fp32|bf16] [--target h200]

Writes diag_einsum_attention_<date>_<device>.json under --out and prints one block per model. It
imports the graphopt it finds (PYTHONPATH picks the tree), so two trees can be compared.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
from pathlib import Path

import torch

KEYS = ("aten.einsum.default", "aten.matmul.default", "aten.softmax.int", "aten.scaled_dot_product_attention.default",
        "graphopt.short_attention.default", "aten.flatten.using_ints", "aten.unflatten.int", "aten.mul.Tensor")


def _counts(gm) -> dict:
    c = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return {"call_function": sum(c.values()), **{k: c[k] for k in KEYS if c[k]}}


def _check(model, fn, args):
    from graphopt import accuracy

    with torch.no_grad():
        eager, out = model(*args), fn(*args)
    res = accuracy.check(out, accuracy.fp64_reference(model, tuple(args), {}), eager)
    return {"passed": res.passed, "how": [leaf.how for leaf in res.leaves], "reason": res.reason}


def one(name, batch, device, dtype, target) -> dict:
    import torchvision

    import graphopt
    from graphopt import capture
    from graphopt.pipeline import run_passes

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval().to(device, dtype)
    x = torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)
    gm = capture(model, (x,))
    row = {"model": name, "batch": batch, "captured": _counts(gm), "capture_notes": gm.meta["graphopt_capture"].notes}
    run_passes(gm, ["eliminate_dead_code", "fold_constants"])
    (res,) = run_passes(gm, ["fuse_attention"], target=target)
    row["after_fuse_attention"] = _counts(gm)
    rewrites = dict(collections.Counter(r.pattern for r in res.rewrites))
    row["fuse_attention"] = {"status": res.status, "rewrites": rewrites,
                             "rejected": [f"{r.candidate}: {r.reason}" for r in res.rejected]}
    row["pass_accuracy"] = _check(model, gm, (x,))
    # fp32: the graph stays fp32 (the rule's fp32 tolerance applies); bf16: the model is bf16 already
    precision = "fp32" if dtype == torch.float32 else "auto"
    opt = graphopt.optimize(model, (x,), target=target, measure=False, precision=precision)
    row["optimized"] = _counts(opt.graph_module)
    row["optimize_guard_accuracy"] = opt.report.accuracy.get("passed")
    row["optimize_accuracy"] = _check(model, opt, (x,))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="maxvit_t,swin_t")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--target", default="h200")
    a = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    rows = [one(m, a.batch, a.device, dtype, a.target) for m in a.models.split(",")]
    import graphopt

    record = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "graphopt": str(Path(graphopt.__file__).resolve().parent), "device": a.device, "dtype": a.dtype,
              "target": a.target, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"diag_einsum_attention_{dt.datetime.now():%Y-%m-%d_%H%M%S}_{a.device}.json"
    path.write_text(json.dumps(record, indent=1))
    for r in rows:
        print(f"{r['model']} bs{r['batch']}: captured {r['captured']}")
        print(f"  after fuse_attention {r['after_fuse_attention']}; {r['fuse_attention']['status']} "
              f"{r['fuse_attention']['rewrites']}; pass accuracy {r['pass_accuracy']['passed']}")
        print(f"  optimized {r['optimized']}; accuracy {r['optimize_accuracy']['passed']} "
              f"(optimize's guard: {r['optimize_guard_accuracy']})")
    print(path)


if __name__ == "__main__":
    main()
