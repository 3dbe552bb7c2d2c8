# Answered: Does TunableOp find a faster GEMM for GLM's vocabulary projection? No: 14.68 ms default against 14.70 tuned (results/archive/diag_tunableop_2026-11-30_h200.md).
"""Diagnostic: does TunableOp (cuBLAS/cuBLASLt algorithm search) find a faster algorithm than the
heuristic default for GLM-4's vocabulary projection ([8192, 4096] x [4096, 151552] bf16, the GEMM
that runs at 89% of the 776 TFLOP/s peak)? Times F.linear with CUDA events, default vs tuned.

    python benchmarks/diag/diag_tunableop.py
"""
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import cuda_median_ms  # noqa: E402


def bench(fn):
    # queued behind ~1 ms of GPU sleep: the events time the GEMM, not its launch
    return cuda_median_ms(fn, reps=20, sleep_cycles=1_000_000)


def main():
    shapes = [("lm_head bs8", 8192, 4096, 151552), ("gate_up bs8", 8192, 4096, 27392), ("down bs8", 8192, 13696, 4096)]
    for name, m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = F.linear(x, w)
        base = bench(lambda: F.linear(x, w))
        tun = torch.cuda.tunable
        tun.enable(True)
        tun.tuning_enable(True)
        if hasattr(tun, "set_max_tuning_duration"):
            tun.set_max_tuning_duration(2000)
        if hasattr(tun, "set_filename"):
            tun.set_filename(os.path.join(tempfile.mkdtemp(), "tunableop_results%d.csv"))
        out = F.linear(x, w)  # tunes here
        tuned = bench(lambda: F.linear(x, w))
        tun.tuning_enable(False)
        tun.enable(False)
        err = float((out.float() - ref.float()).abs().max())
        flops = 2 * m * k * n
        print(f"{name}: default {base:.3f} ms ({flops / base / 1e9 / 776:.1%} of 776 TF/s), tuned {tuned:.3f} ms "
              f"({flops / tuned / 1e9 / 776:.1%}); max |tuned - default| {err:.3g}", flush=True)
        del x, w, ref, out


if __name__ == "__main__":
    main()
