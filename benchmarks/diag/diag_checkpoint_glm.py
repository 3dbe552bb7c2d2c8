# Answered: Where does the checkpointed GLM step's extra time go? 19 of +69 ms was SDPA's materialized causal mask (now folded); recomputed memory-bound ops cost ~2x their price (results/archive/diag_checkpoint_glm_2026-11-30_012215_h200.md).
"""Where does the checkpointed GLM step's extra time go? (issue 8)

    python benchmarks/diag/diag_checkpoint_glm.py --out DIR [--tiny] [--budget 0.3] [--reps 5]
                                             [--variants eager,captured,ckpt,fa,fa+ckpt,hf]

GLM-4-9B shape (``zoo.glm4_9b_config(8)``: 8 layers), bf16, batch 4, seq 2048, SDPA attention
(``--tiny``: the CPU-sized GLM for a dry run). Training step as in ``checkpoint_bench.py``
(``loss = sum <out_i, g_i>`` with fixed random g_i). Variants:

* ``eager``: the Hugging Face model;
* ``captured``: graphopt's captured graph, no pass (what the checkpointed rows start from);
* ``ckpt``: graphopt ``insert_checkpoints`` only at ``--budget`` (aot backend), as the benchmark runs it;
* ``fa``: ``fold_constants`` + ``fuse_attention`` only (the captured SDPA reads a materialized causal
  mask, which eager's SDPA call does not; these passes fold it back to ``is_causal=True``);
* ``fa+ckpt``: the same, then ``insert_checkpoints`` at ``--budget``;
* ``hf``: Hugging Face per-layer gradient checkpointing.

For each: activation memory (max allocated during the step minus allocated before it), memory
held after the forward, ms/step (median of --reps), forward and backward ms, and a
``torch.profiler`` kernel breakdown of one step grouped into GEMM / attention / norm+reduction /
elementwise / copy+cast / other (ms), with the top kernels. For the checkpointed variants, the plan:
predicted saved bytes, transient, extra ms, the recomputed ops by op with predicted ms, what is
saved by op, and the ops the AOT backward graphs actually rerun.

Writes ``diag_checkpoint_glm_<date>_<device>.json`` and ``.md`` into --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT), str(Path(__file__).resolve().parents[1])):
    if p not in sys.path:
        sys.path.insert(0, p)

from checkpoint_bench import Stepper, _outs, build_glm, free, gb, glm_reference, log, step_ms, write_results  # noqa: E402

GROUPS = ("gemm", "attention", "norm/reduce", "elementwise", "copy/cast", "other")


def classify(name: str) -> str:
    """Kernel (GPU) or ATen op (CPU) name -> group."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "attn", "sdpa", "cutlassf", "efficient_")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                            "aten::linear", "aten::matmul", "splitk", "sm90_", "sm80_")):
        return "gemm"
    if any(k in n for k in ("copy", "memcpy", "memset", "cat", "_to_copy", "aten::to", "clone", "contiguous",
                            "stack", "index", "gather", "scatter", "transpose")):
        return "copy/cast"
    if any(k in n for k in ("reduce", "norm", "mean", "aten::sum", "softmax")):
        return "norm/reduce"
    if any(k in n for k in ("elementwise", "vectorized", "aten::mul", "aten::add", "aten::pow", "aten::rsqrt",
                            "aten::silu", "aten::neg", "aten::div", "aten::sub", "silu", "unrolled")):
        return "elementwise"
    return "other"


