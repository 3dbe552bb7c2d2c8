# Answered: Does programmatic dependent launch save time in our CUDA graphs? 0.45 us only between two PDL kernels, nothing after a cuBLAS/cuDNN kernel: not built (results/archive/diag_pdl_2026-11-30_165541.md).
"""Programmatic dependent launch (PDL, Hopper+) between small kernels in a CUDA graph: what does it save?

A row-wise LayerNorm in Triton is launched 48 times in a chain (each reads the last one's output), and 24
times after a cuBLAS GEMM of BERT-base bs1's shape (128 x 768 x 768), each captured once in a CUDA graph
and replayed. Variants: a plain launch; ``launch_pdl=True`` with ``griddepcontrol.wait`` as the kernel's
first statement; the same plus ``griddepcontrol.launch_dependents`` right after it. Every variant's
final output is checked against the plain one.

    python benchmarks/diag/diag_pdl.py --out benchmarks/results
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _timing
from _timing import graph_us_per_call, measure_row, out_dir, table_lines, write_rows  # noqa: E402

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older triton: the PDL rows record the error
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _ln(x, w, out, N: tl.constexpr, BLOCK: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    v = tl.load(x + row * N + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(v, 0) / N
    d = tl.where(m, v - mean, 0.0)
    var = tl.sum(d * d, 0) / N
    y = d * tl.rsqrt(var + 1e-5) * tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * N + offs, y.to(out.dtype.element_ty), mask=m)


def ln(x, w, out, variant):
    M, N = x.shape
    kw = {} if variant == "plain" else {"launch_pdl": True}
    _ln[(M,)](x, w, out, N, triton.next_power_of_2(N), variant != "plain", variant == "pdl+trigger", **kw)
    return out


def main():
    out = out_dir(__doc__)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    M, N = 128, 768
    w = torch.randn(N, device=dev, dtype=torch.bfloat16) * 0.1 + 1
    W = torch.randn(N, N, device=dev, dtype=torch.bfloat16) / N ** 0.5
    bias = torch.randn(N, device=dev, dtype=torch.bfloat16) * 0.1
    x0 = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    chain = [torch.empty_like(x0) for _ in range(49)]
    pairs = [torch.empty_like(x0) for _ in range(49)]
    rows, ref = [], {}

    def chain_fn(variant):
        def fn():
            chain[0].copy_(x0)
            for i in range(48):
                ln(chain[i], w, chain[i + 1], variant)
        return fn

    def pair_fn(variant):
        def fn():
            pairs[0].copy_(x0)
            for i in range(0, 48, 2):
                torch.addmm(bias, pairs[i], W, out=pairs[i + 1])
                ln(pairs[i + 1], w, pairs[i + 2], variant)
        return fn

    for case, make, calls, buf in (("48 LayerNorms in a chain", chain_fn, 48, chain),
                                   ("24 x (GEMM 128x768x768 + bias, then LayerNorm)", pair_fn, 24, pairs)):
        for variant in ("plain", "pdl", "pdl+trigger"):
            def measure(row, make=make, calls=calls, buf=buf, variant=variant, case=case):
                row["us"] = graph_us_per_call(make(variant), calls)
                torch.cuda.synchronize()
                if variant == "plain":
                    ref[case] = buf[48].clone()
                    row["max_err"] = 0.0
                else:
                    row["max_err"] = (buf[48].float() - ref[case].float()).abs().max().item()
            measure_row(rows, {"case": case, "variant": variant}, measure)
    base = {r["case"]: r.get("us") for r in rows if r["variant"] == "plain"}
    cols = [("case", lambda r: r["case"], False), ("launch", lambda r: r["variant"], False),
            ("µs per step in a graph", lambda r: f"{r['us']:.2f}", True),
            ("vs plain", lambda r: f"{r['us'] - base[r['case']]:+.2f}", True),
            ("max diff vs plain", lambda r: f"{r['max_err']:.1e}", True)]
    name = torch.cuda.get_device_name()
    lines = table_lines(f"# Programmatic dependent launch between small kernels — {name}, torch {torch.__version__}, "
                        f"triton {triton.__version__}",
                        "A step is one LayerNorm (chain) or one GEMM + one LayerNorm (pairs), replayed in a CUDA graph.",
                        cols, rows)
    write_rows(out, "diag_pdl", rows, lines)


if __name__ == "__main__":
    main()
