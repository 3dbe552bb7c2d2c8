# Answered: How fast does cuBLAS run GLM-4's GEMMs, in any form graphopt could emit? 93-104% of 776 TFLOP/s except the vocabulary projection's 89%, in every form (results/archive/diag_gemm_2026-11-30_045457.md).
"""GEMM rates for the GLM-4-9B decoder's shapes (issue 4: GLM bs8 within 15% of its roofline).

    python benchmarks/diag/diag_gemm.py --out DIR [--tokens 8192]

Times each of the decoder's matrix multiplies (bf16, M = tokens) in the forms graphopt could emit:
``F.linear(x, W)`` (what the graph calls), the transposed problem ``(W @ x.T).T``, M split in two,
and both BLAS back ends torch offers (``preferred_blas_library`` cublas / cublaslt); reports
TFLOP/s against the profile's 776 TFLOP/s peak. Writes diag_gemm_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (K, N, bias)
    "qkv": (4096, 4608, True), "o_proj": (4096, 4096, False), "gate_up": (4096, 27392, False),
    "down": (13696, 4096, False), "lm_head": (4096, 151552, False), "square": (8192, 8192, False),
}


def timed(fn, reps=15, warmup=3) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _timing
    from _timing import cuda_median_ms

    # queued behind a GPU sleep so host time is hidden
    return cuda_median_ms(fn, reps=reps, warmup=warmup, sleep_cycles=200_000) / 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--peak", type=float, default=776e12)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    M = a.tokens
    rows = []
    for lib in ("cublas", "cublaslt", "tunableop"):
        try:
            if lib == "tunableop":  # torch.cuda.tunable: times the BLAS library's candidate algorithms per shape
                torch.backends.cuda.preferred_blas_library("cublas")
                torch.cuda.tunable.set_filename(str(Path(a.out) / "tunableop_results.csv"))
                torch.cuda.tunable.set_max_tuning_duration(200)
                torch.cuda.tunable.set_cublaslt_requested_algo_count(64)
                torch.cuda.tunable.enable(True)
                torch.cuda.tunable.tuning_enable(True)
            else:
                torch.backends.cuda.preferred_blas_library(lib)
        except Exception as e:  # noqa: BLE001
            print(f"{lib}: unavailable ({e})")
            continue
        for name, (K, N, bias) in SHAPES.items():
            mm = 8192 if name == "square" else M
            x = torch.randn(mm, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
            out = torch.empty(mm, N, device="cuda", dtype=torch.bfloat16)
            half = mm // 2
            forms = {
                "linear": lambda: F.linear(x, w, b),
                "mm out=": lambda: torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out),
                "transposed (W@x.T).T": lambda: torch.mm(w, x.t()).t(),
                "M in two halves": lambda: (torch.mm(x[:half], w.t(), out=out[:half]), torch.mm(x[half:], w.t(), out=out[half:])),
            }
            flops = 2 * mm * K * N
            if lib == "tunableop":
                forms = {"linear": forms["linear"]}
            for form, fn in forms.items():
                try:
                    s = timed(fn)
                except Exception as e:  # noqa: BLE001
                    print(f"{lib} {name} {form}: {type(e).__name__}: {e}")
                    continue
                r = {"lib": lib, "gemm": name, "M": mm, "K": K, "N": N, "form": form, "ms": s * 1e3,
                     "tflops": flops / s / 1e12, "of_peak": flops / s / a.peak}
                rows.append(r)
                print(json.dumps(r), flush=True)
            del x, w, b, out
            torch.cuda.empty_cache()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# GLM GEMM shapes — {torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp}", "",
          "| library | GEMM | M | K | N | form | ms | TFLOP/s | of 776 |", "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    md += [f"| {r['lib']} | {r['gemm']} | {r['M']} | {r['K']} | {r['N']} | {r['form']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['of_peak']:.0%} |"
           for r in rows]
    (out / f"diag_gemm_{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"diag_gemm_{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
