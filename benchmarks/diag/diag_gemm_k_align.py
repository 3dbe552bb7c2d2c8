"""Answered: how fast cuBLAS runs bf16 GEMMs whose K or N is even but not a multiple of 8 (MLP-Mixer's
196 tokens: 8-byte rows), against the aligned neighbour (200), as linear and as bmm with a stride-0 weight; and
whether K = 196 runs at the aligned rate when only the rows' stride is padded to 200 (lda 200), and what the
zero-padding copy that Inductor's pad_mm makes costs; besides, a large GEMM's K and N of 1540, window attention's
49 tokens against 48, and a point cloud's K of 3 against 8 (with its padded copy).

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
    big = {196: 1540, 200: 1536}[n]  # a large GEMM's K or N (1540: 4 elements past a multiple of 8)
    xb, wb = torch.randn(16384, big, device=dev, dtype=dt), torch.randn(1536, big, device=dev, dtype=dt)
    xb2, wb2 = torch.randn(16384, 1536, device=dev, dtype=dt), torch.randn(big, 1536, device=dev, dtype=dt)
    yield "linear K (16384 x 1536, K 1540 or 1536)", 2 * 16384 * 1536 * big, lambda: F.linear(xb, wb)
    yield "linear N (16384 x 1536 in, N 1540 or 1536)", 2 * 16384 * 1536 * big, lambda: F.linear(xb2, wb2)
    t = {196: 49, 200: 48}[n]  # window attention's tokens (Swin's 7 x 7) as a batched matmul: 49 against 48
    q, kt = torch.randn(12288, t, 32, device=dev, dtype=dt), torch.randn(12288, 32, t, device=dev, dtype=dt)
    a, v = torch.randn(12288, t, t, device=dev, dtype=dt), torch.randn(12288, t, 32, device=dev, dtype=dt)
    yield "bmm q @ k^T (12288 x 49 or 48 tokens, d 32)", 2 * 12288 * t * t * 32, lambda: torch.bmm(q, kt)
    yield "bmm attn @ v (12288 x 49 or 48 tokens, d 32)", 2 * 12288 * t * t * 32, lambda: torch.bmm(a, v)
    k3 = {196: 3, 200: 8}[n]  # a point cloud's coordinates (K 3) into 64 features, against K 8
    xp, wp = torch.randn(1 << 20, k3, device=dev, dtype=dt), torch.randn(64, k3, device=dev, dtype=dt)
    yield "linear K 3 or 8 (2^20 rows to 64)", 2 * (1 << 20) * 64 * k3, lambda: F.linear(xp, wp)
    if n % 8:
        wp8 = F.pad(wp, (0, 8 - k3))
        yield "linear K 3, zero-padded to 8 (copy + GEMM)", 2 * (1 << 20) * 64 * k3, \
            lambda: F.linear(F.pad(xp, (0, 8 - k3)), wp8)
        pad = -n % 8
        xs = torch.randn(b * d, n + pad, device=dev, dtype=dt)[:, :n]  # K = n in rows of n + pad
        ws = torch.randn(h, n + pad, device=dev, dtype=dt)[:, :n]
        wls = torch.randn(h, n + pad, device=dev, dtype=dt)[:, :n]
        wz = F.pad(w_k, (0, pad))
        wnz = F.pad(w_n, (0, 0, 0, pad))
        yield "linear K, lda padded", 2 * b * d * n * h, lambda: F.linear(xs, ws)
        yield "linear K, the weight's lda alone padded", 2 * b * d * n * h, lambda: F.linear(x_k, ws)
        yield "bmm stride-0 K, lda padded", 2 * b * h * n * d, lambda: torch.bmm(wls.expand(b, h, n), xt)
        yield "pad copy of the K input", 0, lambda: F.pad(x_k, (0, pad))
        yield "linear K, zero-padded (copy + GEMM)", 2 * b * d * n * h, lambda: F.linear(F.pad(x_k, (0, pad)), wz)
        yield "linear N, zero-padded weight, sliced", 2 * b * d * h * n, lambda: F.linear(x_n, wnz)[:, :n]


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
             "| GEMM | size | ms | TFLOP/s | aligned ms / ms |", "| --- | ---: | ---: | ---: | ---: |"]
    aligned = {name: ms for name, n, ms, _ in rows if n == 200}
    base = {"linear K, lda padded": "linear K", "linear K, the weight's lda alone padded": "linear K", "bmm stride-0 K, lda padded": "bmm stride-0 K",
            "pad copy of the K input": "linear K", "linear K, zero-padded (copy + GEMM)": "linear K",
            "linear N, zero-padded weight, sliced": "linear N",
            "linear K 3, zero-padded to 8 (copy + GEMM)": "linear K 3 or 8 (2^20 rows to 64)"}
    for name, n, ms, tf in rows:
        ref = aligned[base.get(name, name)]
        lines.append(f"| {name} | {n} | {ms:.4f} | {tf:.0f} | {ref / ms:.2f} |")
    path = Path(args.out) / f"diag_gemm_k_align_{stamp:%Y-%m-%d_%H%M%S}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
