"""Answered: how fast cuBLAS runs bf16 GEMMs whose K or N is even but not a multiple of 8 (MLP-Mixer's
196 tokens: 8-byte rows), against the aligned neighbour (200), as linear and as bmm with a stride-0 weight.

    python benchmarks/diag/diag_gemm_k_align.py --out DIR

Writes diag_gemm_k_align_<UTC stamp>.md under --out (CUDA only; medians of 20 calls after 5).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import cuda_median_ms  # noqa: E402


def cases(n: int):
    """(name, flops, callable) for one odd size n (196) or its aligned neighbour (200)."""
    dev, dt = "cuda", torch.bfloat16
    b, d, h = 64, 384, 384
    x_k = torch.randn(b * d, n, device=dev, dtype=dt)  # linear over the tokens: K = n
    w_k = torch.randn(h, n, device=dev, dtype=dt)
    x_n = torch.randn(b * d, h, device=dev, dtype=dt)  # back to the tokens: N = n
    w_n = torch.randn(n, h, device=dev, dtype=dt)
    wl = torch.randn(h, n, device=dev, dtype=dt)  # W @ x with the weight repeated over the batch: K = n
    xt = torch.randn(b, n, d, device=dev, dtype=dt)
    wr = torch.randn(n, h, device=dev, dtype=dt)  # W @ x back to the tokens: M = n, K = h
    xr = torch.randn(b, h, d, device=dev, dtype=dt)
    yield "linear K", 2 * b * d * n * h, lambda: F.linear(x_k, w_k)
    yield "linear N", 2 * b * d * h * n, lambda: F.linear(x_n, w_n)
    yield "bmm stride-0 K", 2 * b * h * n * d, lambda: torch.bmm(wl.expand(b, h, n), xt)
    yield "bmm stride-0 M", 2 * b * n * h * d, lambda: torch.bmm(wr.expand(b, n, h), xr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for n in (196, 200):
        for name, flops, fn in cases(n):
            ms = cuda_median_ms(fn, reps=20, warmup=5)
            rows.append((name, n, ms, flops / ms / 1e9))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# cuBLAS bf16 GEMMs with a size of 196 against 200 ({torch.cuda.get_device_name()})", "",
             f"{stamp:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; medians of 20 calls after 5 (CUDA events).", "",
             "| GEMM | size | ms | TFLOP/s | / aligned |", "| --- | ---: | ---: | ---: | ---: |"]
    aligned = {name: tf for name, n, _, tf in rows if n == 200}
    for name, n, ms, tf in rows:
        lines.append(f"| {name} | {n} | {ms:.4f} | {tf:.0f} | {tf / aligned[name]:.2f} |")
    path = Path(args.out) / f"diag_gemm_k_align_{stamp:%Y-%m-%d_%H%M%S}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
