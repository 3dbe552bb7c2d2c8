# Answered: What does one pass gain on the device on whole models it was not written for: graphopt with it and with it disabled, timed in alternating rounds in one process, beside the cost model's predicted difference (results/diag_pass_ab_<date>.md).
"""graphopt with and without one pass on sweep configs, A/B in one process.

    python benchmarks/diag/diag_pass_ab.py CONFIG:BATCH:PASS[,CONFIG:BATCH:PASS...] --out DIR [--rounds 5] [--reps 20]
        [--device cpu]

Each config (a perf-sweep name: timm-<name>, a torchvision model, hf-<type>) is built with
random weights in bf16 on cuda:0 (fp32 with ``--device cpu``) and optimized twice with the
default options: as shipped, and with ``disable=[PASS]``. The two are then timed in alternating
rounds (median of ``reps`` calls each round: CUDA events, or the wall clock on the CPU), so a
drift of the machine lands on both; the table gives the median of the rounds, the ratio, the
rewrites the pass made and both predicted times.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _timing import table_lines, write_rows  # noqa: E402


def _to(x, dev):
    if torch.is_tensor(x):
        return x.to(dev, torch.bfloat16) if x.is_floating_point() and dev == "cuda" else x.to(dev)
    return x


def one(name: str, batch: int, pass_name: str, rounds: int, reps: int, dev: str = "cuda") -> dict:
    import graphopt
    from graphopt.tools import perf_sweep
    from graphopt.tools.bench import time_call

    model, inputs = perf_sweep.build(name, batch)
    model = model.to("cuda", torch.bfloat16).eval() if dev == "cuda" else model.eval()
    _to_dev = lambda v: _to(v, dev)  # noqa: E731
    if isinstance(inputs, dict):
        inputs = {k: _to_dev(v) for k, v in inputs.items()}
        call = lambda o: o(**inputs)  # noqa: E731
    else:
        inputs = tuple(_to_dev(v) for v in inputs)
        call = lambda o: o(*inputs)  # noqa: E731
    row = {"config": f"{name}:{batch}", "pass": pass_name}
    opts = {"with": graphopt.optimize(model, inputs), "without": graphopt.optimize(model, inputs, disable=[pass_name])}
    rep = opts["with"].report
    res = next((p for p in rep.passes if p.name == pass_name), None)
    row["status"] = res.status if res is not None else "not run"
    row["rewrites"] = len(res.rewrites) if res is not None else 0
    for k, o in opts.items():
        row[f"pred_{k}_ms"] = o.report.predicted_s_after * 1e3
    times = {k: [] for k in opts}
    with torch.inference_mode():
        for _ in range(rounds):
            for k, o in opts.items():
                times[k].append(statistics.median(time_call(lambda: call(o), reps=reps, warmup=3, device=dev)) * 1e3)
    for k in opts:
        row[f"{k}_ms"] = statistics.median(times[k])
        row[f"{k}_rounds"] = times[k]
    row["ratio"] = row["without_ms"] / row["with_ms"]
    row["pred_ratio"] = row["pred_without_ms"] / row["pred_with_ms"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", help="CONFIG:BATCH:PASS, comma-separated")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    rows = []
    for spec in a.configs.split(","):
        name, batch, pass_name = spec.rsplit(":", 2)
        try:
            row = one(name, int(batch), pass_name, a.rounds, a.reps, a.device)
        except Exception as e:  # noqa: BLE001 - a diagnostic keeps the other configs
            row = {"config": f"{name}:{batch}", "pass": pass_name,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        rows.append(row)
        print({k: v for k, v in row.items() if not k.endswith("_rounds")}, flush=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    f = lambda k, fmt="{:.3f}": (lambda r: fmt.format(r[k]))  # noqa: E731
    cols = [("config", f("config", "{}"), False), ("pass", f("pass", "{}"), False), ("status", f("status", "{}"), False),
            ("rewrites", f("rewrites", "{}"), True), ("with ms", f("with_ms"), True), ("without ms", f("without_ms"), True),
            ("without / with", f("ratio", "{:.3f}×"), True), ("predicted with", f("pred_with_ms"), True),
            ("predicted without", f("pred_without_ms"), True), ("predicted ratio", f("pred_ratio", "{:.3f}×"), True)]
    if a.device == "cuda":
        where = f"{torch.cuda.get_device_properties(0).name}, torch {torch.__version__}, bf16"
        how = "CUDA events"
    else:
        import platform

        where = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}, fp32"
        how = "wall clock"
    head = (f"{where}; median of {a.rounds} alternating rounds, each the median of {a.reps} calls ({how}); both "
            "variants optimize() with the default options (measured guard on).")
    write_rows(a.out, f"diag_pass_ab{'_cpu' if a.device == 'cpu' else ''}", rows, table_lines("# One pass on and off, whole models", head, cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
