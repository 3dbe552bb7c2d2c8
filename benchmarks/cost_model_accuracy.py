"""How good are the cost model's predictions? Per node and whole graph, on zoo models.

    python benchmarks/cost_model_accuracy.py [--models resnet50@64,bert-base@64] [--out DIR]
                                             [--profile h200-calibrated.json] [--device cuda] [--dtype bf16]

A model is ``NAME``, ``NAME@BATCH`` or ``NAME@BATCHxSEQ`` (zoo names). Defaults: on CUDA the
issue's set at modest sizes in bf16 (resnet50@64, bert-base@64, vit_b_16@64, glm4-9b-4l@1x1024);
on the CPU small models in fp32 (mlp, bert-tiny, vit-tiny, glm4-tiny).

Each model is built as ``graphopt bench`` builds it (converted to the dtype, channels_last for
CNNs in bf16/fp16), optimized with ``graphopt.optimize(..., check_accuracy=False)`` planning with
``--profile`` (default: the device's), and the optimized graph is measured with
``graphopt.measure.accuracy_table``: every node timed alone (median of --reps runs), Spearman
rank correlation of predicted vs measured over the nodes with a nonzero predicted cost, and the
whole graph predicted vs measured (timed as one call). The GPU busy fraction (kernel time / wall
time, torch.profiler) is given for the eager model ("before") and the optimized module
("after", CUDA graphs where graphopt uses them); "n/a" on the CPU.

Writes ``cost_model_accuracy_<date>_<device>.json`` and ``.md`` under --out (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

GPU_DEFAULT = ["resnet50@64", "bert-base@64", "vit_b_16@64", "glm4-9b-4l@1x1024"]
CPU_DEFAULT = ["mlp", "bert-tiny", "vit-tiny", "glm4-tiny"]


def parse_model(text: str) -> tuple[str, int | None, int | None]:
    name, _, size = text.partition("@")
    batch = seq = None
    if size:
        m = re.fullmatch(r"(\d+)(?:x(\d+))?", size)
        if not m:
            raise SystemExit(f"cost_model_accuracy: bad model '{text}'; use NAME, NAME@BATCH or NAME@BATCHxSEQ")
        batch = int(m.group(1))
        seq = int(m.group(2)) if m.group(2) else None
    return name, batch, seq


def run_one(spec: str, *, device, dtype, profile, reps: int) -> dict:
    from graphopt.api import optimize
    from graphopt.bench import _load
    from graphopt.cost.model import CostModel
    from graphopt.measure import accuracy_table, busy_fraction

    name, batch, seq = parse_model(spec)
    row: dict = {"model": name, "batch": batch, "seq_len": seq}
    t0 = time.perf_counter()
    model, args, kwargs, name, channels_last = _load(name, batch, seq, dtype, device)
    row["channels_last"] = channels_last
    try:
        opt = optimize(model, (args, kwargs), target=profile, check_accuracy=False, model_name=name)
        row["optimize_s"] = time.perf_counter() - t0
        table = accuracy_table(opt.graph_module, (args, kwargs), CostModel(opt_profile(opt, profile)), reps=reps,
                               device=device)
        row.update({k: table[k] for k in ("nodes_total", "nodes_costed", "spearman", "predicted_ms", "measured_ms",
                                          "node_sum_ms", "error_pct", "profile")})
        row["predicted_ms_before"] = opt.report.predicted_s_before * 1e3
        row["cuda_graph"] = next((n for n in opt.report.notes if n.startswith("CUDA graph")), None)
        bb = busy_fraction(lambda: model(*args, **kwargs), device)
        ba = busy_fraction(lambda: opt(*args, **kwargs), device)
        row["busy_before"], row["busy_after"] = bb.get("busy"), ba.get("busy")
        row["busy_detail"] = {"before": bb, "after": ba}
        row["worst_nodes"] = sorted(table["nodes"], key=lambda r: -abs(r["measured_ms"] - r["predicted_ms"]))[:10]
        row["nodes"] = table["nodes"]
    finally:
        opt = table = None  # noqa: F841 - free the model's memory before the next one
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["seconds"] = time.perf_counter() - t0
    return row


def opt_profile(opt, profile):
    from graphopt.cost.profiles import get_profile

    return get_profile(profile if profile is not None else opt.report.target)[0]


def _f(v, fmt="{:.3f}"):
    return "—" if v is None else fmt.format(v)


def _busy(v, device):
    if v is None:
        return "n/a on CPU" if device.type == "cpu" else "n/a"
    return f"{v:.0%}"


def to_markdown(header: dict, rows: list[dict], device) -> str:
    lines = [f"# Cost-model accuracy — {header['device_name']}, {header['date']}", "",
             f"torch {header['versions']['torch']}, dtype {header['dtype']}, cost profile `{header['profile']}`, "
             f"timing: {header['timing']}, per-node median of {header['reps']} runs.", "",
             "Spearman: rank correlation of predicted vs measured time over the optimized graph's nodes with a "
             "nonzero predicted cost. Whole graph: predicted vs one timed call of the graph (not the sum of its "
             "nodes); error = (predicted − measured) / measured. Busy: GPU kernel time / wall time, eager model "
             "(before) and optimized module (after).", "",
             "| model | batch | seq | nodes (costed) | Spearman | predicted ms | measured ms | error % | node sum ms "
             "| busy before | busy after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {_f(r.get('batch'), '{}')} | {_f(r.get('seq_len'), '{}')} | error: "
                         f"{r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {_f(r.get('batch'), '{}')} | {_f(r.get('seq_len'), '{}')} | "
                     f"{r['nodes_total']} ({r['nodes_costed']}) | {_f(r['spearman'], '{:.2f}')} | "
                     f"{_f(r['predicted_ms'])} | {_f(r['measured_ms'])} | {_f(r['error_pct'], '{:+.0f}')} | "
                     f"{_f(r['node_sum_ms'])} | {_busy(r['busy_before'], device)} | {_busy(r['busy_after'], device)} |")
    lines += ["", f"Command: `{header['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", help="comma-separated NAME[@BATCH[xSEQ]] (default: see the module docstring)")
    ap.add_argument("--out", default=str(Path("benchmarks") / "results"), help="output directory")
    ap.add_argument("--profile", help="cost profile to predict with (h200, a100, cpu or a .json from graphopt calibrate)")
    ap.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if present)")
    ap.add_argument("--dtype", help="bf16 / fp16 / fp32 (default bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--reps", type=int, default=5, help="node-by-node runs per model (median)")
    a = ap.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from graphopt.bench import environment, parse_dtype

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("cost_model_accuracy: CUDA is not available here", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = parse_dtype(a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    models = [m.strip() for m in a.models.split(",")] if a.models else (GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT)
    for m in models:
        parse_model(m)
    header = environment(device)
    header.update(dtype={torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype)),
                  profile=a.profile or "the device's", reps=a.reps,
                  timing="CUDA events, device synchronized around each node" if device.type == "cuda" else "perf_counter",
                  command=" ".join(["python", "benchmarks/cost_model_accuracy.py"] + (argv if argv is not None else sys.argv[1:])))
    out = Path(a.out)
    stem = "cost_model_accuracy_" + _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S") + f"_{device.type}"
    rows: list[dict] = []
    console = Console() if Console().is_terminal else Console(width=160)

    def save():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps({"header": header, "results": rows}, indent=1, default=str))
        (out / f"{stem}.md").write_text(to_markdown(header, rows, device))

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, auto_refresh=False) as prog:
        # no refresh thread: it would compete for the GIL with the timed calls
        task = prog.add_task("cost-model accuracy", total=len(models))
        for spec in models:
            prog.update(task, description=f"{spec}: optimize + measure", refresh=True)
            try:
                row = run_one(spec, device=device, dtype=dtype, profile=a.profile, reps=a.reps)
            except Exception as e:  # noqa: BLE001 - one failing model is a row
                name, batch, seq = parse_model(spec)
                row = {"model": name, "batch": batch, "seq_len": seq,
                       "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"}
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            prog.console.print(f"  {spec}: " + (row["error"] if row.get("error") else
                               f"Spearman {_f(row['spearman'], '{:.2f}')}, predicted {row['predicted_ms']:.3f} ms, "
                               f"measured {row['measured_ms']:.3f} ms ({_f(row['error_pct'], '{:+.0f}')}%), busy "
                               f"{_busy(row['busy_before'], device)} → {_busy(row['busy_after'], device)}"),
                               highlight=False)
            save()
            prog.advance(task)
            prog.refresh()
    save()
    console.print(to_markdown(header, rows, device))
    console.print(f"wrote {out / stem}.json and .md")
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
