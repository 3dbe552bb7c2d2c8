"""How long graphopt.optimize() takes, per phase (issue 4's setup target: under 2 s per model).

    python benchmarks/optimize_time.py --out DIR                                 # bert-base bs64, glm4-9b-4l bs8, on the CPU
    python benchmarks/optimize_time.py --models bert-tiny:2:16 --reps 2 --out /tmp/x   # dry run
    python benchmarks/optimize_time.py --accuracy ...                            # with the fp64 accuracy guard

Each model is built as the model benchmark builds it (graphopt.tools.bench.prepare_model: bf16, eval) and
optimized ``--reps`` times in one process with ``target=--target`` (default h200: the GPU plan, on
any machine). The first call is reported apart ("cold": it pays torch.export's and graphopt's
first-use costs, as the first optimize() in a benchmark process does); the phases are those of the
fastest warm call (graphopt.timing: exclusive, summing to the total). The optimized graph's op
counts are recorded too, so two runs (before/after a change) can be checked for the same graph.
Writes optimize_time_<date>_<device>.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt.tools.bench import prepare_model, parse_dtype  # noqa: E402
from tests.test_same_plan import plan_record  # noqa: E402  (op counts, code and constants digests)

DEFAULT = "bert-base:64:128,glm4-9b-4l:8:1024"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_models(text: str) -> list[tuple[str, int | None, int | None]]:
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if not parts[0]:
            continue
        nums = [int(p) if p else None for p in parts[1:3]] + [None, None]
        out.append((parts[0], nums[0], nums[1]))
    return out


def run_model(spec, batch, seq, *, dtype, device, target, reps, accuracy, profile_to=None) -> dict:
    print(f"{spec} bs{batch} seq{seq}: building", flush=True)
    t0 = time.perf_counter()
    model, args, kwargs, name, _ = prepare_model(spec, batch, seq, dtype, torch.device(device))
    row = {"model": name, "batch": batch, "seq_len": seq, "build_s": time.perf_counter() - t0, "runs": []}
    for r in range(reps):
        gc.collect()
        prof = None
        if profile_to is not None and r == reps - 1:  # the last call under cProfile (wall times then inflate)
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        opt = graphopt.optimize(model, (args, kwargs), target=target, check_accuracy=accuracy, model_name=name)
        wall = time.perf_counter() - t0
        if prof is not None:
            import io
            import pstats

            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
            Path(profile_to).mkdir(parents=True, exist_ok=True)
            (Path(profile_to) / f"optimize_profile_{name}_bs{batch}.txt").write_text(buf.getvalue())
        rep = opt.report
        phases = dict(getattr(rep, "optimize_phases", {}) or {})
        row["runs"].append({"wall_s": wall, "optimize_s": rep.optimize_seconds, "phases": phases,
                            "passes": {p.name: p.seconds for p in rep.passes}})
        shown = ", ".join(f"{k} {v:.2f}" for k, v in list(phases.items())[:6])
        print(f"  run {r + 1}/{reps}: {wall:.2f} s ({shown})", flush=True)
        if r == reps - 1:
            row.update(plan_record(opt.graph_module))
            row["applied"] = [p.name for p in rep.passes if p.status == "applied"]
            row["accuracy"] = rep.accuracy.get("passed") if rep.accuracy.get("checked") else None
        del opt, rep
    warm = row["runs"][1:] or row["runs"]
    best = min(warm, key=lambda x: x["wall_s"])
    row["cold_s"] = row["runs"][0]["wall_s"]
    row["best_warm_s"] = best["wall_s"]
    row["best_warm_phases"] = best["phases"]
    row["best_warm_passes"] = best["passes"]
    del model, args, kwargs
    gc.collect()
    return row


def to_markdown(result: dict) -> str:
    h = result["header"]
    lines = [f"# optimize() time per phase — {h['date']}", "",
             f"{h['cpu']}, {h['threads']} threads, torch {h['torch']}, transformers {h['transformers']}, "
             f"commit {h['commit']}, target {h['target']}, {h['dtype']}, "
             f"accuracy guard {'on' if h['accuracy'] else 'off'}, {h['reps']} calls per model", ""]
    for row in result["rows"]:
        lines.append(f"## {row['model']} bs{row['batch']} seq{row['seq_len']}: cold {row['cold_s']:.2f} s, "
                     f"best warm {row['best_warm_s']:.2f} s")
        lines += ["", "| phase | s |", "| --- | ---: |"]
        for k, v in row["best_warm_phases"].items():
            lines.append(f"| {k} | {v:.3f} |")
        lines += ["", "passes (wall time each, verification and checks included): " + ", ".join(
            f"{k} {v:.3f}" for k, v in row["best_warm_passes"].items() if v >= 0.005), "",
            f"optimized graph: {sum(row['op_counts'].values())} call_function nodes, code "
            f"{row['code_sha256'][:12]}, constants {row['constants_sha256'][:12]}; applied: {', '.join(row['applied'])}",
            ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT, help="MODEL:BATCH:SEQ items, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="optimize() calls per model (the first is the cold one)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", default="h200")
    p.add_argument("--accuracy", action="store_true", help="with the fp64 accuracy guard (check_accuracy=True)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (1 steadies a CPU shared with other work; default: torch's)")
    p.add_argument("--profile", action="store_true",
                   help="run the last call under cProfile and write its top functions to --out (that call's times inflate)")
    p.add_argument("--tag", default="", help="a word in the file name (e.g. before/after)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    if a.reps < 1:
        raise SystemExit("optimize_time: --reps must be >= 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    from graphopt.tools.bench import _git_commit

    header = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "commit": _git_commit(), "target": a.target, "dtype": a.dtype,
              "device": a.device, "accuracy": a.accuracy, "reps": a.reps}
    result = {"header": header, "rows": []}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "optimize_time_" + "_".join(x for x in (a.tag, dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S"),
                                                   "cpu" if a.device == "cpu" else a.device) if x)
    for spec, batch, seq in parse_models(a.models):
        result["rows"].append(run_model(spec, batch, seq, dtype=parse_dtype(a.dtype), device=a.device,
                                        target=a.target, reps=a.reps, accuracy=a.accuracy,
                                        profile_to=out if a.profile else None))
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(to_markdown(result))
    print(to_markdown(result))
    print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
