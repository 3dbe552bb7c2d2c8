# Answered: how fast cuDNN runs grouped (not depthwise) 3x3 convolutions by group width, channels_last and NCHW, bf16 (RegNetY's group width 24 measured 12-14x its prediction per node on 2026-12-06) (results/diag_grouped_conv_*.md).
"""Grouped 3x3 convolutions timed by group width: [64, C, 28, 28] bf16 (C = 8 groups of the width, and
a 2-group one), stride 1 and 2, channels_last and NCHW, each replayed from a CUDA graph (median), with
the achieved TFLOP/s and the kernels one eager call launches.

    python benchmarks/diag/diag_grouped_conv.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _timing import graph_us_per_call, kernel_counts  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = []
    for gw in (4, 8, 12, 16, 24, 32, 40, 48, 64, 96):
        for groups in (8, 2):
            c = gw * groups
            for stride in (1, 2):
                for fmt in ("cl", "nchw"):
                    x = torch.randn(64, c, 28 * stride, 28 * stride, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(c, gw, 3, 3, device="cuda", dtype=torch.bfloat16)
                    if fmt == "cl":
                        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
                    fn = lambda x=x, w=w, s=stride, g=groups: F.conv2d(x, w, None, s, 1, 1, g)  # noqa: E731
                    try:
                        us = graph_us_per_call(fn, 1)
                        ks = kernel_counts(fn)
                    except Exception as e:  # noqa: BLE001 (a diagnostic: one case's failure is printed, the rest run)
                        rows.append({"gw": gw, "groups": groups, "stride": stride, "fmt": fmt, "error": str(e)[:120]})
                        continue
                    flops = 2 * 64 * 28 * 28 * c * gw * 9
                    rows.append({"gw": gw, "groups": groups, "stride": stride, "fmt": fmt, "us": round(us, 2),
                                 "tflops": round(flops / us / 1e6, 2), "kernels": ks})
                    print(json.dumps(rows[-1]), flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    dev = torch.cuda.get_device_name()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"diag_grouped_conv_{stamp}.json").write_text(json.dumps({"device": dev, "torch": torch.__version__,
                                                                             "rows": rows}, indent=1))
    lines = [f"# grouped 3x3 convolutions by group width ({dev}, torch {torch.__version__}, bf16, [64, C, 28, 28] out, {stamp} UTC)",
             "", "| group width | groups | stride | layout | us | TFLOP/s | kernels |", "| ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['gw']} | {r['groups']} | {r['stride']} | {r['fmt']} | {r.get('us', '—')} | {r.get('tflops', '—')} | "
                     f"{r.get('kernels', r.get('error', ''))} |")
    (Path(a.out) / f"diag_grouped_conv_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
