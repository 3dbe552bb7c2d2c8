"""graphopt::gemm_swiglu's two weight layouts at GLM-4-9B's MLP shape: the halves layout (cat([Wg, Wu])
as the model holds it, two TMA loads per k-step, block 0) against the interleaved copy (block 128),
and cuBLAS + graphopt::swiglu.

    python benchmarks/diag/diag_swiglu_layout.py --out benchmarks/results

K 4096, n 13696 (the gate+up weight 27392 x 4096, bf16), M = 1024 and 8192 tokens (bs1 and bs8 at
seq 1024). Each variant is captured into a CUDA graph and replayed (µs per call, median), then run
back to back for ``--sustain`` seconds (ms per call under the power cap, as the MLP runs in a long
forward); TFLOP/s counts the GEMM's 2 M K 2n. The halves kernel is timed at a few tile
configurations (BM, BN, BK, stages, warps, GROUP_M) besides the shipped one. Every output is
checked against a float64 product on 64 sampled rows. Writes diag_swiglu_layout_<date>.{json,md}
under --out.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _timing import graph_us_per_call, measure_row, table_lines, write_rows  # noqa: E402

K, N = 4096, 13696
TOKENS = (1024, 8192)
HALVES_CONFIGS = [(128, 128, 64, 3, 8, 16), (128, 128, 64, 4, 8, 16), (128, 64, 64, 4, 8, 16), (128, 128, 64, 3, 8, 8)]


def sustained_ms(fn, seconds: float) -> float:
    """Mean ms per call over ``seconds`` of back-to-back calls (after one second of warm-up)."""
    for budget in (1.0, seconds):
        calls, t0 = 0, time.perf_counter()
        torch.cuda.synchronize()
        start = time.perf_counter()
        while time.perf_counter() - t0 < budget:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> float:
    gu = x[rows].double() @ w.double().T
    ref = F.silu(gu[:, :N]) * gu[:, N:]
    return float((y[rows].double() - ref).abs().max() / ref.abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sustain", type=float, default=3.0, help="seconds of back-to-back calls per variant")
    a = p.parse_args(argv)
    import graphopt.cuda_ext  # noqa: F401  (registers the graphopt ops)
    from graphopt.cuda_ext import gemm_triton as gt
    from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up

    torch.manual_seed(0)
    w = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    wi = interleave_gate_up(w, gt.SWIGLU_BLOCK)
    rows: list = []
    for M in TOKENS:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        sample = torch.randperm(M, device="cuda")[:64]
        flops = 2.0 * M * K * 2 * N
        variants = [("cuBLAS linear + graphopt::swiglu", "—", lambda x=x: torch.ops.graphopt.swiglu(F.linear(x, w))),
                    ("interleaved (block 128, a copy)", str(gt.SWIGLU_CONFIGS[128]),
                     lambda x=x: torch.ops.graphopt.gemm_swiglu(x, wi, N, 128)),
                    ("halves (block 0, shipped)", str(gt.SWIGLU_HALVES_CONFIG),
                     lambda x=x: torch.ops.graphopt.gemm_swiglu(x, w, N, 0))]
        variants += [("halves (block 0)", str(cfg), lambda x=x, cfg=cfg: gt.gemm_swiglu_halves(x, w, N, cfg))
                     for cfg in HALVES_CONFIGS if cfg != gt.SWIGLU_HALVES_CONFIG]
        for name, cfg, fn in variants:
            def measure(row, fn=fn, x=x, sample=sample, flops=flops):
                row["max_rel_err"] = rel_err(fn(), x, w, sample)
                us = graph_us_per_call(fn, 1, replays=3, reps=10)
                ms = sustained_ms(fn, a.sustain)
                row.update(us=us, tflops=flops / (us * 1e-6) / 1e12, sustained_ms=ms,
                           sustained_tflops=flops / (ms * 1e-3) / 1e12)
            measure_row(rows, {"M": M, "K": K, "n": N, "variant": name, "config": cfg}, measure)
        del x
        torch.cuda.empty_cache()
    cols = [("M", lambda r: str(r["M"]), True), ("variant", lambda r: r["variant"], False),
            ("config", lambda r: r["config"], False), ("µs (graph)", lambda r: f"{r['us']:.1f}", True),
            ("TFLOP/s", lambda r: f"{r['tflops']:.0f}", True),
            (f"ms back to back ({a.sustain:.0f} s)", lambda r: f"{r['sustained_ms']:.3f}", True),
            ("TFLOP/s back to back", lambda r: f"{r['sustained_tflops']:.0f}", True),
            ("max rel err", lambda r: f"{r['max_rel_err']:.1e}", True)]
    intro = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GLM-4-9B's gate+up projection "
             f"({2 * N} x {K} bf16) and SwiGLU; µs per call replayed from a CUDA graph (median), then the mean over "
             f"{a.sustain:.0f} s of back-to-back calls; TFLOP/s over 2 M K 2n; error: max |y - ref| / max |ref| over "
             "64 sampled rows against float64")
    lines = table_lines("# gemm_swiglu: halves layout (no copy) vs interleaved copy vs cuBLAS + swiglu", intro,
                        cols, rows)
    write_rows(a.out, "diag_swiglu_layout", rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
