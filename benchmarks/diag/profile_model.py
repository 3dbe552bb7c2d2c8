# Answered: Where does a model's time go? Top kernels of eager / graphopt / torch.compile, idle gaps, per-pass ablation; its profiles are results/archive/profile_*.md.
"""Where does the time go? Kernel profile and per-pass ablation of one zoo model.

    python benchmarks/diag/profile_model.py vit_b_16 --batch 64 --ablate
    python benchmarks/diag/profile_model.py glm4-9b-4l --batch 1 --seq-len 1024

Prints (1) the top CUDA kernels of eager and of graphopt by total time (torch.profiler),
(2) with --ablate, the median time of graphopt with each applied pass disabled in turn, so a
pass that makes things slower on the real device shows up as a row faster than the full
pipeline. Also writes the tables to --out as Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import graphopt  # noqa: E402
from graphopt.tools.bench import time_call  # noqa: E402
from graphopt.examples import zoo  # noqa: E402


def profiled(fn, calls: int = 1, cpu: bool = False):
    """torch.profiler over ``calls`` calls of fn after one warm-up call, the device synchronized
    before and after (CUDA activity; CPU too with ``cpu``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def top_kernels(fn, n=15):
    prof = profiled(fn, calls=3)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 3 / 1e3, e.count // 3, e.key[:90]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return total, rows[:n]


def idle_gaps(fn, n=12):
    """One call profiled alone (the device idle before it, as time_call times it): the device's idle
    time from the call's start to its first kernel and between kernels, the largest gaps with the
    kernels on each side."""
    evs = profiled(fn, calls=1, cpu=True).events()
    cpu = [e for e in evs if e.device_type == torch.autograd.DeviceType.CPU]
    ker = sorted((e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if not ker:
        return 0.0, 0.0, []
    t0 = min(e.time_range.start for e in cpu) if cpu else ker[0].time_range.start
    lead = (ker[0].time_range.start - t0) / 1e3
    gaps, end = [], ker[0].time_range.end
    for prev, e in zip(ker, ker[1:]):
        g = e.time_range.start - end
        if g > 0:
            gaps.append((g / 1e3, prev.name[:60], e.name[:60]))
        end = max(end, e.time_range.end)
    gaps.sort(reverse=True)
    return lead, sum(g for g, _, _ in gaps), gaps[:n]


def node_runs(gm, flat: list, cm) -> list:
    """[(kernel ms, node, op, [(kernel, ms)], predicted ms)] for each node of ``gm`` that launches
    CUDA kernels: the graph run node by node (eager, no CUDA graph) with the profiler around each
    node, twice; the second run's kernels (the first loads them)."""
    import torch.fx as fx
    from torch.profiler import ProfilerActivity, profile

    rows = []

    class Run(fx.Interpreter):
        def run_node(self, n):
            if n.op != "call_function":
                return super().run_node(n)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out = super().run_node(n)
                torch.cuda.synchronize()
            ks = [(e.name, (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / 1e3)
                  for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            if ks:
                try:
                    pred = float(cm.node_cost(n).time_s) * 1e3
                except Exception:  # noqa: BLE001 - a node the cost model does not price
                    pred = float("nan")
                rows.append((sum(t for _, t in ks), n.name, str(n.target), ks, pred))
            return out

    Run(gm).run(*flat)
    first = len(rows)
    Run(gm).run(*flat)
    return rows[first:]


def node_kernels(opt, inputs, top: int = 40) -> list:
    """The CUDA kernels each node of the optimized graph launches (node_runs), most kernel time
    first, as lines grouping them by op and kernel. Answers which ops launch copies inside aten (a
    strided copy before cuBLAS or cuDNN) that the graph does not show."""
    import collections

    import torch.fx as fx

    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    gm = next(m for m in opt.modules() if isinstance(m, fx.GraphModule))
    cm = CostModel(get_profile(torch.device("cuda"))[0])
    flat = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    with torch.inference_mode():
        rows = node_runs(gm, flat, cm)
    by = collections.defaultdict(lambda: [0, 0.0, 0.0, set()])
    for t, name, op, ks, pred in rows:
        key = (op, " + ".join(k[:50] for k, _ in ks))
        by[key][0] += 1
        by[key][1] += t
        by[key][2] += pred
        by[key][3].add(name)
    lines = ["## kernels by node (graphopt's graph run node by node, eager)", "",
             "| ms | predicted ms | nodes | op | kernels | e.g. |", "| ---: | ---: | ---: | --- | --- | --- |"]
    for (op, ks), (c, t, pr, names) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {t:.3f} | {pr:.3f} | {c} | `{op}` | `{ks[:160]}` | {sorted(names)[0]} |")
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--ablate", nargs="?", const="all", default=None,
                   help="also time graphopt with each applied pass disabled in turn (or only those of a comma list)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    p.add_argument("--compile", action="store_true", help="also profile torch.compile (default mode)")
    p.add_argument("--gaps", action="store_true", help="also list where the device idles within one call")
    p.add_argument("--nodes", action="store_true", help="also the kernels each node of graphopt's graph launches "
                   "(run node by node), by op and kernel, against the cost model's price")
    p.add_argument("--passes", help="graphopt with only these passes (comma-separated), no CUDA graph: e.g. "
                   "eliminate_dead_code,fold_constants to see what capture alone runs")
    p.add_argument("--sweep", action="store_true", help="the model is a perf sweep config's name (e.g. inception_v3, "
                   "hf-gpt-neox): graphopt.tools.perf_sweep.build")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    if a.sweep:
        from graphopt.tools import perf_sweep

        model, inputs = perf_sweep.build(a.model, a.batch)
        model = model.to("cuda", torch.bfloat16)
        move = lambda x: x.to("cuda", torch.bfloat16) if x.is_floating_point() else x.to("cuda")  # noqa: E731
        inputs = {k: move(x) for k, x in inputs.items()} if isinstance(inputs, dict) else tuple(map(move, inputs))
    else:
        model, inputs = zoo.get(a.model, batch=a.batch, seq_len=a.seq_len, dtype=torch.bfloat16, device="cuda")
    lines = [f"# profile {a.model} bs{a.batch}" + (f" seq{a.seq_len}" if a.seq_len else "") + " bf16",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    if a.passes:
        opt = graphopt.optimize(model, inputs, check_accuracy=False, passes=a.passes.split(","), cuda_graphs=False)
        lines += [f"graphopt with passes {a.passes} only, no CUDA graph", ""]
    else:
        opt = graphopt.optimize(model, inputs, check_accuracy=False)
    with torch.inference_mode():
        call = lambda f: f(**inputs) if isinstance(inputs, dict) else f(*inputs)  # noqa: E731
        eager = lambda: call(model)  # noqa: E731
        go = lambda: call(opt)  # noqa: E731
        variants = [("eager", eager), ("graphopt", go)]
        if a.compile:
            comp = torch.compile(model)
            variants.append(("torch.compile", lambda: call(comp)))
        for label, fn in variants:
            ms = statistics.median(time_call(fn, reps=a.reps, warmup=3, device="cuda")) * 1e3
            total, rows = top_kernels(fn, n=a.top)
            lines += [f"## {label}: {ms:.3f} ms per call, {total:.3f} ms of kernel time (busy {total / ms:.0%})", "",
                      "| ms/call | calls | kernel |", "| ---: | ---: | --- |"]
            lines += [f"| {t:.3f} | {c} | `{k}` |" for t, c, k in rows]
            lines.append("")
            if a.gaps:
                lead, idle, gaps = idle_gaps(fn)
                lines += [f"idle in one call: {lead:.3f} ms before the first kernel (host time from the call's first "
                          f"CPU event), {idle:.3f} ms between kernels; largest gaps:", "",
                          "| ms | after | before |", "| ---: | --- | --- |"]
                lines += [f"| {g:.3f} | `{x}` | `{y}` |" for g, x, y in gaps]
                lines.append("")
        if a.nodes:
            try:
                lines += node_kernels(opt, inputs)
            except Exception as e:  # noqa: BLE001 - the profile above stands without it
                lines += [f"node kernels not listed: {type(e).__name__}: {str(e)[:200]}", ""]
        notes = [n for n in opt.report.notes if "CUDA graph" in n]
        lines += [f"- {n}" for n in notes] + [""]
        lines += ["## passes", "", "| pass | status | measured ms | note |", "| --- | --- | ---: | --- |"]
        for r in opt.report.passes:
            if r.status in ("applied", "reverted"):
                ms = r.details.get("measured_ms")
                lines.append(f"| {r.name} | {r.status} | {'' if ms is None else f'{ms:.3f}'} | "
                             f"{(r.notes[-1] if r.notes else '')[:160]} |")
        lines.append("")
        timed = [(r.name, t) for r in opt.report.passes for t in r.details.get("timed_candidates", [])]
        if timed:  # lowerings timed on the device before they applied (graphopt.runtime.candidates)
            lines += ["## candidates timed before they applied", "",
                      "| pass | candidate | predicted gain µs | before µs | after µs |", "| --- | --- | ---: | ---: | ---: |"]
            lines += [f"| {p} | {t['candidate']} | {t['predicted_gain_us']:.1f} | {t['before_us']:.1f} | "
                      f"{t['after_us']:.1f} |" for p, t in timed]
            lines.append("")
        if a.ablate:
            applied = [r.name for r in opt.report.passes if r.status == "applied"
                       and (a.ablate == "all" or r.name in a.ablate.split(","))]
            full = statistics.median(time_call(go, reps=a.reps, warmup=3, device="cuda")) * 1e3
            lines += ["## ablation (graphopt with one pass disabled)", "", "| disabled | ms | vs full |", "| --- | ---: | ---: |",
                      f"| (none) | {full:.3f} | |"]
            for name in applied:
                with torch.inference_mode(False):
                    o2 = graphopt.optimize(model, inputs, check_accuracy=False, disable=[name])
                ms = statistics.median(time_call(lambda: call(o2), reps=a.reps, warmup=3, device="cuda")) * 1e3
                lines.append(f"| {name} | {ms:.3f} | {full / ms:.2f}× |")
                del o2
            again = statistics.median(time_call(go, reps=a.reps, warmup=3, device="cuda")) * 1e3
            lines += [f"| (none, again: the drift) | {again:.3f} | |", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{a.model}_bs{a.batch}{'_passes' if a.passes else ''}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
