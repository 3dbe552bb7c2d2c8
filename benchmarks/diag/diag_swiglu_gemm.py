# Answered: Can SwiGLU ride a GEMM epilogue as fast as cuBLAS? Yes, a persistent TMA Triton GEMM: GLM bs8 MLP 4.085 against 4.289 ms: lower_gemm_swiglu (results/archive/diag_swiglu_gemm_2026-11-30_185919.md).
"""Can the SwiGLU kernel be folded into a GEMM on the H200 (issue 4: GLM bs8 within 15% of its floor)?

    python benchmarks/diag/diag_swiglu_gemm.py --out DIR [--tokens 8192,1024]

GLM-4's MLP is ``gate_up = x @ Wgu.T`` (cuBLAS), ``act = silu(gate) * up`` (graphopt::swiglu, 0.17 ms a
layer at bs8, at the copy rate) and ``act @ Wd.T`` (cuBLAS). The Triton GEMM of
``cuda_ext/gemm_triton.py`` can drop the middle kernel as the first GEMM's epilogue, but that only pays
if Triton's GEMM is within the SwiGLU kernel's time of cuBLAS's. This times, per token count:

* the Triton kernels over a few tile configurations (burst: queued behind a GPU sleep);
* the best of each against cuBLAS, and the whole MLPs (unfused, epilogue), each replayed from a CUDA
  graph back to back for 3 s so the 700 W power cap has set the clock, the last second timed; at the
  first token count also the decoder's other GEMMs (vocabulary, QKV, O), plain;
* the fused result against an fp64 reference (max error relative to the output's max).

The first run (commit 6b513ed) also tried the epilogue as two accumulators, gate and up, each [128, 128]
(628 TFLOP/s against the plain GEMM's 795), and SwiGLU as the down projection's prologue, the A operand
formed in registers (376 TFLOP/s); both are gone.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import captured, cuda_median_ms  # noqa: E402

HIDDEN, FFN = 4096, 13696
CONFIGS = {  # (BM, BN, BK, stages, warps); BN is the output tile's width (gemm_swiglu multiplies 2 BN)
    "gemm": [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8)],
    "gemm_swiglu": [(128, 128, 64, 3, 8), (128, 64, 64, 4, 8), (256, 64, 64, 3, 8), (128, 128, 32, 5, 8),
                    (64, 128, 64, 4, 4)],
}
OTHER = {"lm_head": (4096, 151552), "qkv": (4096, 4608), "o_proj": (4096, 4096)}  # (K, N), plain, first M only


def burst_ms(fn) -> float:
    return cuda_median_ms(fn, reps=15, warmup=3, sleep_cycles=2_000_000)


def sustained(fn, calls: int = 10, seconds: float = 3.0) -> dict:
    """``fn`` replayed from a CUDA graph back to back for ``seconds``: the median ms per call over the
    replays of the last third, and the board power (W) and SM clock (MHz) nvidia-smi's library
    reported then (None where it is not installed)."""
    g = captured(fn, calls)
    torch.cuda.synchronize()
    t0, times, watts, mhz = time.perf_counter(), [], [], []
    while time.perf_counter() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        late = time.perf_counter() - t0 > seconds * 2 / 3
        if late:
            try:
                watts.append(torch.cuda.power_draw() / 1e3)
                mhz.append(torch.cuda.clock_rate())
            except Exception:  # noqa: BLE001 - pynvml missing: time only
                pass
        b.synchronize()
        if late:
            times.append(a.elapsed_time(b) / calls)
    times.sort()
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {"ms": times[len(times) // 2], "watts": mean(watts), "mhz": mean(mhz)}


def sustained_ms(fn, calls: int = 10, seconds: float = 3.0) -> float:
    return sustained(fn, calls, seconds)["ms"]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="8192,1024")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from graphopt.cuda_ext import gemm_triton as gt
    import graphopt.cuda_ext as ce
    from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up

    torch.manual_seed(0)
    dev = torch.device("cuda")
    wgu = (torch.randn(2 * FFN, HIDDEN, device=dev) / HIDDEN ** 0.5).bfloat16()
    wd = (torch.randn(HIDDEN, FFN, device=dev) / FFN ** 0.5).bfloat16()
    rows, sweeps = [], []
    tokens = [int(t) for t in a.tokens.split(",")]
    first_m = tokens[0]
    for m in tokens:
        x = torch.randn(m, HIDDEN, device=dev).bfloat16()
        gu = F.linear(x, wgu)
        act = ce.swiglu(gu)
        shapes = {"gemm": (x, wgu, 2 * m * HIDDEN * 2 * FFN), "gemm down": (act, wd, 2 * m * FFN * HIDDEN)}
        best = {}
        for kind, configs in list(CONFIGS.items()) + [("gemm down", CONFIGS["gemm"])]:
            first, second, flops = shapes.get(kind, shapes["gemm"])
            for cfg in configs:
                if kind == "gemm_swiglu":
                    wil = interleave_gate_up(wgu, cfg[1])
                    fn = lambda: gt.gemm_swiglu(x, wil, FFN, cfg)  # noqa: E731
                else:
                    fn = lambda: gt.gemm(first, second, cfg)  # noqa: E731
                try:
                    ms = burst_ms(fn)
                except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
                    sweeps.append({"tokens": m, "kernel": kind, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    print(f"{m} {kind} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                sweeps.append({"tokens": m, "kernel": kind, "config": cfg, "ms": ms, "tflops": flops / ms / 1e9})
                print(f"{m} {kind} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                if kind not in best or ms < best[kind][1]:
                    best[kind] = (cfg, ms)
        cfg = {k: v[0] for k, v in best.items()}
        # accuracy of the fused form against fp64
        ref_gu = x.double() @ wgu.double().T
        ref_act = F.silu(ref_gu[:, :FFN]) * ref_gu[:, FFN:]
        err = {"cublas+swiglu": rel_err(act, ref_act)}
        del ref_gu
        variants = {
            "cublas gate_up": lambda: F.linear(x, wgu),
            "swiglu kernel": lambda: ce.swiglu(gu),
            "cublas down": lambda: F.linear(act, wd),
            "MLP unfused (cublas, swiglu, cublas)": lambda: F.linear(ce.swiglu(F.linear(x, wgu)), wd),
        }
        if "gemm" in cfg:
            variants["triton gate_up"] = lambda: gt.gemm(x, wgu, cfg["gemm"])
        if "gemm down" in cfg:
            variants["triton down"] = lambda: gt.gemm(act, wd, cfg["gemm down"])
        if "gemm_swiglu" in cfg:
            wil = interleave_gate_up(wgu, cfg["gemm_swiglu"][1])
            err["gemm_swiglu"] = rel_err(gt.gemm_swiglu(x, wil, FFN, cfg["gemm_swiglu"]), ref_act)
            variants["triton gate_up+swiglu"] = lambda: gt.gemm_swiglu(x, wil, FFN, cfg["gemm_swiglu"])
            variants["MLP epilogue (triton gate_up+swiglu, cublas down)"] = lambda: F.linear(gt.gemm_swiglu(x, wil, FFN, cfg["gemm_swiglu"]), wd)
            if "gemm down" in cfg:
                variants["MLP all triton (gate_up+swiglu, down)"] = lambda: gt.gemm(gt.gemm_swiglu(x, wil, FFN, cfg["gemm_swiglu"]), wd, cfg["gemm down"])
        del ref_act
        if m == first_m:  # the decoder's other GEMMs, plain: cuBLAS against the best plain Triton config
            for name, (k, n) in OTHER.items():
                wo = (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16()
                variants[f"cublas {name}"] = (lambda wo=wo: F.linear(x, wo))
                variants[f"triton {name}"] = (lambda wo=wo: gt.gemm(x, wo, cfg.get("gemm")))
        for name, fn in variants.items():
            b = burst_ms(fn)
            s = sustained_ms(fn)
            rows.append({"tokens": m, "variant": name, "burst_ms": b, "sustained_ms": s})
            print(f"{m} {name}: burst {b:.3f} sustained {s:.3f}", flush=True)
        rows.append({"tokens": m, "variant": "errors", "errors": err, "configs": {k: list(v) for k, v in cfg.items()}})
        print(m, err, cfg, flush=True)
        variants.clear()
        torch.cuda.empty_cache()
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
