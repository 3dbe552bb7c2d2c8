"""How good are the cost model's predictions? Per node and whole call, on zoo models.

    python benchmarks/cost_model_accuracy.py [--models resnet50@64,bert-base@64] [--out DIR]
                                             [--profile h200-calibrated.json] [--device cuda] [--dtype bf16]
                                             [--reps 5] [--inner 10] [--no-host-calibration] [--tiny]

A model is ``NAME``, ``NAME@BATCH`` or ``NAME@BATCHxSEQ`` (zoo names). Defaults: on CUDA the
issue's set at modest sizes in bf16 (resnet50@64, bert-base@64, vit_b_16@64, glm4-9b-4l@1x1024);
on the CPU small models in fp32 (mlp, bert-tiny, vit-tiny, glm4-tiny). ``--tiny``: bert-tiny and
mlp, one node-by-node run (a dry run of the whole script on the CPU in seconds).

Each model is built as ``graphopt bench`` builds it (converted to the dtype, channels_last for
CNNs in bf16/fp16) and optimized with ``graphopt.optimize(..., check_accuracy=False)`` planning
with ``--profile`` (default: the device's). Predictions use that profile, with the host costs
(``host_node_s``, the per-launch host time ``launch_overhead_s`` and the per-op host times
``host_op_s``) measured on this device at the start of the run (``graphopt.tools.calibrate.host_costs``
and ``host_op_costs``, about a second) unless the profile has them already or
``--no-host-calibration``. Three measurements per model:

* **module**: the module as ``optimize()`` returns it (CUDA graph replay when it planned one),
  timed as one call (median), against ``CostModel.execution_cost`` in the same execution mode
  ("graphed": inputs copied in, one replay, outputs cloned; or "eager").
* **eager graph**: the optimized GraphModule run eagerly, against the eager host/device queue.
* **per node** (``graphopt.tools.measure.accuracy_table``): each node's op called ``--inner`` times back
  to back between two CUDA events (no synchronization inside, nothing subtracted), against
  ``CostModel.node_loop_s`` (the longer of the node's host and device time). Spearman over the
  nodes with a nonzero predicted time ("costed", views included: they cost host time) and over
  the nodes measured above 3x the launch overhead ("heavy": their device time shows above the
  launch floor).

The GPU busy fraction (kernel time / wall time, torch.profiler) is given for the eager model
("before") and the optimized module ("after"), beside the queue model's prediction; "n/a" on
the CPU. Writes ``cost_model_accuracy_<date>_<device>.json`` and ``.md`` under --out (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

GPU_DEFAULT = ["resnet50@64", "bert-base@64", "vit_b_16@64", "glm4-9b-4l@1x1024"]
CPU_DEFAULT = ["mlp", "bert-tiny", "vit-tiny", "glm4-tiny"]
TINY = ["mlp", "bert-tiny"]


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


def prediction_profile(profile_arg, device, dtype, calibrate_host: bool):
    """The profile predictions use: --profile (or the device's), with this device's host costs
    measured now when asked and missing from it. Returns (profile, note)."""
    from graphopt.tools.calibrate import host_costs, host_op_costs
    from graphopt.cost.profiles import get_profile

    profile, _ = get_profile(profile_arg if profile_arg is not None else device)
    if not calibrate_host:
        return profile, "host costs as in the profile"
    if profile.host_op_s:
        return profile, "host costs from the profile (it was calibrated with them)"
    if profile.kind != "cuda" or device.type != "cuda":
        return profile, f"host costs as in the {profile.name} profile (the host/device queue is calibrated on a GPU)"
    node_s, launch_s = host_costs(device)
    ops = host_op_costs(device, dtype)
    profile = dataclasses.replace(profile, host_node_s=node_s, launch_overhead_s=launch_s, host_op_s=ops,
                                  source={**profile.source, "host": "measured at the start of this benchmark run"})
    return profile, (f"host costs measured on {device} at the start of this run: {node_s * 1e6:.2f} us per view "
                     f"node, {launch_s * 1e6:.2f} us per kernel launch, per-op host times for {len(ops)} ops")


def run_one(spec: str, *, device, dtype, profile_arg, pred_profile, reps: int, inner: int) -> dict:
    from graphopt.api import optimize
    from graphopt.tools.bench import prepare_model
    from graphopt.cost.model import CostModel
    from graphopt.tools.measure import accuracy_table, busy_fraction, measure_call, module_execution

    name, batch, seq = parse_model(spec)
    row: dict = {"model": name, "batch": batch, "seq_len": seq}
    t0 = time.perf_counter()
    model, args, kwargs, name, channels_last = prepare_model(name, batch, seq, dtype, device)
    row["channels_last"] = channels_last
    opt = table = None
    try:
        opt = optimize(model, (args, kwargs), target=profile_arg, check_accuracy=False, model_name=name)
        row["optimize_s"] = time.perf_counter() - t0
        gm = opt.graph_module
        cost = CostModel(pred_profile)
        mode = module_execution(opt)
        row["execution"] = mode
        row["cuda_graph"] = next((n for n in opt.report.notes if n.startswith("CUDA graph")), None)
        print(f"  {spec}: optimized in {row['optimize_s']:.1f} s, module runs {mode}; timing nodes", flush=True)
        table = accuracy_table(gm, (args, kwargs), cost, reps=reps, inner=inner, device=device, execution="eager")
        for k in ("nodes_total", "nodes_costed", "nodes_heavy", "heavy_threshold_ms", "spearman", "spearman_heavy",
                  "spearman_kernels", "spearman_device", "nodes_device", "predicted_host_ms", "predicted_device_ms", "predicted_busy",
                  "predicted_node_sum_ms", "node_sum_ms", "measured_host_node_us", "measured_host_launch_us"):
            row[k] = table[k]
        row["eager_graph"] = {"predicted_ms": table["predicted_ms"], "measured_ms": table["measured_ms"],
                              "error_pct": table["error_pct"]}
        ex = cost.execution_cost(gm, mode="graphed" if mode != "eager" else "eager",
                                 reuse_outputs=mode == "graphed_reuse_outputs")
        with torch.inference_mode():
            measured = measure_call(lambda: opt(*args, **kwargs), device, reps=20, warmup=3)
        row["module"] = {"execution": mode, "predicted_ms": ex.total_s * 1e3, "measured_ms": measured * 1e3,
                         "error_pct": (ex.total_s - measured) / measured * 100 if measured > 0 else None,
                         "predicted_host_ms": ex.host_s * 1e3, "predicted_device_ms": ex.device_s * 1e3,
                         "predicted_busy": ex.busy}
        print(f"  {spec}: measuring the GPU busy fraction", flush=True)
        bb = busy_fraction(lambda: model(*args, **kwargs), device)
        ba = busy_fraction(lambda: opt(*args, **kwargs), device)
        bg = busy_fraction(lambda: gm(*args, **kwargs), device)
        row["busy_before"], row["busy_after"], row["busy_eager_graph"] = bb.get("busy"), ba.get("busy"), bg.get("busy")
        row["busy_detail"] = {"before": bb, "after": ba, "eager_graph": bg}
        row["by_op"] = by_op(table["nodes"])
        row["worst_nodes"] = sorted(table["nodes"], key=lambda r: -abs(r["measured_ms"] - r["predicted_ms"]))[:10]
        row["nodes"] = table["nodes"]
    finally:
        del model, args, kwargs
        opt = table = None  # noqa: F841 - free the model's memory before the next one
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    row["seconds"] = time.perf_counter() - t0
    return row


def by_op(nodes: list[dict]) -> list[dict]:
    """Per op: node count, predicted and measured time summed, and the median host time per node
    measured vs predicted (what a host-cost calibration would move)."""
    groups: dict[str, list[dict]] = {}
    for r in nodes:
        groups.setdefault(r["op"], []).append(r)
    out = []
    for op, rs in groups.items():
        out.append({"op": op, "nodes": len(rs), "predicted_ms": sum(r["predicted_ms"] for r in rs),
                    "measured_ms": sum(r["measured_ms"] for r in rs),
                    "predicted_host_us": statistics.median(r["predicted_host_ms"] for r in rs) * 1e3,
                    "measured_host_us": statistics.median(r["measured_host_ms"] for r in rs) * 1e3,
                    "predicted_device_us": statistics.median(r["predicted_device_ms"] for r in rs) * 1e3})
    return sorted(out, key=lambda r: -r["measured_ms"])


def _f(v, fmt="{:.3f}"):
    return "—" if v is None else fmt.format(v)


def _busy(v, device):
    if v is None:
        return "n/a on CPU" if device.type == "cpu" else "n/a"
    return f"{v:.0%}"


def to_markdown(header: dict, rows: list[dict], device) -> str:
    lines = [f"# Cost-model accuracy — {header['device_name']}, {header['date']}", "",
             f"torch {header['versions']['torch']}, dtype {header['dtype']}, cost profile `{header['profile']}`; "
             f"{header['host_note']}.", "",
             "**Whole call.** *module*: the module as `optimize()` returns it (CUDA graph replay when planned), one "
             "call timed (median of 20), against `CostModel.execution_cost` in the same mode. *eager graph*: the "
             "optimized graph run eagerly, against the host/device queue model. error = (predicted − measured) / "
             "measured.", "",
             "| model | batch | seq | module runs | module predicted ms | measured ms | error % | eager graph predicted "
             "ms | measured ms | error % | busy predicted (eager graph) | busy measured (eager graph) | busy before "
             "→ after |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    ok = [r for r in rows if not r.get("error")]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {_f(r.get('batch'), '{}')} | {_f(r.get('seq_len'), '{}')} | error: "
                         f"{r['error']} | | | | | | | | | |")
            continue
        m, e = r["module"], r["eager_graph"]
        lines.append(f"| {r['model']} | {_f(r.get('batch'), '{}')} | {_f(r.get('seq_len'), '{}')} | {m['execution']} | "
                     f"{_f(m['predicted_ms'])} | {_f(m['measured_ms'])} | {_f(m['error_pct'], '{:+.0f}')} | "
                     f"{_f(e['predicted_ms'])} | {_f(e['measured_ms'])} | {_f(e['error_pct'], '{:+.0f}')} | "
                     f"{_busy(r['predicted_busy'], device)} | {_busy(r['busy_eager_graph'], device)} | "
                     f"{_busy(r['busy_before'], device)} → {_busy(r['busy_after'], device)} |")
    lines += ["", f"**Per node** ({header['timing']}, median of {header['reps']} runs): predicted = the longer of the "
              "node's host and device time (`CostModel.node_loop_s`; their sum on the CPU). *costed*: every node with a "
              "nonzero predicted time (views cost host time); *heavy*: the nodes measured above 3 × the launch overhead; "
              "*kernels*: the nodes that launch a kernel. *device*: each kernel node's loop timed again queued behind a GPU "
              "sleep (the host has issued every call first, so the events time the device work alone) against the "
              "predicted device time. Host µs: the host's issue time per node measured in the graph "
              "(median over views / per kernel launch) beside the profile's.", "",
              "| model | nodes | costed | Spearman costed | heavy (> ms) | Spearman heavy | Spearman kernels | "
              "Spearman device (nodes) | node sum measured ms | host µs per view: measured / profile | "
              "per launch: measured / profile |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ok:
        lines.append(f"| {r['model']} | {r['nodes_total']} | {r['nodes_costed']} | {_f(r['spearman'], '{:.2f}')} | "
                     f"{r['nodes_heavy']} (> {r['heavy_threshold_ms']:.3f}) | {_f(r['spearman_heavy'], '{:.2f}')} | "
                     f"{_f(r['spearman_kernels'], '{:.2f}')} | {_f(r.get('spearman_device'), '{:.2f}')} "
                     f"({r.get('nodes_device', 0)}) | {_f(r['node_sum_ms'])} | "
                     f"{_f(r['measured_host_node_us'], '{:.2f}')} / {header['host_node_us']:.2f} | "
                     f"{_f(r['measured_host_launch_us'], '{:.2f}')} / {header['launch_us']:.2f} |")
    for r in ok:
        lines += ["", f"<details><summary>{r['model']}: per op (top 12 by measured time)</summary>", "",
                  "| op | nodes | predicted ms | measured ms | host µs measured / predicted | device µs predicted |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for o in r["by_op"][:12]:
            lines.append(f"| {o['op']} | {o['nodes']} | {o['predicted_ms']:.3f} | {o['measured_ms']:.3f} | "
                         f"{o['measured_host_us']:.2f} / {o['predicted_host_us']:.2f} | {o['predicted_device_us']:.2f} |")
        lines += ["", "</details>"]
    lines += ["", f"Command: `{header['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", help="comma-separated NAME[@BATCH[xSEQ]] (default: see the module docstring)")
    ap.add_argument("--out", default=str(Path("benchmarks") / "results"), help="output directory")
    ap.add_argument("--profile", help="cost profile to plan and predict with (h200, a100, cpu or a .json from "
                                      "graphopt calibrate)")
    ap.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if present)")
    ap.add_argument("--dtype", help="bf16 / fp16 / fp32 (default bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--reps", type=int, default=5, help="node-by-node runs per model (median)")
    ap.add_argument("--inner", type=int, default=10, help="back-to-back calls of each node per timing (GPU)")
    ap.add_argument("--no-host-calibration", action="store_true",
                    help="predict with the profile's host costs as they are (default: measure them here first)")
    ap.add_argument("--tiny", action="store_true", help="a dry run: mlp and bert-tiny, one node-by-node run")
    a = ap.parse_args(argv)

    from graphopt.tools.bench import environment, parse_dtype

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("cost_model_accuracy: CUDA is not available here", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = parse_dtype(a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if a.tiny:
        models, reps = (a.models.split(",") if a.models else TINY), 1
    else:
        models = [m.strip() for m in a.models.split(",")] if a.models else (GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT)
        reps = a.reps
    for m in models:
        parse_model(m)
    t_start = time.perf_counter()
    print(f"cost_model_accuracy: {len(models)} model(s) on {device}, {dtype}; calibrating host costs", flush=True)
    pred_profile, host_note = prediction_profile(a.profile, device, dtype, not a.no_host_calibration)
    print(f"  {host_note}", flush=True)
    header = environment(device)
    header.update(dtype={torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype)),
                  profile=a.profile or "the device's", reps=reps, inner=a.inner, host_note=host_note,
                  host_node_us=pred_profile.host_node_s * 1e6, launch_us=pred_profile.launch_overhead_s * 1e6,
                  host_op_us={k: v * 1e6 for k, v in pred_profile.host_op_s.items()},
                  timing=(f"CUDA events around {a.inner} back-to-back calls of each node" if device.type == "cuda"
                          else "perf_counter, one call of each node"),
                  command=" ".join(["python", "benchmarks/cost_model_accuracy.py"] + (argv if argv is not None else sys.argv[1:])))
    out = Path(a.out)
    stem = "cost_model_accuracy_" + _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S") + f"_{device.type}"
    rows: list[dict] = []

    def save():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps({"header": header, "results": rows}, indent=1, default=str))
        (out / f"{stem}.md").write_text(to_markdown(header, rows, device))

    for i, spec in enumerate(models, 1):
        print(f"[{i}/{len(models)}] {spec}: build + optimize ({time.perf_counter() - t_start:.0f} s elapsed)", flush=True)
        try:
            row = run_one(spec, device=device, dtype=dtype, profile_arg=a.profile, pred_profile=pred_profile,
                          reps=reps, inner=a.inner)
        except Exception as e:  # noqa: BLE001 - one failing model is a row
            name, batch, seq = parse_model(spec)
            row = {"model": name, "batch": batch, "seq_len": seq,
                   "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if row.get("error"):
            print(f"  {spec}: {row['error']}", flush=True)
        else:
            m, e = row["module"], row["eager_graph"]
            print(f"  {spec}: module ({m['execution']}) predicted {m['predicted_ms']:.3f} ms, measured "
                  f"{m['measured_ms']:.3f} ms ({_f(m['error_pct'], '{:+.0f}')}%); eager graph predicted "
                  f"{e['predicted_ms']:.3f}, measured {e['measured_ms']:.3f} ({_f(e['error_pct'], '{:+.0f}')}%); "
                  f"Spearman costed {_f(row['spearman'], '{:.2f}')}, heavy {_f(row['spearman_heavy'], '{:.2f}')}, "
                  f"device {_f(row.get('spearman_device'), '{:.2f}')}; "
                  f"{row['seconds']:.0f} s", flush=True)
        save()
    save()
    print(to_markdown(header, rows, device))
    print(f"wrote {out / stem}.json and .md ({time.perf_counter() - t_start:.0f} s)")
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
