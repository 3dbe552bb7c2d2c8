# Answered: Where does a bs1 call's wall time go? BERT-base: ~0.4 us idle in front of each of 98 kernels, 90-91% busy back to back; ResNet-50 92-93% (results/archive/diag_busy_2026-11-30_172826.md).
"""Where a small-batch call's wall time goes (issue 5: GPU busy >= 90% at bs1).

    python benchmarks/diag/diag_busy.py --out DIR [--models resnet50:1,bert-base:1:128]

For each model (bf16, optimized with graphopt's defaults) it times, with CUDA events:

* *call*: one call of the optimized module, the GPU idle before it (how bench.py times latency);
* *replay*: the module's CUDA graph replayed alone (no Python wrapper, no input copy, no clone);
* *loop*: 50 calls back to back, divided by 50 (the host can run ahead of the GPU);
* *python*: the host time of one call (perf_counter, no sync), and of the runner's parts;

and, from torch.profiler over 5 calls, the device activity per call (union of kernel/copy
intervals), kernels per call and the idle time between consecutive kernels inside the replay.
busy = device activity / call. Writes diag_busy_<date>.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import diag_resnet_convs  # noqa: E402  (its CUDA-event timer)

import graphopt  # noqa: E402
from optimize_time import parse_models  # noqa: E402  (MODEL:BATCH:SEQ items)
from graphopt.tools.bench import parse_dtype, prepare_model, time_call  # noqa: E402
from graphopt.tools.measure import _device_intervals, _union  # noqa: E402


def _events(fn, reps=30, warmup=5, inner=1) -> float:
    """Median seconds per call, ``inner`` back-to-back calls between two CUDA events."""
    for _ in range(warmup):
        fn()
    return diag_resnet_convs._time(fn, torch.device("cuda"), reps, inner) / 1e3


def _host(fn, reps=50) -> float:
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return statistics.median(out)


VARIANTS = ("default", "no-splitk", "no-cudnn-sdpa")


def _set_variant(variant: str) -> None:
    """Library settings read when a kernel is launched, so they decide what a CUDA graph captures:
    ``no-splitk``: cuBLASLt's bf16 GEMMs without split-K (torch's reduction-scheme mask);
    ``no-cudnn-sdpa``: SDPA dispatches to the flash / memory-efficient kernels instead of cuDNN's."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = \
        (False, False) if variant == "no-splitk" else (True, True)
    torch.backends.cuda.enable_cudnn_sdp(variant != "no-cudnn-sdpa")


