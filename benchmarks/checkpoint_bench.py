"""Activation checkpointing under a memory budget (issue 8): measured memory and step time.

    python benchmarks/checkpoint_bench.py --out DIR [--configs resnet50,glm4,glm4-diag,zoo] [--tiny]
                                          [--backend aot|sac|auto|both] [--reps 10] [--warmup 2] [--all-passes | --passes P,Q,...]
                                          [--budget F] [--no-reference]

The issue-8 GLM check (eager, Hugging Face per-layer checkpointing, graphopt aot at 0.3: measured
peak activation memory vs the plan's predicted step activations, time ratio, gradient check):

    python benchmarks/checkpoint_bench.py --out $OUT --configs glm4 --backend aot

Configs (GPU sizes; ``--tiny`` swaps in CPU-sized models for a dry run):

* ``resnet50``: torchvision ResNet-50, batch 128, fp32, 224x224, graphopt at memory_budget 0.4;
  the reference is ``torch.utils.checkpoint.checkpoint_sequential`` with 4 segments.
* ``glm4``: GLM-4-9B-shaped decoder (``zoo.glm4_9b_config(8)``, 8 layers), bf16, batch 4,
  seq 2048, SDPA attention, graphopt at memory_budget 0.3; the reference is Hugging Face's
  ``model.gradient_checkpointing_enable()`` (non-reentrant).
* ``glm4-diag``: GLM gradient numerics at batch 1: eager (bf16), the captured graph without
  checkpoints, and each checkpoint backend at 0.3, against an fp32 eager copy and against eager
  bf16 (relative L2 error, all gradients together and the worst parameter), so capture numerics,
  recomputation and bf16 noise can be told apart.
* ``zoo`` (not in the default set): predicted vs measured activation memory (no rewriting) for resnet50 bs32,
  bert-base bs32, vit_b_16 bs32 (bf16) and the GLM-4-9B shape with 2 layers bs2 seq1024.

A training step is forward + backward with ``loss = sum_i <out_i, g_i>`` over the floating
outputs, for fixed random ``g_i`` allocated before the step (i.e. ``torch.autograd.backward(outs,
gs)``), so the loss adds no memory of its own. After a warm-up step (gradients exist and are
zeroed in place), "activation memory" is ``torch.cuda.max_memory_allocated()`` during the step
minus ``torch.cuda.memory_allocated()`` just before the forward; "after forward" is the memory
held when the forward returns (saved tensors + outputs; on the CPU, where there are no allocator
statistics, the storages made during the forward still alive after it). ms/step is the median over --reps of
CUDA-event-timed steps. graphopt runs only the ``insert_checkpoints`` pass by default (the
others change numerics/kernels and would blur the comparison; ``--passes fold_constants,fuse_attention,insert_checkpoints``
runs those (the captured GLM calls SDPA with a materialized causal mask, which these fold back to
``is_causal=True`` as eager calls it); ``--all-passes`` runs the whole
pipeline), with ``check_accuracy=False``, once per checkpoint backend (``--backend both``, the
default: the AOTAutograd graph rewrite and the selective checkpoint, one row each); its loss and gradients are compared with the eager
step directly (same seed): fp32 tolerance 1e-3, bf16 1e-2, as the relative L2 error of every
gradient, and allclose on the outputs.

Writes ``checkpoint_<date>_<device>.json`` and ``.md`` into --out, printing progress.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- models


def build_resnet50(tiny, device):
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.resnet50().to(device)
    batch, res = (2, 64) if tiny else (128, 224)
    x = torch.randn(batch, 3, res, res, device=device)
    return m, (x,), torch.float32, {"batch": batch, "resolution": res}


def resnet_sequential(m):
    return nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2, m.layer3, m.layer4,
                         m.avgpool, nn.Flatten(1), m.fc)


def build_glm(tiny, device, layers=8, batch=4, seq=2048):
    from transformers import Glm4ForCausalLM

    from graphopt.examples import zoo

    cfg = zoo.glm4_tiny_config() if tiny else zoo.glm4_9b_config(layers)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    if tiny:
        batch, seq = 2, 32
    torch.manual_seed(0)
    with torch.device(device):
        m = Glm4ForCausalLM(cfg).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    dtype = next(m.parameters()).dtype
    return m, (ids,), dtype, {"batch": batch, "seq_len": seq, "layers": cfg.num_hidden_layers,
                              "attention": "sdpa"}


# --------------------------------------------------------------------------- a training step


def _outs(out):
    leaves = pytree.tree_leaves(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


class Stepper:
    """One training step (forward, backward on fixed output gradients) of ``fn`` on ``args``."""

    def __init__(self, fn, args, params):
        self.fn, self.args, self.params = fn, args, list(params)
        self.grads_out = None
        self.after_forward = None

    def __call__(self, record=False):
        cuda = torch.cuda.is_available() and any(p.is_cuda for p in self.params)
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        if self.grads_out is None:  # the fixed output gradients, made once, before any timed step
            outs = _outs(self.fn(*self.args))
            if not outs:
                raise RuntimeError("the model returns no floating output that requires grad")
            gen = torch.Generator(device=outs[0].device).manual_seed(1234)
            self.grads_out = [torch.randn(o.shape, dtype=o.dtype, device=o.device, generator=gen) for o in outs]
            del outs
        if record and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        if record and not cuda:  # no allocator statistics: graphopt.tools.memtrace's exact tensor timeline
            from graphopt.tools.memtrace import MemoryTrace

            with MemoryTrace(record_ops=False) as tracer:
                out = self.fn(*self.args)
                outs = _outs(out)
                self.after_forward = tracer.live
                torch.autograd.backward(outs, self.grads_out)
                del out, outs
            return tracer.peak
        out = self.fn(*self.args)
        outs = _outs(out)
        if record and cuda:
            self.after_forward = torch.cuda.memory_allocated() - before
        torch.autograd.backward(outs, self.grads_out)
        del out, outs
        if record and cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        return None


def write_results(base, result: dict, markdown) -> str:
    """``base``.json (the result) and ``base``.md (``markdown(result)``); returns the Markdown."""
    base.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    base.with_suffix(".md").write_text(md)
    return md


def step_ms(stepper, reps, cuda):
    """Milliseconds of each of ``reps`` steps (CUDA events on a GPU, perf_counter on the CPU)."""
    times = []
    for _ in range(reps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            stepper()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            stepper()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(stepper, warmup, reps):
    """(activation bytes, bytes after forward, median ms/step)."""
    for _ in range(warmup):
        stepper()
    act = stepper(record=True)
    after = stepper.after_forward
    cuda = torch.cuda.is_available() and any(p.is_cuda for p in stepper.params)
    return act, after, statistics.median(step_ms(stepper, reps, cuda))


def kernel_profile(stepper, top=25, with_stack=False):
    """One step under torch.profiler: device time by kernel name and by the ATen op that launched it
    (ms, calls), largest first, and the total. Shows where a plan's extra time goes (recomputed
    convolutions, BatchNorm kernels, layout copies...)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        stepper()
        torch.cuda.synchronize()
    events = prof.events()
    device = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)

    def tally(into: dict, key: str, value: float) -> None:
        r = into.setdefault(key, [0.0, 0])
        r[0] += value
        r[1] += 1

    rows: dict = {}
    for e in device:
        tally(rows, e.name[:160], e.device_time / 1e3)  # device_time: microseconds
    total = sum(v[0] for v in rows.values())
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    # CUDA runtime calls on the host (a synchronize or a cudaMalloc stalls the queue: the GPU idles)
    runtime: dict = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda") and "Launch" not in e.name:
            tally(runtime, e.name, e.cpu_time_total / 1e3)
    # idle gaps on the GPU (> 20 us between one kernel's end and the next's start), by the kernel
    # that came late: where the host, not the device, set the pace
    gaps: dict = {}
    for before, after in zip(device, device[1:]):
        g = (after.time_range.start - before.time_range.end) / 1e3
        if g > 0.02:
            tally(gaps, after.name[:90], g)
    idle = sum(v[0] for v in gaps.values())
    averages = prof.key_averages()
    ops = sorted(((a.key, a.self_device_time_total / 1e3, a.count) for a in averages
                  if a.self_device_time_total > 0 and a.key.startswith("aten::")), key=lambda t: -t[1])[:top]
    return {"total_ms": total, "kernels": [{"name": k, "ms": v[0], "calls": v[1]} for k, v in ranked],
            "ops": [{"name": k, "ms": ms, "calls": c} for k, ms, c in ops],
            "runtime": [{"name": k, "host_ms": v[0], "calls": v[1]} for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][0])],
            "idle_ms": idle,
            # where the host's time goes (self CPU time by event: ATen ops, autograd nodes, hooks)
            "host": [{"name": a.key[:120], "ms": a.self_cpu_time_total / 1e3, "calls": a.count}
                     for a in sorted(averages, key=lambda a: -a.self_cpu_time_total)[:top]],
            "host_total_ms": sum(a.self_cpu_time_total for a in averages) / 1e3,
            "gaps_before": [{"name": k, "ms": v[0], "gaps": v[1]} for k, v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]]}


