"""Can the SwiGLU kernel be folded into a GEMM on the H200 (issue 4: GLM bs8 within 15% of its floor)?

    python benchmarks/diag_swiglu_gemm.py --out DIR [--tokens 8192,1024]

GLM-4's MLP is ``gate_up = x @ Wgu.T`` (cuBLAS), ``act = silu(gate) * up`` (graphopt::swiglu, 0.17 ms a
layer at bs8, at the copy rate) and ``act @ Wd.T`` (cuBLAS). Triton GEMMs from
``cuda_ext/gemm_triton.py`` can drop the middle kernel, as an epilogue of the first GEMM or a prologue of
the second, but only pay if Triton's GEMM is within the SwiGLU kernel's time of cuBLAS's. This times,
per token count:

* each Triton kernel over a few tile configurations (burst: queued behind a GPU sleep);
* the best of each against cuBLAS, and the three whole MLPs (unfused, epilogue, prologue), each
  replayed from a CUDA graph back to back for 3 s so the 700 W power cap has set the clock, the last
  second timed;
* the fused results against an fp64 reference (max error relative to the output's max).

Writes diag_swiglu_gemm_<date>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cuda_median_ms  # noqa: E402

HIDDEN, FFN = 4096, 13696
CONFIGS = {
    "gemm": [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8)],
    "gemm_swiglu": [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 8), (128, 64, 64, 5, 4),
                    (64, 128, 64, 4, 4)],
    "swiglu_gemm": [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 256, 64, 4, 8), (128, 128, 64, 3, 8)],
}


def burst_ms(fn) -> float:
    return cuda_median_ms(fn, reps=15, warmup=3, sleep_cycles=2_000_000)


def sustained_ms(fn, calls: int = 10, seconds: float = 3.0) -> float:
    """Median ms per call of ``fn`` replayed from a CUDA graph back to back for ``seconds``, over the
    replays of the last third."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    t0, times = time.perf_counter(), []
    while time.perf_counter() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append((time.perf_counter() - t0, a.elapsed_time(b) / calls))
    late = sorted(ms for t, ms in times if t > seconds * 2 / 3)
    return late[len(late) // 2]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="8192,1024")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from graphopt.cuda_ext import gemm_triton as gt
    from graphopt.cuda_ext import ops

    torch.manual_seed(0)
    dev = torch.device("cuda")
    wgu = (torch.randn(2 * FFN, HIDDEN, device=dev) / HIDDEN ** 0.5).bfloat16()
    wd = (torch.randn(HIDDEN, FFN, device=dev) / FFN ** 0.5).bfloat16()
    rows, sweeps = [], []
    for m in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(m, HIDDEN, device=dev).bfloat16()
        gu = F.linear(x, wgu)
        act = ops.swiglu(gu)
        shapes = {"gemm": (x, wgu, 2 * m * HIDDEN * 2 * FFN), "gemm_swiglu": (x, wgu, 2 * m * HIDDEN * 2 * FFN),
                  "swiglu_gemm": (gu, wd, 2 * m * FFN * HIDDEN), "gemm down": (act, wd, 2 * m * FFN * HIDDEN)}
        best = {}
        for kind, configs in list(CONFIGS.items()) + [("gemm down", CONFIGS["gemm"])]:
            first, second, flops = shapes[kind]
            fn = getattr(gt, kind.split()[0])
            for cfg in configs:
                try:
                    ms = burst_ms(lambda: fn(first, second, cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
                    sweeps.append({"tokens": m, "kernel": kind, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    print(f"{m} {kind} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                sweeps.append({"tokens": m, "kernel": kind, "config": cfg, "ms": ms, "tflops": flops / ms / 1e9})
                print(f"{m} {kind} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                if kind not in best or ms < best[kind][1]:
                    best[kind] = (cfg, ms)
        cfg = {k: v[0] for k, v in best.items()}
        # accuracy of the fused forms against fp64
        ref_gu = x.double() @ wgu.double().T
        ref_act = F.silu(ref_gu[:, :FFN]) * ref_gu[:, FFN:]
        err = {"cublas+swiglu": rel_err(act, ref_act)}
        if "gemm_swiglu" in cfg:
            err["gemm_swiglu"] = rel_err(gt.gemm_swiglu(x, wgu, cfg["gemm_swiglu"]), ref_act)
        ref_down = act.double() @ wd.double().T
        err["cublas down (same act)"] = rel_err(F.linear(act, wd), ref_down)
        if "swiglu_gemm" in cfg:
            err["swiglu_gemm (same act)"] = rel_err(gt.swiglu_gemm(gu, wd, cfg["swiglu_gemm"]), ref_down)
        variants = {
            "cublas gate_up": lambda: F.linear(x, wgu),
            "swiglu kernel": lambda: ops.swiglu(gu),
            "cublas down": lambda: F.linear(act, wd),
            "MLP unfused (cublas, swiglu, cublas)": lambda: F.linear(ops.swiglu(F.linear(x, wgu)), wd),
        }
        if "gemm" in cfg:
            variants["triton gate_up"] = lambda: gt.gemm(x, wgu, cfg["gemm"])
        if "gemm down" in cfg:
            variants["triton down"] = lambda: gt.gemm(act, wd, cfg["gemm down"])
        if "gemm_swiglu" in cfg:
            variants["triton gate_up+swiglu"] = lambda: gt.gemm_swiglu(x, wgu, cfg["gemm_swiglu"])
            variants["MLP epilogue (triton gate_up+swiglu, cublas down)"] = lambda: F.linear(gt.gemm_swiglu(x, wgu, cfg["gemm_swiglu"]), wd)
        if "swiglu_gemm" in cfg:
            variants["triton swiglu+down"] = lambda: gt.swiglu_gemm(gu, wd, cfg["swiglu_gemm"])
            variants["MLP prologue (cublas gate_up, triton swiglu+down)"] = lambda: gt.swiglu_gemm(F.linear(x, wgu), wd, cfg["swiglu_gemm"])
        for name, fn in variants.items():
            b = burst_ms(fn)
            s = sustained_ms(fn)
            rows.append({"tokens": m, "variant": name, "burst_ms": b, "sustained_ms": s})
            print(f"{m} {name}: burst {b:.3f} sustained {s:.3f}", flush=True)
        rows.append({"tokens": m, "variant": "errors", "errors": err, "configs": {k: list(v) for k, v in cfg.items()}})
        print(m, err, cfg, flush=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": stamp}
    import triton

    meta["triton"] = triton.__version__
    (out / f"diag_swiglu_gemm_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows, "sweeps": sweeps}, indent=1))
    lines = [f"# SwiGLU folded into a Triton GEMM ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {stamp})", "",
             "| tokens | variant | burst ms | sustained ms (3 s back to back, last second) |", "| ---: | --- | ---: | ---: |"]
    for r in rows:
        if "burst_ms" in r:
            lines.append(f"| {r['tokens']} | {r['variant']} | {r['burst_ms']:.3f} | {r['sustained_ms']:.3f} |")
    lines += ["", "Errors against fp64 (max abs / max |ref|) and the chosen configs (BM, BN, BK, stages, warps):", ""]
    lines += [f"- {r['tokens']}: {r['errors']}; {r['configs']}" for r in rows if "errors" in r]
    lines += ["", "| tokens | kernel | config | burst ms | TFLOP/s |", "| ---: | --- | --- | ---: | ---: |"]
    for s in sweeps:
        lines.append(f"| {s['tokens']} | {s['kernel']} | {s['config']} | {s.get('ms', float('nan')):.3f} | "
                     f"{s.get('tflops', 0):.0f} {s.get('error', '')} |")
    (out / f"diag_swiglu_gemm_{stamp}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
