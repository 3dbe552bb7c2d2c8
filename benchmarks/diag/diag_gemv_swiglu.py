"""Answers: at a decode step's rows (M = 1, 8, 16), is graphopt::gemv_swiglu (gate and up projections
and silu(gate) * up in one weight stream) faster than what runs without it: cuBLAS over the merged
gate/up weight + graphopt::swiglu (GLM-4, or Llama with its weights merged by a copy), and cuBLAS
over gate and up apart + silu * mul (Llama within the weight-copy budget)? GLM-4-9B's and
Llama-3-8B's MLP shapes, bf16, each call on its own copy of the weights (the copies outgrow L2, as a
decode step's layers do), replayed from a CUDA graph; writes diag_gemv_swiglu_<date>.{json,md} under
--out."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _timing import graph_us_per_call  # noqa: E402

SHAPES = {"glm4-9b": (4096, 13696), "llama3-8b": (4096, 14336)}  # name: (K, n)


def per_call_us(fn_for, copies, reps=10) -> float:
    return graph_us_per_call(lambda: [fn_for(w) for w in copies], len(copies), replays=1, reps=reps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,8,16")
    a = p.parse_args()
    import graphopt  # noqa: F401  (registers the ops)

    G = torch.ops.graphopt
    rows = []
    for name, (K, n) in SHAPES.items():
        n_copies = max(4, int(2e9 // (K * 2 * n * 2)) // 2)
        copies = [torch.randn(2 * n, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_copies)]
        halves = [(w[:n], w[n:]) for w in copies]
        apart = [(w[:n].clone(), w[n:].clone()) for w in copies[: max(2, n_copies // 2)]]
        for M in (int(r) for r in a.rows.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            floor = K * 2 * n * 2 / 4.13e12 * 1e6
            r = {"model": name, "M": M, "K": K, "n": n, "floor_us_at_4.13TBps": round(floor, 2),
                 "cublas_merged_plus_swiglu": per_call_us(lambda w: G.swiglu(F.linear(x, w)), copies),
                 "cublas_apart_plus_silu_mul": per_call_us(lambda p: F.silu(F.linear(x, p[0])) * F.linear(x, p[1]),
                                                           apart),
                 "gemv_swiglu_merged": per_call_us(lambda w: G.gemv_swiglu(x, w, None), copies),
                 "gemv_swiglu_two_weights": per_call_us(lambda p: G.gemv_swiglu(x, p[0], p[1]), halves)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with open(os.path.join(a.out, f"diag_gemv_swiglu_{stamp}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    cols = ["cublas_merged_plus_swiglu", "cublas_apart_plus_silu_mul", "gemv_swiglu_merged", "gemv_swiglu_two_weights"]
    lines = [f"# gemv_swiglu against cuBLAS + the activation ({meta['gpu']}, torch {meta['torch']}), µs per call",
             "", "| model | M | floor | " + " | ".join(cols) + " |", "| --- | ---: | ---: |" + " ---: |" * len(cols)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['M']} | {r['floor_us_at_4.13TBps']:.1f} | "
                     + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    with open(os.path.join(a.out, f"diag_gemv_swiglu_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