def one_step_grads(fn, args, params, grads_out, seed=0):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    outs = _outs(fn(*args))
    torch.autograd.backward(outs, grads_out)
    return [o.detach().float().clone() for o in outs], [p.grad.detach().float().clone() if p.grad is not None else None
                                                         for p in params]


def compare(a_outs, a_grads, b_outs, b_grads, tol, ref64=None):
    """Outputs allclose at tol, and the worst relative L2 error of any gradient. With ``ref64``
    (fp64 gradients and the eager step's RMSE against them), the accuracy rule (docs/design.md) on all
    gradients together also decides: rmse(a, fp64) <= 2 * rmse(eager, fp64) + tol / 10 (fp32)."""
    out_ok = all(torch.allclose(x, y, atol=tol, rtol=tol) for x, y in zip(a_outs, b_outs))
    worst = 0.0
    for x, y in zip(a_grads, b_grads):
        if x is None or y is None:
            if (x is None) != (y is None):
                worst = float("inf")
            continue
        worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-12)))
    out = {"outputs_allclose": out_ok, "worst_grad_rel_err": worst, "passed": out_ok and worst <= tol}
    if ref64 is not None and worst != float("inf"):
        grads64, eager_rmse = ref64
        rmse = _rmse64(a_grads, grads64)
        rule = math.isfinite(rmse) and rmse <= 2 * eager_rmse + tol / 10
        out.update({"grad_rmse_vs_fp64": rmse, "eager_grad_rmse_vs_fp64": eager_rmse, "fp64_rule_passed": rule})
        out["passed"] = out["passed"] or rule
    return out


