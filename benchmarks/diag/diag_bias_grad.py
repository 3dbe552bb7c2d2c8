# Answered: How fast can a linear's bias gradient be computed? Device time at 16384 x 768: aten's reduction 29.1 us, graphopt::column_sum (a Triton kernel, since removed) 16.6, cuBLAS's product with a ones vector 11.6, the fastest on every shape: biased_linear's backward uses it (results/diag_bias_grad_2026-12-03_171646.md; the first run, …164022.md, timed the host for column_sum's call).
"""How fast can a linear layer's bias gradient (the output gradient summed over its rows) be computed,
by shape: aten's reduction (what autograd runs) or a cuBLAS product with a vector of ones (what
graphopt::biased_linear's backward runs)?

    python benchmarks/diag/diag_bias_grad.py --out /tmp/out

bf16 [R, N] gradients; each method called back to back over several distinct tensors (more bytes
than L2 holds, so each call reads from memory), queued behind a GPU sleep so the events time the
device, not the host's launches; the median of 7 runs. Rate: the gradient's bytes over the time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402

SHAPES = [  # (rows, width, where)
    (16384, 768, "BERT-base bs32 s512 / GPT-2 bs16 s1024: q, k, v, o, down"),
    (16384, 2304, "GPT-2 merged qkv"),
    (16384, 3072, "BERT-base / GPT-2 up"),
    (12608, 768, "ViT-B/16 bs64"),
    (8192, 2048, "Qwen2.5-3B bs4 s2048: q"),
    (8192, 256, "Qwen2.5-3B: k, v"),
    (2048, 768, "BERT-base bs4 s512"),
    (512, 4096, "small batch, wide"),
]


def run(fn, xs, reps: int = 7) -> float:
    for x in xs[:3]:
        fn(x)
    torch.cuda.synchronize()
    per = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # the device busy while the calls are queued: their device time, not the host's
        s.record()
        for x in xs:
            fn(x)
        e.record()
        e.synchronize()
        per.append(s.elapsed_time(e) * 1e3 / len(xs))
    return statistics.median(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    copy_rows = []
    rows = []
    for R, N, where in SHAPES:
        nbytes = R * N * 2
        count = max(8, int(400e6 // nbytes))
        xs = [torch.randn(R, N, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        ones = torch.ones(R, device="cuda", dtype=torch.bfloat16)
        ref = xs[0].double().sum(0)
        methods = {
            "aten sum(0)": lambda x: x.sum(0),
            "ones @ g (cuBLAS)": lambda x: torch.mv(x.t(), ones),
            "copy (rate reference)": lambda x: x.clone(),
        }
        row = {"rows": R, "width": N, "where": where, "MB": nbytes / 1e6}
        for name, fn in methods.items():
            us = run(fn, xs)
            err = None
            if "copy" not in name:
                err = ((fn(xs[0]).double() - ref).abs().max() / ref.abs().max()).item()
            row[name] = {"us": us, "TB/s": nbytes / (us * 1e-6) / 1e12 * (2 if "copy" in name else 1), "rel_err": err}
        rows.append(row)
        print(R, N, {k: round(v["us"], 2) for k, v in row.items() if isinstance(v, dict)}, flush=True)
        del xs
        torch.cuda.empty_cache()
    stamp = time.strftime("%Y-%m-%d_%H%M%S", time.gmtime())
    lines = [f"# Bias gradients (a bf16 [R, N] gradient summed over its rows), {torch.cuda.get_device_name()}", "",
             f"{stamp} · torch {torch.__version__} · µs per call (TB/s of the gradient's bytes; copy: read + write)", "",
             "| rows × width | where | aten sum(0) | ones @ g (cuBLAS) | copy |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        cell = lambda k: f"{r[k]['us']:.1f} ({r[k]['TB/s']:.2f})"  # noqa: E731
        lines.append(f"| {r['rows']} × {r['width']} | {r['where']} | {cell('aten sum(0)')} | {cell('ones @ g (cuBLAS)')} | "
                     f"{cell('copy (rate reference)')} |")
    errs = {k: max(r[k]["rel_err"] for r in rows) for k in ("aten sum(0)", "ones @ g (cuBLAS)")}
    lines += ["", "Largest error against a float64 sum, relative to the largest sum: " +
              ", ".join(f"{k} {v:.1e}" for k, v in errs.items())]
    base = Path(args.out) / f"diag_bias_grad_{stamp}"
    base.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
