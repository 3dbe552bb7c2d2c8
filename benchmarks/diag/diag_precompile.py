# Answered: how much of optimize()'s cold set-up do the Triton kernels compiled ahead on a thread pool save? DenseNet-121 bs64 54.1 -> 24.7 s on an H100 (guard's first calls 26.5 + accuracy checks 15.8 s -> kernel compilation 11.4 + first calls 2.0 s), 23.6 s with one guard warm-up; TNT-S 22.2 -> 21.6 s (first calls 9.6 -> 3.3 + 5.4 s compiling); before the launchers were built ahead (H200): DenseNet 38.9 -> 34.2 s, the first calls still 7.1 s in fused_pointwise (results/diag_precompile_2026-12-06_202539_h100.md, …201549_h200.md).
"""optimize()'s cold set-up time as it was before 12-06's ninth round (each Triton kernel compiled at its graph's first
call, the guard's graphs warmed up by three eager calls before capture and two timed-out calls), with the kernels
compiled ahead on a thread pool (graphopt.runtime.precompile), and with that and one warm-up call, on sweep configs.

    python benchmarks/diag/diag_precompile.py --configs densenet121:64,timm-tnt_s_patch16_224:64 --out DIR

Each run is a fresh process with an empty Triton cache (a cold first optimize() on this machine), bf16 on
the GPU, optimize() as the sweep calls it (measured guard and accuracy check on); per config the variants run
one after the other (``--rounds`` times, the order reversed every other round). Per run: set-up seconds, the
phases the kernels' compilation and the guard's first calls fall in, the returned module's time, and what the
precompilation did. ``--profile-configs``: a run each with everything on and the guard's warm-up calls' op
calls timed one by one (their first use against later uses, by op). Writes diag_precompile_<date>.{json,md}.
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


def _first_use_profile():
    """(install, stats): patches the guard's Timer so that each callable's warm-up calls run under a
    dispatch mode that times every op on real CUDA tensors (synchronized, outside CUDA-graph capture),
    keyed by op and argument metadata: the first call of a key against the fastest later one is that
    op's first-use cost (compiles, cuDNN plans, lazy initialization)."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphopt.runtime import measured

    first, later = {}, collections.defaultdict(lambda: float("inf"))

    def meta(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), tuple(v.stride()), v.dtype)
        return v if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__

    class FirstUse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            real = any(isinstance(v, torch.Tensor) and v.is_cuda and type(v) is torch.Tensor for v in leaves)
            if not real or torch.cuda.is_current_stream_capturing():
                return func(*args, **kwargs)
            key = (str(func), tuple(meta(v) for v in leaves))
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = func(*args, **kwargs)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if key in first:
                later[key] = min(later[key], dt)
            else:
                first[key] = dt
            return out

    real_compare = measured.Timer.compare

    def compare(self, *fns, **kw):
        def warm(fn):
            n = [0]

            def w():
                n[0] += 1
                if n[0] > self.warmup:
                    return fn()
                with FirstUse():
                    return fn()
            return w
        return real_compare(self, *[warm(f) for f in fns], **kw)

    def stats() -> dict:
        by = collections.defaultdict(lambda: [0, 0.0])
        for key, dt in first.items():
            extra = dt - (later[key] if later[key] != float("inf") else 0.0)
            by[key[0]][0] += 1
            by[key[0]][1] += extra
        return {k: {"keys": v[0], "first_use_s": round(v[1], 3)}
                for k, v in sorted(by.items(), key=lambda kv: -kv[1][1])[:12]}

    measured.Timer.compare = compare
    return stats


VARIANTS = {  # name: (GRAPHOPT_COMPILE_THREADS, the guard's warm-ups as before this round)
    "before": ("0", True), "pool": ("", True), "pool + 1 warm-up": ("", False), "profiled": ("", False)}


def _old_warmups() -> None:
    """The guard as before this round: three eager calls before each graph's capture, two untimed calls."""
    from graphopt.runtime import measured

    real_runnable, real_timer = measured.runnable, measured.Timer

    class Timer(real_timer):
        def __init__(self, *args, **kwargs):
            kwargs["warmup"] = 2
            super().__init__(*args, **kwargs)

    measured.runnable = lambda *a, **k: real_runnable(*a, **{**k, "warmup": 3})
    measured.Timer = Timer


