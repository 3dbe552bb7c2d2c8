# Answered: Does a persistent GEMM's tile-group order change its speed under the power cap? Groups of 16 row blocks were fastest (2.701 ms against 2.713 at 8), now the default (results/archive/diag_gemm_order_2026-11-30_191649.md).
"""Does the order of a GEMM's output tiles change its speed under the H200's power cap (issue 4)?

    python benchmarks/diag/diag_gemm_order.py --out DIR

A persistent GEMM walks its tiles in groups of GROUP_M row blocks, each group sweeping every column
block: a larger group reads the weight from HBM fewer times (GLM-4's vocabulary projection: 8 times
its 1.24 GB at GROUP_M = 8, twice at 32), which saves DRAM energy, and a GPU held at its 700 W cap
might spend that on its clock. Times GLM-4's vocabulary projection (8192 x 4096 x 151552) and the
gate/up GEMM with its SwiGLU epilogue (8192 x 4096 x 27392) for several GROUP_M against cuBLAS, each
back to back for 3 s from a CUDA graph, with the board power and SM clock of the last second.
Writes diag_gemm_order_<date>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag_swiglu_gemm import FFN, HIDDEN, sustained  # noqa: E402

GROUPS = (4, 8, 16, 32, 64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    a = p.parse_args(argv)
    from graphopt.cuda_ext import gemm_triton as gt
    import graphopt.cuda_ext as ce
    from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up

    torch.manual_seed(0)
    dev, m = torch.device("cuda"), a.tokens
    x = torch.randn(m, HIDDEN, device=dev).bfloat16()
    rows = []
    wv = (torch.randn(151552, HIDDEN, device=dev) / HIDDEN ** 0.5).bfloat16()
    wgu = (torch.randn(2 * FFN, HIDDEN, device=dev) / HIDDEN ** 0.5).bfloat16()
    wil = interleave_gate_up(wgu, gt.SWIGLU_BLOCK)
    plain, fused = gt.GEMM_CONFIG, gt.SWIGLU_CONFIGS[gt.SWIGLU_BLOCK]
    variants = [("vocabulary", "cuBLAS", lambda: F.linear(x, wv)),
                ("gate/up + SwiGLU", "cuBLAS + graphopt::swiglu", lambda: ce.swiglu(F.linear(x, wgu)))]
    for g in GROUPS:
        variants.append(("vocabulary", f"Triton GROUP_M={g}", lambda g=g: gt.gemm(x, wv, (*plain, g))))
        variants.append(("gate/up + SwiGLU", f"Triton GROUP_M={g}", lambda g=g: gt.gemm_swiglu(x, wil, FFN, (*fused, g))))
    for gemm, name, fn in sorted(variants, key=lambda v: v[0]):
        r = sustained(fn, calls=4 if gemm == "vocabulary" else 10)
        rows.append({"gemm": gemm, "variant": name, **r})
        print(f"{gemm} {name}: {r['ms']:.3f} ms, {r['watts'] or 0:.0f} W, {r['mhz'] or 0:.0f} MHz", flush=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": stamp, "tokens": m}
    (out / f"diag_gemm_order_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# GEMM tile order under the power cap ({meta['gpu']}, torch {meta['torch']}, {stamp}, M = {m})", "",
             "Each row: back to back from a CUDA graph for 3 s, the last second: median ms a call, mean board power, "
             "mean SM clock.", "", "| GEMM | variant | ms | W | MHz |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['gemm']} | {r['variant']} | {r['ms']:.3f} | {r['watts'] or 0:.0f} | {r['mhz'] or 0:.0f} |" for r in rows]
    (out / f"diag_gemm_order_{stamp}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
