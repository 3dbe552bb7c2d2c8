"""optimize()'s set-up time with the Triton kernels compiled ahead on a thread pool (graphopt.runtime.precompile)
against compiled one by one at each graph's first call (GRAPHOPT_COMPILE_THREADS=0), on sweep configs.

    python benchmarks/diag/diag_precompile.py --configs densenet121:64,timm-tnt_s_patch16_224:64 --out DIR

Each run is a fresh process with an empty Triton cache (a cold first optimize() on this machine), bf16 on
the GPU, optimize() as the sweep calls it (measured guard and accuracy check on); the two variants alternate
per config, ``--rounds`` times. Per run: set-up seconds, the phases the kernels' compilation falls in, the
returned module's time, and what the precompilation did. Writes diag_precompile_<date>.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PHASES = ("measured guard: first calls", "measured guard: building the callables", "kernel compilation",
          "measured guard: timed calls")


def one(cfg: str) -> dict:
    """The child: optimize ``cfg`` (CONFIG:BATCH) once, cold; its set-up and phases as JSON."""
    import torch

    import graphopt
    from graphopt.tools import perf_sweep

    name, batch = cfg.rsplit(":", 1)
    model, inputs = perf_sweep.build(name, int(batch))
    dev = torch.device("cuda")
    model = model.to(dev, torch.bfloat16).eval()
    inputs = tuple(x.to(dev, torch.bfloat16) if x.is_floating_point() else x.to(dev) for x in inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt = graphopt.optimize(model, inputs)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.inference_mode():
        opt(*inputs)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - t1
    phases = opt.report.optimize_phases
    runner = getattr(opt, "_runner", None)
    pre = getattr(runner, "precompiled", None)
    speed = opt.report.speed or {}
    return {"config": cfg, "setup_s": setup, "first_call_s": first_call,
            "phases": {k: phases.get(k, 0.0) for k in PHASES},
            "top_phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:6]),
            "optimized_ms": speed.get("optimized_ms"), "returned": speed.get("returned"),
            "accuracy": (opt.report.accuracy or {}).get("passed"),
            "final_lower": None if pre is None else {"nodes": pre.nodes, "kernels": pre.kernels,
                                                     "left": dict(list(pre.left.items())[:5]), "note": pre.note}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/out")
    a = p.parse_args(argv)
    if a.one:
        print("ROW " + json.dumps(one(a.one)), flush=True)
        return 0
    import torch

    rows = []
    for cfg in a.configs.split(","):
        for r in range(a.rounds):
            for threads in (("0", "") if r % 2 == 0 else ("", "0")):
                env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-cold-"))
                env.pop("GRAPHOPT_COMPILE_THREADS", None)
                if threads:
                    env["GRAPHOPT_COMPILE_THREADS"] = threads
                try:
                    res = subprocess.run([sys.executable, __file__, "--one", cfg], env=env, capture_output=True,
                                         text=True, timeout=a.timeout)
                    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")), None)
                    row = json.loads(line[4:]) if line else {"config": cfg, "error": res.stderr.strip()[-300:]}
                except subprocess.TimeoutExpired:
                    row = {"config": cfg, "error": f"timed out after {a.timeout:.0f} s"}
                row["threads"] = "0 (at first calls)" if threads == "0" else "pool"
                rows.append(row)
                print(json.dumps(row), flush=True)
    from _timing import write_rows

    lines = [f"# optimize() set-up with kernels compiled ahead on a thread pool, cold Triton cache "
             f"({torch.cuda.get_device_name(0)}, torch {torch.__version__})", "",
             "Each run a fresh process with an empty Triton cache, bf16; the variants alternate per config. "
             f"Pool: {os.cpu_count()} host CPUs (GRAPHOPT_COMPILE_THREADS unset); 0: each kernel compiled at its "
             "graph's first call.", "",
             "| config | compile | set-up s | guard first calls s | building callables s | kernel compilation s "
             "| graphopt ms | returned | accuracy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | {row['threads']} | {row['error'][:150]} |  |  |  |  |  |  |")
            continue
        ph = row["phases"]
        lines.append(f"| {row['config']} | {row['threads']} | {row['setup_s']:.2f} | {ph[PHASES[0]]:.2f} | "
                     f"{ph[PHASES[1]]:.2f} | {ph[PHASES[2]]:.2f} | {row['optimized_ms'] or 0:.3f} | {row['returned']} "
                     f"| {row['accuracy']} |")
    by = {}
    for row in rows:
        if "error" not in row:
            by.setdefault(row["config"], {}).setdefault(row["threads"], []).append(row["setup_s"])
    lines += ["", "| config | set-up s, at first calls | set-up s, pool | ratio |", "| --- | ---: | ---: | ---: |"]
    for cfg, v in by.items():
        a0, a1 = v.get("0 (at first calls)"), v.get("pool")
        if a0 and a1:
            m0, m1 = statistics.median(a0), statistics.median(a1)
            lines.append(f"| {cfg} | {m0:.2f} | {m1:.2f} | {m1 / m0:.2f} |")
    write_rows(a.out, "diag_precompile", rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