def profile_step(stepper, cuda: bool, top: int = 15) -> dict:
    """One profiled training step: ms by group and the top kernels (CPU: self time of ATen ops)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    stepper()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        stepper()
        if cuda:
            torch.cuda.synchronize()
    groups = {g: 0.0 for g in GROUPS}
    kernels: dict = {}
    count = 0
    if cuda:
        for e in prof.events():
            if getattr(e, "device_type", None) != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
            g = classify(e.name)
            groups[g] += us / 1e3
            k = kernels.setdefault(e.name[:120], [0.0, 0, g])
            k[0] += us / 1e3
            k[1] += 1
            count += 1
    else:
        for e in prof.key_averages():
            if not e.key.startswith("aten::"):
                continue
            ms = e.self_cpu_time_total / 1e3
            g = classify(e.key)
            groups[g] += ms
            kernels[e.key] = [ms, e.count, g]
            count += e.count
    tops = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"total_ms": sum(groups.values()), "groups_ms": groups, "launches": count,
            "top": [{"name": k, "ms": v[0], "count": v[1], "group": v[2]} for k, v in tops]}


def timed_split(stepper, cuda: bool, reps: int) -> tuple:
    """Median forward ms and backward ms of a step (CUDA events; CPU: wall clock)."""
    fw, bw = [], []
    for _ in range(reps):
        for p in stepper.params:
            if p.grad is not None:
                p.grad.zero_()
        if cuda:
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            outs = _outs(stepper.fn(*stepper.args))
            b.record()
            torch.autograd.backward(outs, stepper.grads_out)
            c.record()
            c.synchronize()
            fw.append(a.elapsed_time(b))
            bw.append(b.elapsed_time(c))
        else:
            t0 = time.perf_counter()
            outs = _outs(stepper.fn(*stepper.args))
            t1 = time.perf_counter()
            torch.autograd.backward(outs, stepper.grads_out)
            t2 = time.perf_counter()
            fw.append((t1 - t0) * 1e3)
            bw.append((t2 - t1) * 1e3)
        del outs
    return statistics.median(fw), statistics.median(bw)


def measure(stepper, cuda: bool, warmup: int, reps: int) -> dict:
    for _ in range(warmup):
        stepper()
    act = stepper(record=True)
    after = stepper.after_forward
    times = step_ms(stepper, reps, cuda)
    fw, bw = timed_split(stepper, cuda, max(2, reps // 2))
    return {"activation_gb": gb(act), "after_forward_gb": gb(after), "ms": statistics.median(times),
            "forward_ms": fw, "backward_ms": bw}


def plan_summary(opt) -> dict:
    """The checkpoint plan as the pass reported it (predicted), and what the AOT backward reruns."""
    try:
        res = opt.report.pass_result("insert_checkpoints")
    except KeyError:
        return {}
    d = res.details
    keys = ("backend", "backend_reason", "budget_bytes", "baseline_saved_bytes", "predicted_saved_bytes",
            "recompute_transient_bytes", "region_input_bytes", "predicted_held_bytes", "predicted_activation_bytes",
            "baseline_activation_bytes", "output_bytes", "backward_working_bytes", "extra_ms", "regions",
            "kept_nodes", "recomputed_nodes", "aot_saved_bytes", "aot_recomputed_ops")
    out = {k: d.get(k) for k in keys if k in d}
    for k in ("recomputed_by_op", "saved_by_op", "aot_recomputed_by_op"):
        out[k] = d.get(k)
    out["status"] = res.status
    out["notes"] = list(res.notes)[:6]
    return out


def sdpa_calls(opt) -> list:
    """How the graph calls attention (mask / is_causal / enable_gqa), for the first SDPA node."""
    gm = getattr(opt, "graph_module", None) or getattr(opt, "gm", None)
    if gm is None:
        return []
    out = []
    for mod in gm.modules():
        g = getattr(mod, "graph", None)
        if g is None:
            continue
        for n in g.nodes:
            if n.op == "call_function" and "scaled_dot_product" in str(n.target):
                args = [getattr(a, "name", a) for a in n.args]
                out.append(f"{n.target}({', '.join(map(str, args))}, {n.kwargs})")
    return sorted(set(out))[:3]


def run_variant(name, model, inputs, params, grads_out, cuda, args):
    import graphopt

    t0 = time.perf_counter()
    info: dict = {"variant": name}
    if name == "eager":
        fn = model
    elif name == "hf":
        fn, _ = glm_reference(model)
    else:
        passes = {"captured": [], "ckpt": ["insert_checkpoints"], "fa": ["fold_constants", "fuse_attention"],
                  "fa+ckpt": ["fold_constants", "fuse_attention", "insert_checkpoints"]}[name]
        budget = args.budget if "ckpt" in name else None
        fn = graphopt.optimize(model, inputs, training=True, memory_budget=budget, check_accuracy=False,
                               passes=passes, cuda_graphs=False, checkpoint_backend=args.backend,
                               model_name=f"glm-{name}")
        info["optimize_s"] = time.perf_counter() - t0
        info["plan"] = plan_summary(fn)
        info["sdpa"] = sdpa_calls(fn)
    model.train()
    stepper = Stepper(fn, inputs, params)
    stepper.grads_out = grads_out
    info.update(measure(stepper, cuda, args.warmup, args.reps))
    info["profile"] = profile_step(stepper, cuda)
    if name == "hf":
        model.gradient_checkpointing_disable()
    log(f"[{name}] {info['ms']:.2f} ms/step (fwd {info['forward_ms']:.1f}, bwd {info['backward_ms']:.1f}), "
        f"activations {info['activation_gb']} GB, after fwd {info['after_forward_gb']} GB; profile "
        + ", ".join(f"{g} {v:.1f}" for g, v in info["profile"]["groups_ms"].items()))
    if info.get("plan"):
        p = info["plan"]
        log(f"[{name}] plan: backend {p.get('backend')}, saved {gb(p.get('predicted_saved_bytes'))} GB "
            f"(+{gb(p.get('recompute_transient_bytes'))} transient) of {gb(p.get('baseline_saved_bytes'))}, "
            f"predicted +{p.get('extra_ms')} ms; recomputed {p.get('recomputed_by_op')}; AOT reruns {p.get('aot_recomputed_by_op')}")
    del stepper, fn
    return info


def _f(x, fmt="{:.2f}"):
    return "" if x is None else fmt.format(x)


def _g(x):
    return "" if x is None else f"{x:.4g}"


def markdown(result) -> str:
    lines = [f"# GLM checkpointing diagnostic ({result['date']}, {result['device']}, torch {result['torch']})", "",
             f"{result['shape']}; budget {result['budget']}; backend {result['backend']}", "",
             "| variant | ms/step | fwd ms | bwd ms | activation GB | after fwd GB | "
             + " | ".join(f"{g} ms" for g in GROUPS) + " | kernels |",
             "| --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in GROUPS) + " | ---: |"]
    for v in result["variants"]:
        if "error" in v:
            lines.append(f"| {v['variant']} | error: {v['error']} |")
            continue
        g = v["profile"]["groups_ms"]
        lines.append(f"| {v['variant']} | {_f(v['ms'])} | {_f(v['forward_ms'])} | {_f(v['backward_ms'])} | "
                     f"{_g(v['activation_gb'])} | {_g(v['after_forward_gb'])} | "
                     + " | ".join(_f(g[k]) for k in GROUPS) + f" | {v['profile']['launches']} |")
    for v in result["variants"]:
        if "error" in v:
            continue
        lines += ["", f"## {v['variant']}", ""]
        if v.get("sdpa"):
            lines.append("SDPA: " + "; ".join(f"`{s}`" for s in v["sdpa"]))
            lines.append("")
        p = v.get("plan") or {}
        if p:
            lines.append(f"plan: backend {p.get('backend')}, budget {_g(gb(p.get('budget_bytes')))} GB, predicted saved "
                         f"{_g(gb(p.get('predicted_saved_bytes')))} GB + transient {_g(gb(p.get('recompute_transient_bytes')))} GB "
                         f"of baseline {_g(gb(p.get('baseline_saved_bytes')))} GB, predicted held after fwd "
                         f"{_g(gb(p.get('predicted_held_bytes')))} GB, predicted step activations "
                         f"{_g(gb(p.get('predicted_activation_bytes')))} GB (baseline {_g(gb(p.get('baseline_activation_bytes')))}), "
                         f"predicted +{_f(p.get('extra_ms'))} ms, {p.get('regions')} regions, AOT saves "
                         f"{_g(gb(p.get('aot_saved_bytes')))} GB")
            lines.append("")
            lines.append("recomputed (predicted): " + ", ".join(f"{k} {r['count']}x {r['ms']:.2f} ms"
                                                               for k, r in (p.get("recomputed_by_op") or {}).items()))
            lines.append("")
            lines.append("saved: " + ", ".join(f"{k} {r['count']}x {r['gb']:.3f} GB"
                                              for k, r in (p.get("saved_by_op") or {}).items()))
            lines.append("")
            lines.append("AOT backward reruns: " + ", ".join(f"{k} {c}x" for k, c in (p.get("aot_recomputed_by_op") or {}).items()))
            lines.append("")
        lines += ["| kernel | group | count | ms |", "| --- | --- | ---: | ---: |"]
        for k in v["profile"]["top"]:
            lines.append(f"| `{k['name'][:100]}` | {k['group']} | {k['count']} | {k['ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized GLM (dry run)")
    ap.add_argument("--budget", type=float, default=None, help="default 0.3 (--tiny: 0.6, the tiny GLM's minimum is ~0.37)")
    ap.add_argument("--backend", default="aot", choices=("auto", "aot", "sac"))
    ap.add_argument("--variants", default="eager,captured,ckpt,fa,fa+ckpt,hf")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in ("eager", "captured", "ckpt", "fa", "fa+ckpt", "hf")]
    if bad:
        ap.error(f"unknown variants {bad}")
    cuda = torch.cuda.is_available() and not args.tiny
    if args.budget is None:
        args.budget = 0.6 if args.tiny else 0.3
    device = torch.device("cuda" if cuda else "cpu")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"[glm] building on {device}")
    model, inputs, dtype, shape = build_glm(args.tiny, device, layers=args.layers)
    model.train()
    params = list(model.parameters())
    result = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "shape": {**shape, "dtype": str(dtype).replace("torch.", "")}, "budget": args.budget,
              "backend": args.backend, "variants": []}
    grads_out = None
    for name in variants:
        try:
            if grads_out is None:
                warm = Stepper(model, inputs, params)
                warm()
                grads_out = warm.grads_out
                del warm
            result["variants"].append(run_variant(name, model, inputs, params, grads_out, cuda, args))
        except Exception as e:  # keep the other variants
            import traceback

            traceback.print_exc()
            result["variants"].append({"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
            if name == "hf":
                model.gradient_checkpointing_disable()
        free()
        log(f"[glm] {time.perf_counter() - t0:.0f} s so far")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    tag = "h200" if cuda and "H200" in result["device"] else ("cuda" if cuda else "cpu")
    base = out_dir / f"diag_checkpoint_glm_{stamp}_{tag}"
    print(write_results(base, result, markdown))
    log(f"[glm] wrote {base}.json/.md in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