def _rmse64(grads, grads64):
    """RMSE of all gradients together against the fp64 gradients."""
    sq = n = 0.0
    for x, y in zip(grads, grads64):
        if x is None or y is None:
            continue
        sq += float((x.double() - y).pow(2).sum())
        n += y.numel()
    return (sq / max(n, 1)) ** 0.5


def fp64_grads(model, inputs, grads_out):
    """The step's parameter gradients from an fp64 copy of ``model`` (the accuracy rule's reference)."""
    m64 = copy.deepcopy(model).double()
    args = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in inputs]
    params64 = list(m64.parameters())
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        outs = _outs(m64(*args))
        torch.autograd.backward(outs, [g.double() for g in grads_out])
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in params64]
    del m64, outs, params64
    return grads


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def gb(x):
    return None if x is None else x / 1e9


# --------------------------------------------------------------------------- configs


def run_budget_config(name, build, reference, budget, args, device):
    log(f"[{name}] building")
    model, inputs, dtype, shape = build(args.tiny, device)
    model.train()
    params = list(model.parameters())
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    row = {"config": name, "dtype": str(dtype).replace("torch.", ""), **shape, "budget": budget}

    eager = Stepper(model, inputs, params)
    act, after, ms = measure(eager, args.warmup, args.reps)
    row["eager"] = {"activation_gb": gb(act), "after_forward_gb": gb(after), "ms": ms}
    if args.profile and device.type == "cuda":
        row["eager"]["profile"] = kernel_profile(eager)
    log(f"[{name}] eager: activations {gb(act)} GB, {ms:.2f} ms/step")
    grads_out = eager.grads_out
    ref_outs, ref_grads = one_step_grads(model, inputs, params, grads_out)
    ref64 = None
    if args.fp64_check and dtype == torch.float32:
        g64 = fp64_grads(model, inputs, grads_out)
        ref64 = (g64, _rmse64(ref_grads, g64))
        log(f"[{name}] fp64 reference: eager gradients' RMSE {ref64[1]:.3e}")
        free()

    row["reference"] = None
    if not args.no_reference:
        ref_fn, ref_label = reference(model)
        stepper = Stepper(ref_fn, inputs, params)
        stepper.grads_out = grads_out
        act_r, after_r, ms_r = measure(stepper, args.warmup, args.reps)
        row["reference"] = {"name": ref_label, "activation_gb": gb(act_r), "after_forward_gb": gb(after_r), "ms": ms_r,
                            "time_ratio": ms_r / ms}
        if row["eager"]["activation_gb"]:
            row["reference"]["memory_ratio"] = act_r / 1e9 / row["eager"]["activation_gb"]
        log(f"[{name}] {ref_label}: activations {gb(act_r)} GB, {ms_r:.2f} ms/step")
        if ref_label.startswith("hf"):
            model.gradient_checkpointing_disable()
        del stepper, ref_fn
        free()

    row["graphopt"] = []
    for backend in args.backends:
        try:
            row["graphopt"].append(run_backend(name, model, inputs, params, grads_out, ref_outs, ref_grads, tol,
                                               budget, backend, ms, row["eager"]["activation_gb"], args, ref64))
        except Exception as e:  # keep the other backend's row
            import traceback

            traceback.print_exc()
            row["graphopt"].append({"backend": backend, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
        free()
    del model, inputs, params, ref_outs, ref_grads, eager, grads_out
    free()
    return row


def run_backend(name, model, inputs, params, grads_out, ref_outs, ref_grads, tol, budget, backend, eager_ms,
                eager_act_gb, args, ref64=None):
    """graphopt at ``budget`` with checkpoint_backend ``backend``: measured memory and time, and the
    loss/gradient check against the eager step."""
    import graphopt

    t0 = time.perf_counter()
    passes = None if args.all_passes else (args.passes.split(",") if args.passes else ["insert_checkpoints"])
    opt = graphopt.optimize(model, inputs, training=True, memory_budget=budget, check_accuracy=False,
                            passes=passes, cuda_graphs=False, model_name=name, checkpoint_backend=backend)
    opt_s = time.perf_counter() - t0
    try:
        res = opt.report.pass_result("insert_checkpoints")
    except KeyError:  # --passes without insert_checkpoints: the other passes' training step alone
        from graphopt.pipeline import PassResult

        res = PassResult("insert_checkpoints", status="not run")
    d = res.details
    log(f"[{name}/{backend}] optimized in {opt_s:.1f} s: {res.status}, backend {d.get('backend')}, {d.get('regions')} "
        f"regions, predicted saved {gb(d.get('baseline_saved_bytes'))} -> {gb(d.get('predicted_saved_bytes'))} GB"
        + (f", AOT forward saves {gb(d.get('aot_saved_bytes'))} GB" if d.get("backend") == "aot" else ""))
    model.train()
    stepper = Stepper(opt, inputs, params)
    stepper.grads_out = grads_out
    act_g, after_g, ms_g = measure(stepper, args.warmup, args.reps)
    prof = kernel_profile(stepper) if args.profile and torch.cuda.is_available() else None
    if prof is not None:  # the host's time by Python function too (the tracer slows the step: relative only)
        prof["host_traced"] = kernel_profile(stepper, with_stack=True)["host"]
    g_outs, g_grads = one_step_grads(opt, inputs, params, grads_out)
    check = compare(g_outs, g_grads, ref_outs, ref_grads, tol, ref64)
    out = {
        "backend": d.get("backend", backend), "asked": backend, "backend_reason": d.get("backend_reason"),
        "activation_gb": gb(act_g), "after_forward_gb": gb(after_g), "ms": ms_g, "optimize_s": opt_s,
        "status": res.status, "regions": d.get("regions"),
        "predicted_baseline_saved_gb": gb(d.get("baseline_saved_bytes")),
        "predicted_baseline_activation_gb": gb(d.get("baseline_activation_bytes")),
        "predicted_saved_gb": gb(d.get("predicted_saved_bytes")),
        "predicted_baseline_held_gb": gb(d.get("baseline_held_bytes")),
        "predicted_held_gb": gb(d.get("predicted_held_bytes")),
        "predicted_transient_gb": gb(d.get("recompute_transient_bytes")),
        "predicted_activation_gb": gb(d.get("predicted_activation_bytes")),
        "predicted_extra_ms": d.get("extra_ms"),
        "budget_gb": gb(d.get("budget_bytes")),
        "aot_saved_gb": gb(d.get("aot_saved_bytes")),
        "aot_recomputed_ops": d.get("aot_recomputed_ops"),
        "check": check,
        "segments": d.get("segments"),
    }
    if prof is not None:
        out["profile"] = prof
    if eager_act_gb:
        out["memory_ratio"] = act_g / 1e9 / eager_act_gb
    if act_g and out["predicted_activation_gb"]:
        # the memory-model check: predicted step activations within 15% of the measured peak
        out["activation_error"] = out["predicted_activation_gb"] / (act_g / 1e9) - 1
        out["within_15pct"] = abs(out["activation_error"]) <= 0.15
        out["within_budget"] = act_g / 1e9 <= out["budget_gb"]
    out["time_ratio"] = ms_g / eager_ms
    log(f"[{name}/{backend}] graphopt: activations {gb(act_g)} GB (predicted {out['predicted_activation_gb']}, budget "
        f"{out['budget_gb']}), {ms_g:.2f} ms/step ({ms_g / eager_ms:.3f}x), check {check}")
    del opt, stepper, g_outs, g_grads
    return out


def _grad_errors(grads, ref, params):
    """Relative L2 error of ``grads`` vs ``ref`` (lists aligned with params): global and worst
    per parameter (parameters with > 1024 elements; tiny ones are noise-dominated)."""
    num = den = 0.0
    worst, worst_name = 0.0, None
    for (pname, p), x, y in zip(params, grads, ref):
        if x is None or y is None:
            continue
        d = float((x.float() - y.float()).norm())
        n = float(y.float().norm())
        num += d * d
        den += n * n
        if p.numel() > 1024 and n > 0 and d / n > worst:
            worst, worst_name = d / n, pname
    return {"global_rel_err": (num ** 0.5) / max(den ** 0.5, 1e-30), "worst_param_rel_err": worst,
            "worst_param": worst_name}


def run_glm_diagnostic(args, device):
    """GLM numerics: gradients of eager bf16, the captured graph without checkpoints, and each
    checkpoint backend, against an fp32 eager copy (the high-precision reference) and against
    eager bf16, so capture numerics, recomputation and bf16 noise can be told apart."""
    import graphopt

    layers, batch, seq = (None, 2, 32) if args.tiny else (8, 1, 2048)
    log(f"[glm-diag] building (batch {batch}, seq {seq})")
    model, inputs, dtype, shape = build_glm(args.tiny, device, batch=batch, seq=seq, **({"layers": layers} if layers else {}))
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]

    def grads_of(fn, mdl_params):
        for p in mdl_params:
            p.grad = None
        torch.manual_seed(0)
        out = fn(*inputs)
        logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
        gen = torch.Generator(device=logits.device).manual_seed(1234)
        g = torch.randn(logits.shape, dtype=torch.float32, device=logits.device, generator=gen)
        torch.autograd.backward(logits, g.to(logits.dtype))
        del out, logits, g
        return [p.grad for p in mdl_params]

    ref32 = copy.deepcopy(model).float()
    ref32.train()
    p32 = list(ref32.parameters())
    g32 = [g.detach().clone() if g is not None else None for g in grads_of(ref32, p32)]
    del ref32, p32
    free()
    g_eager = [g.detach().clone() if g is not None else None for g in grads_of(model, params)]
    rows = [{"variant": "eager (bf16)" if dtype == torch.bfloat16 else "eager", "vs_fp32": _grad_errors(g_eager, g32, named),
             "vs_eager": {"global_rel_err": 0.0, "worst_param_rel_err": 0.0, "worst_param": None}}]
    log(f"[glm-diag] eager vs fp32: {rows[0]['vs_fp32']}")
    rows[0]["rmse_vs_fp32"] = eager_rmse = _rmse64(g_eager, g32)
    variants = [("captured graph, no checkpoints", dict(passes=[]))]
    passes = args.passes.split(",") if args.passes else ["insert_checkpoints"]
    budget = args.budget if args.budget is not None else (0.7 if args.tiny else 0.3)
    for b in args.backends:
        variants.append((f"checkpointed at {budget}, backend {b}" + ("" if passes == ["insert_checkpoints"] else
                                                                     f", passes {','.join(passes)}"),
                         dict(passes=passes, memory_budget=budget, checkpoint_backend=b)))
    for label, kw in variants:
        try:
            opt = graphopt.optimize(model, inputs, training=True, check_accuracy=False, cuda_graphs=False, **kw)
            model.train()
            g = grads_of(opt, params)
            row = {"variant": label, "vs_fp32": _grad_errors(g, g32, named), "vs_eager": _grad_errors(g, g_eager, named)}
            # the accuracy rule (docs/design.md) with the fp32 copy as the high-precision reference (bf16: k = 3, tol 1e-2)
            row["rmse_vs_fp32"] = _rmse64(g, g32)
            row["rule_passed"] = row["rmse_vs_fp32"] <= 3 * eager_rmse + 1e-3
            if kw.get("passes"):
                row["backend"] = opt.report.pass_result("insert_checkpoints").details.get("backend")
            del opt, g
        except Exception as e:
            import traceback

            traceback.print_exc()
            row = {"variant": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        log(f"[glm-diag] {row}")
        rows.append(row)
        free()
    del model, inputs, params, named, g32, g_eager
    free()
    return {"config": "glm4-9b" + (f"-{layers}l" if layers else "-tiny"), **shape, "rows": rows}


def resnet_reference(model):
    from torch.utils.checkpoint import checkpoint_sequential

    seq = resnet_sequential(model)
    # torchvision's in-place ReLUs modify a segment's checkpointed input: off for the reference
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU) and m.inplace]

    def run(x):
        for r in relus:
            r.inplace = False
        try:
            return checkpoint_sequential(seq, 4, x, use_reentrant=False)
        finally:
            for r in relus:
                r.inplace = True

    return run, "checkpoint_sequential(4 segments)"


