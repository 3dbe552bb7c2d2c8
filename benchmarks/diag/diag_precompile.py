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


def one(cfg: str, profile: bool = False) -> dict:
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
    p.add_argument("--configs", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no run after this many seconds")
    p.add_argument("--profile-configs", default="",
                   help="configs also run once with the pool and the guard's warm-up calls profiled by op")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/out")
    a = p.parse_args(argv)
    if a.one:
        print("ROW " + json.dumps(one(a.one, a.profile)), flush=True)
        return 0
    import torch

    rows = []
    runs = [(cfg, threads) for cfg in a.configs.split(",") for r in range(a.rounds)
            for threads in (("0", "") if r % 2 == 0 else ("", "0"))]
    runs += [(cfg, "profile") for cfg in a.profile_configs.split(",") if cfg]
    t0 = time.perf_counter()
    for cfg, threads in runs:
        if time.perf_counter() - t0 > a.budget_s:
            rows.append({"config": cfg, "threads": threads or "pool", "error": "not run: the budget was spent"})
            continue
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-cold-"))
        env.pop("GRAPHOPT_COMPILE_THREADS", None)
        if threads == "0":
            env["GRAPHOPT_COMPILE_THREADS"] = threads
        extra = ["--profile"] if threads == "profile" else []
        try:
            res = subprocess.run([sys.executable, __file__, "--one", cfg, *extra], env=env, capture_output=True,
                                 text=True, timeout=a.timeout)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")), None)
            row = json.loads(line[4:]) if line else {"config": cfg, "error": res.stderr.strip()[-300:]}
        except subprocess.TimeoutExpired:
            row = {"config": cfg, "error": f"timed out after {a.timeout:.0f} s"}
        row["threads"] = {"0": "0 (at first calls)", "profile": "pool, profiled"}.get(threads, "pool")
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
        if "error" not in row and row["threads"] != "pool, profiled":
            by.setdefault(row["config"], {}).setdefault(row["threads"], []).append(row["setup_s"])
    prof = [r for r in rows if r.get("first_use_by_op")]
    if prof:
        lines += ["", "First-use cost of the guard's warm-up calls by op (pool on; each op call synchronized, so the "
                  "set-up of these runs is not comparable): the first call of each op and argument metadata "
                  "less the fastest later one.", "", "| config | op | keys | first-use s |", "| --- | --- | ---: | ---: |"]
        for r in prof:
            for op, v in r["first_use_by_op"].items():
                lines.append(f"| {r['config']} | {op} | {v['keys']} | {v['first_use_s']:.3f} |")
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