def one(cfg: str, profile: bool = False, old_warmups: bool = False) -> dict:
    """The child: optimize ``cfg`` (CONFIG:BATCH) once, cold; its set-up and phases as JSON (with
    ``profile``: the first-use cost of the guard's warm-up calls by op, from :func:`_first_use_profile`)."""
    import torch

    import graphopt
    from graphopt.tools import perf_sweep

    name, batch = cfg.rsplit(":", 1)
    model, inputs = perf_sweep.build(name, int(batch))
    dev = torch.device("cuda")
    model = model.to(dev, torch.bfloat16).eval()
    inputs = tuple(x.to(dev, torch.bfloat16) if x.is_floating_point() else x.to(dev) for x in inputs)
    if old_warmups:
        _old_warmups()
    stats = _first_use_profile() if profile else None
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
                                                     "left": dict(list(pre.left.items())[:5]), "note": pre.note},
            **({"first_use_by_op": stats()} if stats else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="", help="CONFIG:BATCH,... (required)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no run after this many seconds")
    p.add_argument("--profile-configs", default="",
                   help="configs also run once with the pool and the guard's warm-up calls profiled by op")
    p.add_argument("--variants", default="before,pool,pool + 1 warm-up")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/out")
    a = p.parse_args(argv)
    if a.one:
        old = VARIANTS[a.variant][1]
        print("ROW " + json.dumps(one(a.one, a.variant == "profiled", old)), flush=True)
        return 0
    if not a.configs:
        p.error("--configs is required")
    import torch

    rows = []
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    runs = [(cfg, v) for cfg in a.configs.split(",") for r in range(a.rounds)
            for v in (names if r % 2 == 0 else names[::-1])]
    runs += [(cfg, "profiled") for cfg in a.profile_configs.split(",") if cfg]
    t0 = time.perf_counter()
    for cfg, variant in runs:
        if time.perf_counter() - t0 > a.budget_s:
            rows.append({"config": cfg, "variant": variant, "error": "not run: the budget was spent"})
            continue
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-cold-"))
        env.pop("GRAPHOPT_COMPILE_THREADS", None)
        if VARIANTS[variant][0]:
            env["GRAPHOPT_COMPILE_THREADS"] = VARIANTS[variant][0]
        try:
            res = subprocess.run([sys.executable, __file__, "--one", cfg, "--variant", variant], env=env,
                                 capture_output=True, text=True, timeout=a.timeout)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")), None)
            row = json.loads(line[4:]) if line else {"config": cfg, "error": res.stderr.strip()[-300:]}
        except subprocess.TimeoutExpired:
            row = {"config": cfg, "error": f"timed out after {a.timeout:.0f} s"}
        row["variant"] = variant
        rows.append(row)
        print(json.dumps(row), flush=True)
    from _timing import write_rows

    lines = [f"# optimize()'s cold set-up: kernels compiled ahead on a thread pool, the guard's warm-up calls "
             f"({torch.cuda.get_device_name(0)}, torch {torch.__version__})", "",
             "Each run a fresh process with an empty Triton cache, bf16. before: each Triton kernel compiled at "
             "its graph's first call, the guard's graphs captured after 3 eager calls and timed after 2 untimed "
             f"calls; pool: kernels compiled ahead on a pool ({os.cpu_count()} host CPUs); + 1 warm-up: the guard's "
             "graphs captured after 1 eager call and timed after 1 untimed call.", "",
             "| config | variant | set-up s | guard first calls s | building callables s | kernel compilation s "
             "| guard timed calls s | graphopt ms | returned | accuracy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | {row['variant']} | {row['error'][:150]} |  |  |  |  |  |  |  |")
            continue
        ph = row["phases"]
        lines.append(f"| {row['config']} | {row['variant']} | {row['setup_s']:.2f} | {ph[PHASES[0]]:.2f} | "
                     f"{ph[PHASES[1]]:.2f} | {ph[PHASES[2]]:.2f} | {ph[PHASES[3]]:.2f} | {row['optimized_ms'] or 0:.3f} | {row['returned']} "
                     f"| {row['accuracy']} |")
    by = {}
    for row in rows:
        if "error" not in row and row["variant"] != "profiled":
            by.setdefault(row["config"], {}).setdefault(row["variant"], []).append(row["setup_s"])
    prof = [r for r in rows if r.get("first_use_by_op")]
    if prof:
        lines += ["", "First-use cost of the guard's warm-up calls by op (everything on; each op call synchronized, so "
                  "these runs' set-up is not comparable): the first call of each op and argument metadata less the "
                  "fastest later one.", "", "| config | op | keys | first-use s |", "| --- | --- | ---: | ---: |"]
        for r in prof:
            for op, v in r["first_use_by_op"].items():
                lines.append(f"| {r['config']} | {op} | {v['keys']} | {v['first_use_s']:.3f} |")
    lines += ["", "| config | " + " | ".join(f"set-up s, {v}" for v in names) + " |",
              "| --- | " + " | ".join("---:" for _ in names) + " |"]
    for cfg, v in by.items():
        lines.append(f"| {cfg} | " + " | ".join(f"{statistics.median(v[n]):.2f}" if v.get(n) else "" for n in names)
                     + " |")
    write_rows(a.out, "diag_precompile", rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
