# Answered: Is 776 TFLOP/s bf16 a sustained rate? No: 662-674 TFLOP/s back to back under the 700 W cap, the profile's matmul_sustained_fraction 0.857 (results/archive/diag_sustained_2026-11-30_152332.json).
"""Is the 776 TFLOP/s bf16 ceiling a burst or a sustained rate? GEMM rate and SM clock under load.

    python benchmarks/diag/diag_sustained.py --out DIR [--seconds 8]

Runs (1) an 8192^3 bf16 matmul and (2) GLM-4's vocabulary projection (8192 x 4096 x 151552), each
first as a short burst (5 calls after an idle second) and then back to back for ``--seconds``,
reporting TFLOP/s per second of the sustained run, while a thread samples nvidia-smi's SM clock,
power draw and clock-throttle reasons every 200 ms. Writes diag_sustained_<date>.json under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from graphopt.tools.calibrate import gemm_rates  # noqa: E402

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sampler(stop, rows):
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
            rows.append([time.perf_counter()] + [x.strip() for x in out.split(",")])
        except Exception as e:  # noqa: BLE001
            rows.append([time.perf_counter(), f"error {e}"])
        stop.wait(0.2)


def run(name, M, K, N, seconds):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    flop = 2 * M * K * N
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    time.sleep(1.0)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        a @ b
    e1.record()
    e1.synchronize()
    burst = 5 * flop / (e0.elapsed_time(e1) / 1e3) / 1e12
    stop, rows = threading.Event(), []
    th = threading.Thread(target=sampler, args=(stop, rows))
    th.start()
    t_start = time.perf_counter()
    per_second = [r / 1e12 for r in gemm_rates(a, b, seconds, window=1.0)]
    stop.set()
    th.join()
    rows = [[round(r[0] - t_start, 2)] + r[1:] for r in rows]
    res = {"name": name, "shape": [M, K, N], "burst_tflops": burst, "sustained_tflops_per_second": per_second,
           "smi": rows}
    print(name, f"burst {burst:.0f} TFLOP/s, sustained per second {[round(x) for x in per_second]}", flush=True)
    clocks = [r[1] for r in rows if len(r) > 2]
    print("  sm clocks MHz", clocks[:3], "...", clocks[-3:], " power W", [r[3] for r in rows if len(r) > 3][-3:],
          " throttle", sorted({r[5] for r in rows if len(r) > 5}), flush=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=8)
    a = p.parse_args(argv)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "runs": [run("8192^3", 8192, 8192, 8192, a.seconds),
                    run("GLM-4 vocabulary projection", 8192, 4096, 151552, a.seconds)]}
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"diag_sustained_{stamp}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
