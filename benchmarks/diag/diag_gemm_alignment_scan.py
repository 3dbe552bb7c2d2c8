"""Answered: which models' 16-bit GEMMs (linear, mm, addmm, bmm, baddbmm) have an operand whose rows are not
16-byte aligned (a leading dimension not a multiple of 8 elements), and what share of each model's GEMM
FLOPs they carry: the captured graph (before any pass), on the CPU, in bf16.

    python benchmarks/diag/diag_gemm_alignment_scan.py --out DIR [--configs NAME:BATCH,...] [--timm-outside]

Writes diag_gemm_alignment_scan_<UTC stamp>.md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from graphopt import ir  # noqa: E402
from graphopt.capture import capture  # noqa: E402
from graphopt.tools import perf_sweep  # noqa: E402

GEMMS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"}


def _ld(info) -> int | None:
    """The leading dimension of a tensor's last two dims as stored (None: neither has unit stride)."""
    shape, stride = info.shape, info.stride
    if stride is None or len(shape) < 2:
        return shape[-1] if shape else None
    r, c = shape[-2], shape[-1]
    sr, sc = stride[-2], stride[-1]
    if sc == 1 or c == 1:
        return sr if r > 1 else c
    if sr == 1 or r == 1:
        return sc
    return None


def _bf16(x):
    if torch.is_tensor(x):
        return x.to(torch.bfloat16) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _bf16(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_bf16(v) for v in x)
    return x


def scan(gm) -> tuple[float, float, list]:
    total = bad = 0.0
    shapes = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or ir.op_name(n) not in GEMMS:
            continue
        ins, outs = ir.operand_infos(n), ir.infos(n)
        if not ins or not outs or ins[0].dtype not in (torch.bfloat16, torch.float16):
            continue
        mats = [t for t in ins if t is not None and len(t.shape) >= 1 and t.shape[-1] != 1][:3] + [outs[0]]
        out = outs[0]
        k = ins[0].shape[-1] if ir.op_name(n) in ("linear", "mm", "bmm", "matmul") else ins[1].shape[-1]
        flops = 2.0 * out.numel * int(k)
        total += flops
        lds = [_ld(t) for t in mats]
        if any(ld is None or int(ld) % 8 for ld in lds):
            bad += flops
            shapes.append((ir.op_name(n), tuple(tuple(t.shape) for t in mats), tuple(lds)))
    return total, bad, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="")
    ap.add_argument("--batch", type=int, default=2, help="batch for every config (alignment does not depend on it)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    names = [c.split(":")[0] for c in args.configs.split(",") if c] or sorted(
        {c.name for c in perf_sweep.all_configs()})
    rows = []
    for name in names:
        try:
            model, inputs = perf_sweep.build(name, args.batch)
            model = model.to(torch.bfloat16).eval()
            inputs = _bf16(inputs)
            with torch.no_grad():
                gm = capture(model, inputs, inference=True)
            total, bad, shapes = scan(gm)
        except Exception as e:  # noqa: BLE001 - a model that does not build or capture: say so, go on
            rows.append((name, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}" if str(e) else type(e).__name__))
            continue
        uniq = sorted({(op, lds) for op, _, lds in shapes})[:4]
        rows.append((name, total, bad, "; ".join(f"{op} lds {lds}" for op, lds in uniq)))
        print(name, f"{bad / total:.3f}" if total else "-", rows[-1][3], flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# 16-bit GEMMs with rows not 16-byte aligned, by model ({stamp:%Y-%m-%d %H:%M} UTC, captured on the CPU)", "",
             "| model | GEMM GFLOP | unaligned share | unaligned GEMMs (op, leading dims of inputs and output) |",
             "| --- | ---: | ---: | --- |"]
    for name, total, bad, what in sorted(rows, key=lambda r: -(r[2] / r[1]) if r[1] else 1):
        share = f"{bad / total:.3f}" if total else "—"
        lines.append(f"| {name} | {total / 1e9 if total else 0:.2f} | {share} | {what} |")
    path = Path(args.out) / f"diag_gemm_alignment_scan_{stamp:%Y-%m-%d_%H%M%S}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