def run(spec, batch, seq, dtype, variant: str = "default") -> dict:
    dev = torch.device("cuda")
    _set_variant(variant)
    model, args, kwargs, name, _ = prepare_model(spec, batch, seq, dtype, dev)
    opt = graphopt.optimize(model, (args, kwargs), model_name=name)
    call = lambda: opt(*args, **kwargs)  # noqa: E731
    row = {"model": name + ("" if variant == "default" else f" ({variant})"), "batch": batch, "seq_len": seq,
           "passes": {p.name: p.status + (f" ({p.notes[0][:160]})" if p.notes else "")
                      for p in opt.report.passes if p.status not in ("unchanged", "skipped", "disabled")},
           "accuracy": {k: opt.report.accuracy.get(k) for k in ("passed", "mode", "reason")},
           "sdpa_nodes": sum(1 for n in opt.graph_module.graph.nodes
                             if n.target is torch.ops.aten.scaled_dot_product_attention.default)}
    with torch.inference_mode():
        row["call_ms"] = statistics.median(time_call(call, reps=30, warmup=5, device=dev)) * 1e3
        row["loop_ms"] = _events(call, reps=5, warmup=3, inner=50) * 1e3
        row["host_call_ms"] = _host(call) * 1e3
        runner = getattr(opt, "runner", None)
        graphs = list(getattr(runner, "_graphs", {}).values()) if runner is not None else []
        row["execution"] = "graphed" if graphs else "eager"
        if graphs:
            g = graphs[-1].graph
            row["replay_ms"] = _events(g.replay) * 1e3
            row["host_replay_ms"] = _host(g.replay) * 1e3
            row["replay_loop_ms"] = _events(g.replay, reps=5, warmup=3, inner=50) * 1e3
        import cProfile
        import io
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(300):
            call()
        prof_host.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(25)
        row["host_profile"] = buf.getvalue()
        from torch.profiler import ProfilerActivity, profile

        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
                torch.cuda.synchronize()
        iv = sorted(_device_intervals(prof))
    row["device_ms"] = _union(iv) / 1e3 / 5
    row["kernels_per_call"] = len(iv) / 5
    # idle gaps between consecutive device intervals shorter than 50 us (inside one call)
    gaps = [b[0] - a[1] for a, b in zip(iv, iv[1:]) if 0 < b[0] - a[1] < 50]
    row["inner_gap_ms"] = sum(gaps) / 1e3 / 5
    row["inner_gaps"] = len(gaps) / 5
    row["busy_call"] = row["device_ms"] / row["call_ms"]
    row["busy_loop"] = row["device_ms"] / row["loop_ms"]
    names = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            d = e.time_range.end - e.time_range.start
            k = e.name[:70]
            names[k] = names.get(k, 0) + d / 5
    row["top_kernels_us"] = sorted(names.items(), key=lambda t: -t[1])[:12]
    # the idle time in front of each kernel (inside a call), summed per kernel name
    ev = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")
                and e.time_range.end > e.time_range.start)
    before = {}
    for a, b in zip(ev, ev[1:]):
        g = b[0] - a[1]
        if 0 < g < 50:
            k = before.setdefault(b[2], [0.0, 0])
            k[0] += g / 5
            k[1] += 1 / 5
    row["gap_before_us"] = sorted(([k, round(v[0], 2), v[1]] for k, v in before.items()), key=lambda t: -t[1])[:12]
    _set_variant("default")
    print(json.dumps({k: v for k, v in row.items() if k not in ("top_kernels_us", "host_profile", "gap_before_us")}),
          flush=True)
    del opt, model
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50:1,bert-base:1:128")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="default", help="comma-separated, of " + ", ".join(VARIANTS)
                   + " (library settings while the model is optimized and its graphs captured)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("diag_busy: needs a CUDA device")
    rows = []
    for spec, batch, seq in parse_models(a.models):
        for v in a.variants.split(","):
            if v not in VARIANTS:
                raise SystemExit(f"diag_busy: unknown variant {v!r}; one of {', '.join(VARIANTS)}")
            rows.append(run(spec, batch, seq, parse_dtype(a.dtype), variant=v))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    head = (f"# bs1 wall time and GPU busy — {torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp}\n\n"
            "| model | batch | runs | call ms | loop ms | replay ms | replay loop ms | host per call ms | host per replay ms "
            "| device ms | kernels | inner gaps ms | busy (call) | busy (loop) |\n"
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    lines = []
    for r in rows:
        f = lambda k: f"{r[k]:.3f}" if isinstance(r.get(k), float) else "—"  # noqa: E731
        lines.append(f"| {r['model']} | {r['batch']} | {r['execution']} | {f('call_ms')} | {f('loop_ms')} | {f('replay_ms')} "
                     f"| {f('replay_loop_ms')} | {f('host_call_ms')} | {f('host_replay_ms')} | {f('device_ms')} "
                     f"| {r['kernels_per_call']:.0f} | {f('inner_gap_ms')} | {r['busy_call']:.0%} | {r['busy_loop']:.0%} |")
    detail = []
    for r in rows:
        detail += ["", f"## {r['model']}: {r['sdpa_nodes']} SDPA nodes; accuracy {json.dumps(r['accuracy'])}; passes "
                   + json.dumps(r["passes"]), "", "top kernels (µs per call)", ""] + [f"- {us:.1f} `{k}`" for k, us in r["top_kernels_us"]]
        detail += ["", "idle time in front of each kernel (µs per call, gaps per call)", ""] + [
            f"- {us:.1f} ({n:.0f}) `{k}`" for k, us, n in r["gap_before_us"]]
    (out / f"diag_busy_{stamp}_host.txt").write_text("\n\n".join(f"## {r['model']}\n{r.pop('host_profile')}" for r in rows))
    (out / f"diag_busy_{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"diag_busy_{stamp}.md").write_text(head + "\n".join(lines) + "\n" + "\n".join(detail) + "\n")
    print(head + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
