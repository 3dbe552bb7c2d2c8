# Answered: Is graphopt::group_norm faster than aten's GroupNorm, and does the cost model's price of aten's hold? bf16 H200: PoolFormer stage 1 NCHW 0.204 vs 0.110 ms, NHWC 0.292 vs 0.046, a VAE's 1x128x256x256/32 0.151 vs 0.034, BiT stage 1 0.240 vs 0.118; aten predicted within about 0.5-2x; under 0.07 ms ours timed the host's two Triton launches, not the device (the 0.1 ms GPU sleep too short; in a CUDA graph they are gone): not separated (results/diag_group_norm_2026-12-04_163523.md). Then channels_last with narrow groups (BiT's 32 groups of 8 channels: a row read 16-byte runs, 0.283 ms, 1.09 TB/s) got pixel-tile kernels: a first version over [pixels, groups, width] tiles with unaligned channel offsets ran 0.417-0.434 ms (two runs, not kept); tiles of whole pixels [pixels, C] with per-lane Welford, merged per group once: BiT stage 1 NHWC 0.127 ms (2.43 TB/s, aten 0.574), a VAE's 0.093 (results/diag_group_norm_2026-12-04_192339.md; rows under 0.1 ms move 2-4x between runs: host-bound).
"""How fast are aten's GroupNorm and graphopt::group_norm by shape, and does the cost model's price of
aten's kernels (op_efficiency "group_norm": one block a row, the strided apply) hold?

    python benchmarks/diag/diag_group_norm.py --out /tmp/out

bf16, NCHW and channels_last; each call timed with CUDA events after a GPU sleep (device time, not
the host's launch), the median of 30. Columns: measured aten and graphopt, the cost model's
prediction of each, the ratio.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = [  # (N, C, H, W, groups, where)
    (64, 64, 56, 56, 1, "PoolFormer-S12 bs64 stage 1"),
    (64, 128, 28, 28, 1, "PoolFormer-S12 stage 2"),
    (64, 320, 14, 14, 1, "PoolFormer-S12 stage 3"),
    (64, 512, 7, 7, 1, "PoolFormer-S12 stage 4"),
    (2, 320, 64, 64, 32, "SD UNet bs2 64x64 latents"),
    (8, 640, 32, 32, 32, "SD UNet bs8 32x32"),
    (64, 256, 56, 56, 32, "BiT ResNetV2-50 bs64 stage 1"),
    (1, 128, 256, 256, 32, "a VAE decoder at bs1"),
]


def device_ms(fn, reps=30):
    times = []
    for _ in range(reps):
        torch.cuda._sleep(200_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def predicted_ms(fn_graph_args):
    from graphopt import capture
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    gm = capture(*fn_graph_args)
    cm = CostModel(get_profile("h200")[0])
    return sum(cm.node_cost(n).time_s for n in gm.graph.nodes if n.op == "call_function") * 1e3


class Aten(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g

    def forward(self, x, w, b):
        return F.group_norm(x, self.g, w, b, 1e-5)


class Ours(Aten):
    def forward(self, x, w, b):
        return torch.ops.graphopt.group_norm(x, self.g, w, b, 1e-5, "none")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import graphopt.cuda_ext  # noqa: F401  (registers the ops)

    rows = []
    for n, c, h, w, g, where in SHAPES:
        for cl in (False, True):
            x = torch.randn(n, c, h, w, device="cuda", dtype=torch.bfloat16)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            wt, bs = torch.randn(c, device="cuda", dtype=torch.bfloat16), torch.randn(c, device="cuda",
                                                                                     dtype=torch.bfloat16)
            ours = torch.ops.graphopt.group_norm(x, g, wt, bs, 1e-5, "none")
            err = (ours.float() - F.group_norm(x.float(), g, wt.float(), bs.float(), 1e-5)).abs().max().item()
            ta = device_ms(lambda: F.group_norm(x, g, wt, bs, 1e-5))
            to = device_ms(lambda: torch.ops.graphopt.group_norm(x, g, wt, bs, 1e-5, "none"))
            meta = [t.to("meta") for t in (x, wt, bs)]
            try:
                pa, po = predicted_ms((Aten(g), tuple(meta))), predicted_ms((Ours(g), tuple(meta)))
            except Exception as e:  # noqa: BLE001 - the timing still stands
                print(f"prediction failed: {type(e).__name__}: {e}", flush=True)
                pa = po = float("nan")
            gbs = 3 * x.numel() * 2 / (to * 1e-3) / 1e9
            rows.append((where, f"{n}x{c}x{h}x{w}/{g}", "NHWC" if cl else "NCHW", ta, to, pa, po, gbs, err))
            print(rows[-1], flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    lines = [f"# GroupNorm: aten against graphopt::group_norm, {torch.cuda.get_device_name()}, {stamp} UTC",
             f"torch {torch.__version__}; bf16; device ms (median of 30 after a GPU sleep); predicted: the cost model "
             "(h200 profile, eager launch overhead included)", "",
             "| where | shape / groups | layout | aten ms | graphopt ms | aten / graphopt | aten predicted | graphopt "
             "predicted | graphopt GB/s (2 reads, 1 write) | max abs err vs fp32 |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for wh, sh, lay, ta, to, pa, po, gbs, err in rows:
        lines.append(f"| {wh} | {sh} | {lay} | {ta:.4f} | {to:.4f} | {ta / to:.2f} | {pa:.4f} | {po:.4f} | {gbs:.0f} | "
                     f"{err:.3g} |")
    out = Path(args.out) / f"diag_group_norm_{stamp}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
