# Answered: what aten's concatenations, strided pointwise kernels and cuDNN's convolutions over channel counts that are not a multiple of 8 cost on the device, against the copy rate, and whether graphopt's pointwise kernel reads strided operands faster than aten (results/diag_copy_patterns_*.md).
"""Copies by stride pattern, measured: each case replayed from a CUDA graph (no launch overhead),
its nominal bytes (every input read once, every output written once) over the time as a share of
the measured copy rate, and the kernels one eager call launches (torch.profiler).

    python benchmarks/diag/diag_copy_patterns.py --out /tmp/out

Cases (bf16, batch 64): concatenations along the channels of channels_last tensors by piece width,
the same with one piece a channel slice, NCHW ones; 3x3 convolutions (aten and graphopt's fused
one) over 8k and non-8k channel counts, dense and channel-slice inputs; pointwise adds and products
of a channel slice or a transposed operand, aten against graphopt::fused_pointwise.
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

from _timing import copy_bandwidth, graph_us_per_call, kernel_counts  # noqa: E402

CL = torch.channels_last
BF = torch.bfloat16


def cl(*shape):
    return torch.randn(*shape, device="cuda", dtype=BF).contiguous(memory_format=CL)


def cases():
    n, hw = 64, 56
    out = []
    # concatenations along the channels of channels_last pieces, by piece width
    for cp in (8, 14, 16, 24, 32, 48, 64, 128):
        xs = [cl(n, cp, hw, hw) for _ in range(4)]
        out.append((f"cat CL 4 x {cp} ch @56", lambda xs=xs: torch.cat(xs, 1), 2 * sum(x.nbytes for x in xs)))
    base = cl(n, 128, 28, 28)
    xs = [base] + [cl(n, 32, 28, 28) for _ in range(15)]
    out.append(("cat CL 128 + 15 x 32 ch @28 (DenseNet)", lambda xs=xs: torch.cat(xs, 1), 2 * sum(x.nbytes for x in xs)))
    for cp in (14, 32):
        xs = [torch.randn(n, cp, hw, hw, device="cuda", dtype=BF) for _ in range(4)]
        out.append((f"cat NCHW 4 x {cp} ch @56", lambda xs=xs: torch.cat(xs, 1), 2 * sum(x.nbytes for x in xs)))
    # one piece a channel slice of a wider channels_last tensor (Res2Net's last split)
    for cp in (14, 56):
        wide = cl(n, 8 * cp, hw, hw)
        xs = [cl(n, cp, hw, hw) for _ in range(7)] + [wide[:, 7 * cp:]]
        out.append((f"cat CL 7 x {cp} ch + a slice @56", lambda xs=xs: torch.cat(xs, 1),
                    2 * sum(x.numel() * 2 for x in xs)))
    # 3x3 convolutions over channel counts 8k and not; dense and channel-slice inputs
    for c, s in ((14, 56), (16, 56), (28, 28), (32, 28), (56, 14), (64, 14)):
        x, w, b = cl(n, c, s, s), cl(c, c, 3, 3), torch.randn(c, device="cuda", dtype=BF)
        nb = 2 * x.numel() * 2 + w.nbytes
        out.append((f"conv2d 3x3 {c}->{c} @{s}", lambda x=x, w=w, b=b: F.conv2d(x, w, b, 1, 1), nb))
        out.append((f"graphopt conv_bias_relu 3x3 {c}->{c} @{s}",
                    lambda x=x, w=w, b=b: torch.ops.graphopt.conv_bias_relu(x, w, b, None, [1, 1], [1, 1], [1, 1], 1),
                    nb))
        wide = cl(n, 8 * c, s, s)
        xs = wide[:, :c]
        out.append((f"graphopt conv_bias_relu 3x3 {c}->{c} @{s}, slice input",
                    lambda x=xs, w=w, b=b: torch.ops.graphopt.conv_bias_relu(x, w, b, None, [1, 1], [1, 1], [1, 1], 1),
                    nb))
    # pointwise ops with a strided operand: aten against graphopt's generated kernel
    add = "%0 = input 0; %1 = input 1; %2 = add %0 %1; out %2 bf16"
    mul = "%0 = input 0; %1 = input 1; %2 = mul %0 %1; out %2 bf16"
    for c in (14, 28, 56):
        a, wide = cl(n, c, hw, hw), cl(n, 8 * c, hw, hw)
        y = wide[:, 3 * c:4 * c]
        out.append((f"add CL {c} ch + slice @56 (aten)", lambda a=a, y=y: a + y, 3 * a.nbytes))
        out.append((f"add CL {c} ch + slice @56 (fused_pointwise)",
                    lambda a=a, y=y: torch.ops.graphopt.fused_pointwise(add, [a, y]), 3 * a.nbytes))
        out.append((f"copy CL slice {c} of {8 * c} ch @56 (aten contiguous)",
                    lambda y=y: y.contiguous(memory_format=CL), 2 * a.nbytes))
    x = torch.randn(n, 3136, 64, device="cuda", dtype=BF)
    yt = torch.randn(n, 64, 3136, device="cuda", dtype=BF).transpose(1, 2)
    out.append(("add [64,3136,64] + transposed (aten)", lambda: x + yt, 3 * x.nbytes))
    out.append(("add [64,3136,64] + transposed (fused_pointwise)",
                lambda: torch.ops.graphopt.fused_pointwise(add, [x, yt]), 3 * x.nbytes))
    out.append(("copy transposed [64,3136,64] (aten contiguous)", lambda: yt.contiguous(), 2 * x.nbytes))
    # CoaT's q * conv(v): [B, h, N, Ch] read through a permutation of [B, N, 3, h, Ch], times a dense one
    qkv = torch.randn(n, 3137, 3, 8, 8, device="cuda", dtype=BF).permute(2, 0, 3, 1, 4)
    q = qkv[0][:, :, 1:]
    cv = torch.randn(n, 8, 3136, 8, device="cuda", dtype=BF)
    out.append(("mul q(permuted) * dense [64,8,3136,8] (aten)", lambda: q * cv, 3 * cv.nbytes))
    out.append(("mul q(permuted) * dense [64,8,3136,8] (fused_pointwise)",
                lambda: torch.ops.graphopt.fused_pointwise(mul, [q, cv]), 3 * cv.nbytes))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import graphopt  # noqa: F401 (registers graphopt's ops)
    bw = copy_bandwidth()
    rows = []
    for name, fn, nbytes in cases():
        try:
            us = graph_us_per_call(fn, 1)
            ks = kernel_counts(fn)
        except Exception as e:  # noqa: BLE001 (a diagnostic: one case's failure is printed, the rest run)
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(name, rows[-1]["error"], flush=True)
            continue
        share = nbytes / (us * 1e-6) / bw
        rows.append({"case": name, "us": round(us, 2), "bytes": int(nbytes), "share_of_copy": round(share, 3),
                     "kernels": ks})
        print(f"{name:58s} {us:9.2f} us  {share:5.2f} of copy  {ks}", flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    dev = torch.cuda.get_device_name()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    meta = {"device": dev, "torch": torch.__version__, "copy_bandwidth_GBs": round(bw / 1e9, 1), "when": stamp}
    (Path(a.out) / f"diag_copy_patterns_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# copies by stride pattern, measured ({dev}, torch {torch.__version__}, bf16, {stamp} UTC)", "",
             f"Replayed from a CUDA graph; share = nominal bytes / time / the copy rate ({bw / 1e9:.0f} GB/s).", "",
             "| case | us | share of copy | kernels of one eager call |", "| --- | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | — | — | {r['error']} |")
        else:
            lines.append(f"| {r['case']} | {r['us']:.2f} | {r['share_of_copy']:.3f} | {r['kernels']} |")
    (Path(a.out) / f"diag_copy_patterns_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
