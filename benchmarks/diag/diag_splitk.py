# Answered: Is K split into a batched GEMM faster than cuBLAS's split-K at bs1? Yes, 4.96 against 7.81 us for BERT bs1's FFN down projection: lower_split_k (results/archive/diag_splitk_2026-11-30_144502.md).
"""Small-M, long-K projections: cuBLAS's own split-K against K split into a batched GEMM.

    python benchmarks/diag/diag_splitk.py --out DIR

At bs1 a transformer's down projection (BERT-base: 128 x 768 x 3072) has too few output tiles to
fill the GPU, so cuBLASLt splits K and adds a reduction kernel. The alternative measured here
splits K ourselves: ``bmm`` over S slices of K with float32 output (``out_dtype``), leaving S
partial sums for the next kernel (a residual add + LayerNorm) to add. Each variant is captured as
24 calls on 24 different weights (so weights come from memory, as a 12-layer model's do) into one
CUDA graph, and timed per call; the profiler names the kernels of one call.
Writes diag_splitk_<date>.{json,md} under --out.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import graph_us_per_call, measure_row, out_dir, table_lines, write_rows  # noqa: E402

CALLS = 24
SHAPES = [(128, 768, 3072, "BERT-base bs1 FFN down"), (197, 768, 3072, "ViT-B/16 bs1 FFN down"),
          (1024, 768, 3072, "BERT-base bs8 FFN down"), (128, 3072, 768, "BERT-base bs1 FFN up"),
          (128, 2304, 768, "BERT-base bs1 QKV")]
SPLITS = (2, 3, 4, 6, 8)


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names


def main(argv=None) -> int:
    out = out_dir(__doc__, argv)
    dev = torch.device("cuda")
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for M, N, K, what in SHAPES:
        x = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
        ws = [(torch.randn(N, K, generator=g) * K ** -0.5).to(dev, torch.bfloat16) for _ in range(CALLS)]
        b = torch.randn(N, generator=g).to(dev, torch.bfloat16)
        ref = F.linear(x.double(), ws[0].double(), b.double())
        variants = {"linear (cuBLAS)": lambda: [F.linear(x, w, b) for w in ws]}
        for S in SPLITS:
            if K % S:
                continue

            def split(S=S):
                xs = x.view(M, S, K // S).transpose(0, 1)
                return [torch.bmm(xs, w.view(N, S, K // S).permute(1, 2, 0), out_dtype=torch.float32) for w in ws]
            variants[f"bmm over {S} K-slices, fp32 partials"] = split
        for name, fn in variants.items():
            def measure(row, fn=fn):  # out_dtype missing on a torch is recorded as the row's error
                out = fn()[0]
                if out.dim() == 3:
                    out = out.sum(0) + b.float()
                row["max_abs_err"] = (out.double() - ref).abs().max().item()
                row["graph_us"] = graph_us_per_call(fn, CALLS)
                ks = _kernels(lambda: fn()[:1])
                row["kernels"] = len(ks)
                row["kernel_names"] = [k[:90] for k in ks]
            measure_row(rows, {"shape": f"{what} (M{M} N{N} K{K})", "variant": name}, measure)
    lines = table_lines(
        f"# Split-K — {torch.cuda.get_device_name()}, torch {torch.__version__}",
        f"µs per call in one CUDA graph ({CALLS} calls on {CALLS} weights); kernels per call; max |error| against "
        "float64 (partials summed in float32).",
        [("shape", lambda r: r["shape"], False), ("variant", lambda r: r["variant"], False),
         ("graph µs", lambda r: f"{r['graph_us']:.2f}", True), ("kernels", lambda r: str(r["kernels"]), True),
         ("max abs err", lambda r: f"{r['max_abs_err']:.2e}", True),
         ("kernel names", lambda r: "; ".join(k[:60] for k in r["kernel_names"]), False)], rows)
    write_rows(out, "diag_splitk", rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
