# Answered: How fast is graphopt::fused_norm_backward against aten's LayerNorm backward and torch's fused RMSNorm backward, by shape? Its first form (weight sums reduced across a tile's rows every iteration) 121 us at 16384 x 768 against aten's 108 (statistics saved); with the sums kept per row until the program ends 63.5, and 98-103 against 142-166 at 2048-4096 wide; aten's own weight-gradient kernel is its slow part (results/diag_norm_backward_2026-12-03_131104.md, …132037.md).
"""Norm backward kernels by shape (bf16, weight gradients wanted), device time queued behind a GPU sleep.

    python benchmarks/diag/diag_norm_backward.py --out /tmp/out

Rows: aten LayerNorm backward (native_layer_norm for the statistics, then native_layer_norm_backward),
torch's fused RMSNorm backward (_fused_rms_norm + _fused_rms_norm_backward, where torch has it), and
graphopt::fused_norm_backward for each; GB/s over g and h read and dh written.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parents[1]), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from _timing import cuda_median_ms, out_dir  # noqa: E402

SHAPES = [(16384, 768), (65536, 768), (8192, 1024), (16384, 2048), (4096, 4096), (8192, 4096), (2048, 8192)]


def main(argv=None) -> int:
    import graphopt.cuda_ext  # noqa: F401

    out = out_dir(__doc__, argv)
    aten, ops = torch.ops.aten, torch.ops.graphopt
    rows = []
    for R, N in SHAPES:
        h = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
        g = torch.randn_like(h)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        moved = 3 * h.numel() * h.element_size()

        def aten_ln():
            _, mean, rstd = aten.native_layer_norm(h, [N], None, None, 1e-5)
            return aten.native_layer_norm_backward(g, h, [N], mean, rstd, w, b, [True, True, True])

        def aten_ln_saved(stats=aten.native_layer_norm(h, [N], None, None, 1e-5)):
            return aten.native_layer_norm_backward(g, h, [N], stats[1], stats[2], w, b, [True, True, True])

        cases = {"aten LayerNorm (statistics recomputed)": aten_ln, "aten LayerNorm (statistics saved)": aten_ln_saved,
                 "graphopt LayerNorm": lambda: ops.fused_norm_backward(g, h, w, None, 1e-5, True, False)}
        if hasattr(aten, "_fused_rms_norm_backward"):
            def rms():
                _, rstd = aten._fused_rms_norm(h, [N], None, 1e-5)
                return aten._fused_rms_norm_backward(g, h, [N], rstd, w, [True, True])
            cases["torch fused RMSNorm (statistics recomputed)"] = rms
        cases["graphopt RMSNorm"] = lambda: ops.fused_norm_backward(g, h, w, None, 1e-5, True, True)
        for name, fn in cases.items():
            ms = cuda_median_ms(fn, reps=20, warmup=3, sleep_cycles=2_000_000)
            rows.append({"rows": R, "hidden": N, "kernel": name, "us": ms * 1e3, "gb_s": moved / (ms * 1e-3) / 1e9})
            print(f"{R}x{N} {name}: {ms * 1e3:.1f} us, {rows[-1]['gb_s']:.0f} GB/s", flush=True)
    stamp = time.strftime("%Y-%m-%d_%H%M%S", time.gmtime())
    base = Path(out) / f"diag_norm_backward_{stamp}"
    base.with_suffix(".json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                     "rows": rows}, indent=1))
    lines = [f"# Norm backward kernels, bf16 ({torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp})", "",
             "Device time queued behind a GPU sleep, median of 20; GB/s over g and h read and dh written.", "",
             "| rows x hidden | kernel | us | GB/s |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {r['rows']}x{r['hidden']} | {r['kernel']} | {r['us']:.1f} | {r['gb_s']:.0f} |" for r in rows]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
