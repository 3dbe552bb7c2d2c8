# Answered: Which SDPA backend runs our attention, and what does each take? cuDNN (8.7 us at BERT bs1); its device times fit the profile's attention efficiency (results/archive/diag_sdpa_2026-11-30_045427.md).
"""Which SDPA back end the optimized graph's attention runs on, and what each would take.

    python benchmarks/diag/diag_sdpa.py --out DIR [--models bert-base:1:128,bert-base:64:128]

For each model (bf16, optimized with graphopt's defaults, CUDA graphs off) the first
scaled_dot_product_attention node's actual inputs are recorded; the call is then timed under each
back end torch offers (flash, memory-efficient, cuDNN, math; a back end that refuses the inputs is
reported with torch's reason) and once with torch's own choice, whose kernels the profiler names.
Writes diag_sdpa_<date>.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optimize_time import parse_models  # noqa: E402  (MODEL:BATCH:SEQ items)
from graphopt.tools.bench import prepare_model, parse_dtype  # noqa: E402

import diag_gemm  # noqa: E402  (its queued timer)
from _timing import captured  # noqa: E402

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _Record(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.call = None

    def call_function(self, target, args, kwargs):
        if target is SDPA and self.call is None:
            self.call = (args, dict(kwargs))
        return super().call_function(target, args, kwargs)


def _time(fn, reps=20) -> float:
    """Median µs per call, each call queued behind a GPU sleep (diag_gemm's timer)."""
    return diag_gemm.timed(fn, reps=reps) * 1e6


def _describe(t):
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{tuple(t.shape)} {str(t.dtype)[6:]} strides {tuple(t.stride())}"


def run(spec, batch, seq, dtype) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    model, args, kwargs, name, _ = prepare_model(spec, batch, seq, dtype, dev)
    opt = graphopt.optimize(model, (args, kwargs), model_name=name, cuda_graphs=False, check_accuracy=False)
    rec = _Record(opt.graph_module)
    with torch.inference_mode():
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        rec.run(*flat)
    row = {"model": name, "batch": batch, "seq_len": seq, "sdpa_nodes": sum(
        1 for n in opt.graph_module.graph.nodes if n.target is SDPA)}
    if rec.call is None:
        row["note"] = "no SDPA node in the optimized graph"
        return row
    a, k = rec.call
    row["inputs"] = [_describe(x) for x in a] + [f"{key}={v}" for key, v in k.items()]
    call = lambda: F.scaled_dot_product_attention(*a, **k)  # noqa: E731
    with torch.inference_mode():
        row["default_us"] = _time(call)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        row["default_kernels"] = sorted({e.name[:90] for e in prof.events()
                                         if str(getattr(e, "device_type", "")).endswith("CUDA")})
        # the same call captured in a CUDA graph (as the optimized module replays it): which kernels?
        g = captured(call)
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        import time as _t

        hs = []
        for _ in range(50):
            t0 = _t.perf_counter()
            g.replay()
            hs.append(_t.perf_counter() - t0)
            torch.cuda.synchronize()
        row["graph_replay_host_us"] = statistics.median(hs) * 1e6
        row["graphed_kernels"] = sorted({e.name[:90] for e in prof.events()
                                         if str(getattr(e, "device_type", "")).endswith("CUDA")})
        # and the optimized module as optimize() returns it by default (guard on, CUDA graphs auto)
        opt2 = graphopt.optimize(model, (args, kwargs), model_name=name)
        row["default_optimize"] = {"sdpa_nodes": sum(1 for n in opt2.graph_module.graph.nodes if n.target is SDPA),
                                   "passes": {p.name: p.status for p in opt2.report.passes if p.status not in ("unchanged", "skipped")},
                                   "accuracy": {k: opt2.report.accuracy.get(k) for k in ("passed", "mode", "reason")}}
        opt2(*args, **kwargs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt2(*args, **kwargs)
            torch.cuda.synchronize()
        names = {}
        for e in prof.events():
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                names[e.name[:80]] = names.get(e.name[:80], 0) + 1
        row["default_optimize"]["kernels"] = sorted(names.items(), key=lambda t: -t[1])[:14]
        del opt2
        row["backends"] = {}
        for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([b]):
                        us = _time(call)
                    row["backends"][b.name] = {"us": us}
                except RuntimeError as e:
                    row["backends"][b.name] = {"error": str(e).splitlines()[0][:160],
                                               "why": [str(w.message)[:200] for w in caught][:4]}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert-base:1:128,bert-base:64:128")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = []
    for spec, batch, seq in parse_models(a.models):
        rows.append(run(spec, batch, seq, parse_dtype(a.dtype)))
        torch.cuda.empty_cache()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# SDPA back ends for the optimized graphs' attention — {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    for r in rows:
        md += [f"## {r['model']} bs{r['batch']} seq{r['seq_len']}: {r.get('sdpa_nodes', 0)} SDPA nodes", ""]
        if "inputs" not in r:
            md += [r.get("note", ""), ""]
            continue
        md += ["inputs: " + "; ".join(r["inputs"]), "",
               f"torch's choice: {r['default_us']:.1f} µs, kernels: " + ", ".join(f"`{k}`" for k in r["default_kernels"]), "",
               f"in a CUDA graph (host {r['graph_replay_host_us']:.1f} µs per replay): " + ", ".join(f"`{k}`" for k in r["graphed_kernels"]), "",
               "optimize() defaults: " + json.dumps(r["default_optimize"]), "",
               "| back end | µs | refused because |", "| --- | ---: | --- |"]
        for b, v in r["backends"].items():
            md.append(f"| {b} | {v['us']:.1f} |  |" if "us" in v else f"| {b} | — | {v['error']} {' / '.join(v['why'])} |")
        md.append("")
    (out / f"diag_sdpa_{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"diag_sdpa_{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