def glm_reference(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, "hf gradient_checkpointing_enable()"


ZOO_GPU = [("resnet50", 32, None), ("bert-base", 32, None), ("vit_b_16", 32, None), ("glm4-9b-2l", 2, 1024)]
ZOO_TINY = [("resnet50", 2, None), ("bert-tiny", 4, None), ("vit-tiny", 4, None), ("glm4-tiny", 2, 16)]


def run_zoo(args, device):
    from graphopt.capture import capture
    from graphopt.cost.activations import ActivationModel
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.examples import zoo

    profile, _ = get_profile("h200" if device.type == "cuda" else "cpu")
    rows = []
    for name, batch, seq in (ZOO_TINY if args.tiny else ZOO_GPU):
        log(f"[zoo] {name} batch {batch}" + (f" seq {seq}" if seq else ""))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if name == "glm4-9b-2l":
            from transformers import Glm4ForCausalLM

            cfg = zoo.glm4_9b_config(2)
            torch.manual_seed(0)
            with torch.device(device):
                model = Glm4ForCausalLM(cfg).to(dtype)
            inputs = (torch.randint(0, cfg.vocab_size, (batch, seq), device=device),)
        else:
            model, inputs = zoo.get(name, batch=batch, seq_len=seq, dtype=dtype, device=device)
        model.train()
        t0 = time.perf_counter()
        gm = capture(model, inputs)
        am = ActivationModel.build(gm, CostModel(profile), device_kind=profile.kind)
        model_s = time.perf_counter() - t0
        del gm
        stepper = Stepper(model, inputs, model.parameters())
        stepper()  # warm-up: gradients exist
        act = stepper(record=True)
        after = stepper.after_forward
        pred_act = am.step_activation_bytes()
        pred_after = am.held_bytes()
        row = {"model": name, "batch": batch, "seq_len": seq, "dtype": str(dtype).replace("torch.", ""),
               "predicted_saved_gb": gb(am.baseline_saved_bytes()), "predicted_after_forward_gb": gb(pred_after),
               "measured_after_forward_gb": gb(after), "predicted_activation_gb": gb(pred_act),
               "measured_activation_gb": gb(act), "model_s": model_s}
        if act:
            row["activation_error"] = pred_act / act - 1
            row["within_15pct"] = abs(row["activation_error"]) <= 0.15
        if after:
            row["after_forward_error"] = pred_after / after - 1
        log(f"[zoo] {name}: predicted {gb(pred_act)} GB vs measured {gb(act)} GB activations; "
            f"after forward {gb(pred_after)} vs {gb(after)} GB")
        rows.append(row)
        del model, inputs, stepper, am
        free()
    return rows


# --------------------------------------------------------------------------- output


def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None else fmt.format(x)


def markdown(result):
    lines = [f"# Activation checkpointing benchmark ({result['date']}, {result['device']}, torch {result['torch']})", "",
             "loss = sum_i <out_i, g_i> with fixed random g_i (torch.autograd.backward(outs, gs)); activation memory = "
             "max_memory_allocated during the step - memory_allocated before the forward (after a warm-up step).", ""]
    if result["budget_configs"]:
        lines += ["| config | variant | activation GB | predicted GB (error) | ratio | after fwd GB (predicted) | ms/step | ratio | notes |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in result["budget_configs"]:
            e, ref = r["eager"], r["reference"]
            ok = [g for g in r["graphopt"] if "error" not in g]
            base_pred = next((g.get("predicted_baseline_held_gb") for g in ok), None)
            base_act = next((g.get("predicted_baseline_activation_gb") for g in ok), None)
            base_err = f" ({base_act / e['activation_gb'] - 1:+.1%})" if base_act and e["activation_gb"] else ""
            lines.append(f"| {r['config']} | eager | {_f(e['activation_gb'])} | {_f(base_act)}{base_err} | 1.00 | "
                         f"{_f(e['after_forward_gb'], '{:.3f}')} ({_f(base_pred, '{:.3f}')}) | {_f(e['ms'])} | 1.00 | |")
            if ref is not None:
                lines.append(f"| {r['config']} | {ref['name']} | {_f(ref['activation_gb'])} | | {_f(ref.get('memory_ratio'))} | "
                             f"{_f(ref['after_forward_gb'], '{:.3f}')} | {_f(ref['ms'])} | {_f(ref['time_ratio'], '{:.3f}')} | |")
            for g in r["graphopt"]:
                if "error" in g:
                    lines.append(f"| {r['config']} | graphopt ({g['backend']}) | | | | | | | FAILED: {g['error']} |")
                    continue
                ran = g["backend"] if g["backend"] == g["asked"] else f"{g['asked']} → ran {g['backend']}: {g.get('backend_reason')}"
                if g.get("status") == "not run":
                    ran = f"passes {result.get('passes')}, no checkpoints"
                aot_note = (f"AOT forward saves {_f(g['aot_saved_gb'])} GB, {g['aot_recomputed_ops']} ops rerun in backward; "
                            if g.get("aot_saved_gb") is not None else "")
                within = ("" if g.get("within_budget") is None else
                          ("measured peak within the budget; " if g["within_budget"] else "measured peak OVER the budget; "))
                notes = (f"budget {r['budget']} = {_f(g['budget_gb'])} GB of predicted {_f(g['predicted_baseline_activation_gb'])} GB "
                         f"step activations (saved {_f(g['predicted_baseline_saved_gb'])} GB); {within}"
                         f"predicted saved {_f(g['predicted_saved_gb'])} + transient {_f(g['predicted_transient_gb'])} GB; "
                         f"{aot_note}predicted +{_f(g['predicted_extra_ms'], '{:.1f}')} ms; {g['regions']} regions; "
                         + (f"outer checkpoints over regions {', '.join(f'{a}-{b}' for a, b in (x['regions'] for x in g['segments']))}; "
                            if g.get("segments") else "")
                         + f"optimize "
                         f"{_f(g['optimize_s'], '{:.1f}')} s; check {'passed' if g['check']['passed'] else 'FAILED'} "
                         f"(worst grad rel err vs eager {g['check']['worst_grad_rel_err']:.2e}"
                         + (f"; gradient RMSE vs fp64 {g['check']['grad_rmse_vs_fp64']:.3e}, eager's "
                            f"{g['check']['eager_grad_rmse_vs_fp64']:.3e}: accuracy rule "
                            f"{'passed' if g['check']['fp64_rule_passed'] else 'FAILED'}" if "fp64_rule_passed" in g["check"] else "")
                         + ")")
                err = f" ({g['activation_error']:+.1%})" if g.get("activation_error") is not None else ""
                lines.append(f"| {r['config']} | graphopt ({ran}) | {_f(g['activation_gb'])} | {_f(g['predicted_activation_gb'])}{err} | "
                             f"{_f(g.get('memory_ratio'))} | {_f(g['after_forward_gb'], '{:.3f}')} ({_f(g['predicted_held_gb'], '{:.3f}')}) | "
                             f"{_f(g['ms'])} | {_f(g['time_ratio'], '{:.3f}')} | {notes} |")
        lines.append("")
        for r in result["budget_configs"]:
            profiled = [("eager", r["eager"].get("profile"))] + [(f"graphopt ({g['backend']})", g.get("profile"))
                                                                 for g in r["graphopt"] if "error" not in g]
            for label, prof in profiled:
                if not prof:
                    continue
                head = f"{r['config']}, {label}: "
                for key, title, cols, col, n in (
                        ("kernels", f"device time by kernel in one step ({prof['total_ms']:.2f} ms in all)", "kernel | calls | ms", "ms", 15),
                        ("ops", "device time by ATen op (self)", "op | calls | ms", "ms", 15),
                        ("gaps_before", f"GPU idle gaps over 20 us ({prof.get('idle_ms', 0.0):.2f} ms in all), by the kernel "
                         "after the gap", "kernel | gaps | ms", "ms", 12),
                        ("runtime", "CUDA runtime calls on the host (not launches)", "call | calls | host ms", "host_ms", 10)):
                    if prof.get(key):
                        lines += ["", head + title, "", f"| {cols} |", "| --- | ---: | ---: |"]
                        lines += [f"| `{k['name']}` | {k.get('calls', k.get('gaps'))} | {k[col]:.2f} |" for k in prof[key][:n]]
            lines.append("")
    for diag in result.get("diagnostics", []):
        lines += ["", f"GLM gradient numerics ({diag['config']}, batch {diag['batch']}, seq {diag['seq_len']}): relative L2 "
                  "error of the parameter gradients, all parameters together (global) and the worst parameter with "
                  "> 1024 elements, against an fp32 eager copy and against eager in the model's dtype.", "",
                  "Accuracy rule (docs/design.md, the fp32 copy as the high-precision reference): gradient RMSE vs fp32 "
                  "<= 3 x eager's + 1e-3.", "",
                  "| variant | vs fp32: global | vs fp32: worst param | vs eager: global | vs eager: worst param | "
                  "RMSE vs fp32 | rule |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for d in diag["rows"]:
            if "error" in d:
                lines.append(f"| {d['variant']} | FAILED: {d['error']} | | | | | |")
                continue
            a, b = d["vs_fp32"], d["vs_eager"]
            rule = "" if "rule_passed" not in d else ("passed" if d["rule_passed"] else "FAILED")
            rmse = f"{d['rmse_vs_fp32']:.3e}" if d.get("rmse_vs_fp32") is not None else ""
            label = d["variant"] + (f" (ran {d['backend']})" if d.get("backend") else "")
            lines.append(f"| {label} | {a['global_rel_err']:.2e} | {a['worst_param_rel_err']:.2e} ({a['worst_param']}) | "
                         f"{b['global_rel_err']:.2e} | {b['worst_param_rel_err']:.2e} ({b['worst_param']}) | {rmse} | {rule} |")
        lines.append("")
    if result["zoo"]:
        lines += ["| model | batch | seq | dtype | predicted act GB | measured act GB | error | predicted after-fwd GB | "
                  "measured after-fwd GB | error |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for z in result["zoo"]:
            lines.append(f"| {z['model']} | {z['batch']} | {z['seq_len'] or ''} | {z['dtype']} | {_f(z['predicted_activation_gb'], '{:.3f}')} | "
                         f"{_f(z['measured_activation_gb'], '{:.3f}')} | {_f(z.get('activation_error'), '{:+.1%}')} | "
                         f"{_f(z['predicted_after_forward_gb'], '{:.3f}')} | {_f(z['measured_after_forward_gb'], '{:.3f}')} | "
                         f"{_f(z.get('after_forward_error'), '{:+.1%}')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the JSON + Markdown")
    ap.add_argument("--configs", default="resnet50,glm4,glm4-diag",
                    help="comma-separated subset of resnet50,glm4,glm4-diag,zoo")
    ap.add_argument("--backend", default="both", choices=("aot", "sac", "auto", "both"),
                    help="checkpoint backend(s) for graphopt's rows: aot, sac, auto, or both (aot and sac)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized models (a dry run)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--all-passes", action="store_true", help="run graphopt's whole pipeline, not only insert_checkpoints")
    ap.add_argument("--passes", default=None, help="comma-separated passes to run (default: insert_checkpoints)")
    ap.add_argument("--device", default=None, help="default: cuda if present (else cpu)")
    ap.add_argument("--budget", type=float, default=None,
                    help="memory budget for the budget configs (default: resnet50 0.4, glm4 0.3; --tiny 0.97 / 0.7)")
    ap.add_argument("--fp64-check", action="store_true",
                    help="fp32 configs: also judge the gradients by the accuracy rule against an fp64 copy's")
    ap.add_argument("--profile", action="store_true",
                    help="on a GPU: device time by kernel for one eager and one graphopt step (in the JSON and Markdown)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the reference row (checkpoint_sequential / Hugging Face per-layer checkpointing)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.backends = ["aot", "sac"] if args.backend == "both" else [args.backend]
    unknown = [c for c in configs if c not in ("resnet50", "glm4", "glm4-diag", "zoo")]
    if unknown:
        ap.error(f"unknown config(s) {unknown}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": name,
              "torch": torch.__version__, "tiny": args.tiny, "reps": args.reps, "budget_configs": [], "zoo": [],
              "diagnostics": [], "backends": args.backends, "errors": [],
              "passes": "all" if args.all_passes else (args.passes or "insert_checkpoints")}
    t_all = time.perf_counter()
    for c in configs:
        try:
            if c == "resnet50":
                # (the CPU stand-in's step is mostly parameter gradients: only a budget near 1 is reachable)
                result["budget_configs"].append(run_budget_config("resnet50", build_resnet50, resnet_reference,
                                                                  args.budget or (0.97 if args.tiny else 0.4), args, device))
            elif c == "glm4":
                # the 2-layer CPU stand-in cannot reach 0.3 (too few layers to cut between)
                result["budget_configs"].append(run_budget_config("glm4-9b-8l", build_glm, glm_reference,
                                                                  args.budget or (0.7 if args.tiny else 0.3), args, device))
            elif c == "glm4-diag":
                result["diagnostics"].append(run_glm_diagnostic(args, device))
            else:
                result["zoo"] = run_zoo(args, device)
        except Exception as e:  # keep the other configs' results
            import traceback

            traceback.print_exc()
            result["errors"].append(f"{c}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            free()
    result["seconds"] = time.perf_counter() - t_all
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    tag = "cpu" if device.type == "cpu" else "".join(ch for ch in name.lower().split()[-1] if ch.isalnum())
    md = write_results(out / f"checkpoint_{stamp}_{tag}", result, markdown)
    log(md)
    log(f"wrote {out}/checkpoint_{stamp}_{tag}.json and .md in {result['seconds']:.0f} s")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
