# Answered: Is one Triton tile faster than SDPA's backends for short keys? Yes at BERT bs1/bs8 and ViT bs1 (3.6 against cuDNN's 6.9 us at BERT bs1), not at bs64: lower_attention (results/archive/diag_attention_small_2026-11-30_131037.md).
"""Attention at small batch: SDPA's backends against graphopt::attention's one-tile Triton kernel.

    python benchmarks/diag/diag_attention_small.py --out DIR

For each shape (B, heads, queries, keys, head dim, mask kind) it chains 24 attention calls (each
call's output is the next call's query) and times them three ways, per call: replayed from one
CUDA graph (what a graphed bs1 model pays: kernel + memsets + the gaps between them), launched
eagerly back to back (device-bound when the kernel is long, host-bound when not), and the host
time of one eager launch. Backends: cuDNN, memory-efficient, flash (no mask only) through
``sdpa_kernel``, and the Triton kernel. Each result is checked against a float64 SDPA.
Writes diag_attention_small_<date>.{json,md} under --out.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.tools.calibrate import SHORT_ATTENTION_SHAPES  # noqa: E402
from graphopt.cuda_ext import attention_triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import graph_us_per_call, measure_row, out_dir, table_lines, write_rows  # noqa: E402

CHAIN = 24
# the shapes graphopt calibrate fits the kernel's cost on (BERT-base bs1/bs8/bs64 with a padding mask,
# ViT-B/16 bs1, a decoder prefill of 256 tokens): B, H, SQ, SK, D, mask ("pad", None or "causal")
SHAPES = [(b, h, s, s, d, "pad" if kind == "mask" else kind) for b, h, s, d, kind in SHORT_ATTENTION_SHAPES]


def _inputs(B, H, SQ, SK, D, kind, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dev, torch.bfloat16) for n in (SQ, SK, SK))
    mask = None
    if kind == "pad":  # a Hugging Face additive padding mask, [B, 1, SQ, SK] expanded from [B, 1, 1, SK]
        keep = torch.ones(B, SK, dtype=torch.bool)
        keep[:, SK - SK // 8:] = False
        mask = torch.where(keep, 0.0, torch.finfo(torch.bfloat16).min).to(dev, torch.bfloat16)
        mask = mask[:, None, None, :].expand(B, 1, SQ, SK)
    return q, k, v, mask


def _fns(q, k, v, mask, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = q.shape[-1] ** -0.5
    out = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("flash", SDPBackend.FLASH_ATTENTION)):
        if name == "flash" and mask is not None:
            continue

        def f(x, be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(x, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        out[name] = f
    out["triton"] = lambda x: attention_triton.attention_triton(x, k, v, mask, scale, causal)  # noqa: E731
    return out


def _chain(f, q):
    x = q
    for _ in range(CHAIN):
        x = f(x)
    return x


def _time_eager(f, q) -> tuple[float, float]:
    for _ in range(3):
        _chain(f, q)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _chain(f, q)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / CHAIN * 1e3)
    host = []
    for _ in range(30):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f(q)
        host.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts), statistics.median(host)


def main(argv=None) -> int:
    out = out_dir(__doc__, argv)
    dev = torch.device("cuda")
    rows = []
    for B, H, SQ, SK, D, kind in SHAPES:
        q, k, v, mask = _inputs(B, H, SQ, SK, D, kind, dev)
        causal = kind == "causal"
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             attn_mask=None if mask is None else mask.double(), is_causal=causal,
                                             scale=D ** -0.5)
        for name, f in _fns(q, k, v, mask, causal).items():
            def measure(row, f=f):  # a backend that does not take this shape: the row's error
                row["max_abs_err"] = (f(q).double() - ref).abs().max().item()
                row["graph_us"] = graph_us_per_call(lambda: _chain(f, q), CHAIN)
                row["eager_us"], row["host_us"] = _time_eager(f, q)
            measure_row(rows, {"shape": f"B{B} H{H} Q{SQ} K{SK} D{D} {kind or 'no mask'}", "backend": name}, measure)
    lines = table_lines(
        f"# Attention at small batch — {torch.cuda.get_device_name()}, torch {torch.__version__}",
        f"µs per call, {CHAIN} chained calls: in one CUDA graph, launched eagerly back to back; host µs of one "
        "eager launch; max |error| against float64 SDPA (bf16 inputs).",
        [("shape", lambda r: r["shape"], False), ("backend", lambda r: r["backend"], False),
         ("graph µs", lambda r: f"{r['graph_us']:.2f}", True), ("eager µs", lambda r: f"{r['eager_us']:.2f}", True),
         ("host µs", lambda r: f"{r['host_us']:.1f}", True),
         ("max abs err", lambda r: f"{r['max_abs_err']:.2e}", True)], rows)
    write_rows(out, "diag_attention_small", rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
