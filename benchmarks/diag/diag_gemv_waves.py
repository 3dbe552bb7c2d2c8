"""Answers: does the split-K Triton GEMV (graphopt::gemv) beat cuBLAS on the batch-1 decode
projections once its blocks and split count are chosen per shape (filling whole waves of the SMs),
and which choice wins? For GLM-4-9B's and Llama-3-8B's projections at M = 1, bf16, each call on its
own copy of the weight (the copies outgrow L2, as a decode step's layers do), captured into a CUDA
graph and replayed: µs per call for cuBLAS (F.linear) and for every (block_n, block_k, splits,
stages) tried; writes diag_gemv_waves_<date>.{json,md} under --out. (The committed table was timed by
an inline copy of ``_timing.graph_us_per_call``'s loop, the same method, before it called that helper.)"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _timing import graph_us_per_call  # noqa: E402

SHAPES = {  # name: (K, N)
    "glm qkv": (4096, 4608), "glm o": (4096, 4096), "glm gate_up": (4096, 27392), "glm down": (13696, 4096),
    "llama qkv": (4096, 6144), "llama gate_up": (4096, 28672), "llama down": (14336, 4096),
}


def per_call_us(fn_for, copies, reps=10) -> float:
    """µs per call of ``fn_for(w)`` over every weight copy, replayed from one CUDA graph."""
    return graph_us_per_call(lambda: [fn_for(w) for w in copies], len(copies), replays=1, reps=reps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    from graphopt.cuda_ext import gemv_triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in a.shapes.split(","):
        K, N = SHAPES[name]
        n_copies = max(4, int(2e9 // (K * N * 2)) // 2)
        copies = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        floor = K * N * 2 / 4.13e12 * 1e6
        cub = per_call_us(lambda w: F.linear(x, w), copies)
        default = gemv_triton.plan(1, N, K, sms)
        res = []
        for bn, bk, st in itertools.product((32, 64, 128), (128, 256), (3, 4)):
            tiles, blocks = -(-N // bn), -(-K // bk)
            for s in sorted({1, 2, 3, 4, 6, 8, 12, 16, default["splits"]}):
                if s > blocks or tiles * s > 8 * sms:
                    continue
                cfg = dict(block_n=bn, block_k=bk, splits=s, stages=st)
                try:
                    us = per_call_us(lambda w: gemv_triton.gemv_triton(x, w, None, **cfg), copies)
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile or fit
                    print(name, cfg, "failed:", str(e).splitlines()[0][:120])
                    continue
                res.append({**cfg, "programs": tiles * s, "us": us})
        res.sort(key=lambda r: r["us"])
        d = next((r for r in res if r["block_n"] == default["BLOCK_N"] and r["block_k"] == default["BLOCK_K"]
                  and r["splits"] == default["splits"] and r["stages"] == default["num_stages"]), None)
        row = {"shape": name, "K": K, "N": N, "floor_us": floor, "cublas_us": cub, "default": d, "best": res[:5]}
        rows.append(row)
        print(f"{name}: floor {floor:.1f} cublas {cub:.2f} default {d and round(d['us'], 2)} best "
              + "; ".join(f"{r['us']:.2f} bn{r['block_n']} bk{r['block_k']} s{r['splits']} st{r['stages']} p{r['programs']}"
                          for r in res[:4]), flush=True)
        del copies
        torch.cuda.empty_cache()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"diag_gemv_waves_{stamp}.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sms, "rows": rows}, f, indent=1)
    lines = [f"# Split-K GEMV blocks and splits per decode projection, M = 1 ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, {stamp})", "",
             "| projection | K x N | floor µs (4.13 TB/s) | cuBLAS µs | planned GEMV µs | best GEMV µs | best config |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        b = r["best"][0] if r["best"] else None
        lines.append(f"| {r['shape']} | {r['K']}x{r['N']} | {r['floor_us']:.1f} | {r['cublas_us']:.2f} | "
                     f"{r['default']['us'] if r['default'] else float('nan'):.2f} | {b['us'] if b else float('nan'):.2f} | "
                     + (f"block_n {b['block_n']}, block_k {b['block_k']}, splits {b['splits']}, stages {b['stages']} "
                        f"({b['programs']} programs)" if b else "-") + " |")
    with open(os.path.join(a.out, f"diag_gemv_waves_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
