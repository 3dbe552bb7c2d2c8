# Answered: How slow is SDPA when K/V of one head broadcast over q's heads (Falcon's multi-query call), and what takes it instead? The math kernel, 0.33-1.99 ms on three shapes against 0.017-0.055 for the same call with enable_gqa (cuDNN's flash kernel); with a bool mask enable_gqa or an expanded view also take cuDNN on torch 2.11 (0.032-0.138 ms): fuse_attention's broadcast rule, masked GQA on sm_90 profiles and the cost model's sdpa_math entry (results/diag_sdpa_broadcast_2026-12-04_185607.md).
"""SDPA with K/V broadcast over q's heads runs torch's math kernel on CUDA (fp32 products, the score
matrix written out); enable_gqa, or K/V expanded to q's heads, lets a fused kernel take it.

    python benchmarks/diag/diag_sdpa_broadcast.py --out /tmp/out

bf16, each variant timed with CUDA events after a GPU sleep (device time), the median of 30; the
backend each variant takes is read from the profiler's kernel names. Columns: measured ms, the cost
model's prediction for the call as written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _timing import cuda_median_ms  # noqa: E402

SHAPES = [  # (B, Hq, S, D, where)
    (8, 71, 128, 64, "Falcon-7B heads, bs8 seq128"),
    (1, 71, 1024, 64, "Falcon-7B heads, bs1 seq1024"),
    (8, 32, 512, 128, "32 heads over one, bs8 seq512"),
]


def kernels(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return "; ".join(n[:48] for n in names[:4])


class Call(torch.nn.Module):
    def __init__(self, mask: bool, gqa: bool, expand: bool):
        super().__init__()
        self.mask, self.gqa, self.expand = mask, gqa, expand

    def forward(self, q, k, v, m):
        if self.expand:
            k, v = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
        kw = {"enable_gqa": True} if self.gqa else {}
        if self.mask:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)


def predicted_ms(mod, args) -> float:
    from graphopt import capture
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    gm = capture(mod, tuple(a.to("meta") for a in args))
    cm = CostModel(get_profile("h200")[0])
    return sum(cm.node_cost(n).time_s for n in gm.graph.nodes if n.op == "call_function") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for b, h, s, d, where in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, 1, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, 1, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        m = torch.ones(s, s, device="cuda", dtype=torch.bool).tril().expand(b, 1, s, s).clone()
        ref = None
        for name, mask, gqa, expand in [("broadcast, causal", False, False, False), ("enable_gqa, causal", False, True, False),
                                        ("broadcast, bool mask", True, False, False), ("enable_gqa, bool mask", True, True, False),
                                        ("expanded view, bool mask", True, False, True)]:
            mod = Call(mask, gqa, expand)
            with torch.no_grad():
                out = mod(q, k, v, m)
                ref = out if ref is None else ref
                err = (out.float() - ref.float()).abs().max().item()
                ms = cuda_median_ms(lambda: mod(q, k, v, m), reps=30, sleep_cycles=1_000_000)
                kern = kernels(lambda: mod(q, k, v, m))
            try:
                pred = predicted_ms(mod, (q, k, v, m))
            except Exception as e:  # noqa: BLE001 - the prediction is a column, not the question
                pred = float("nan")
                print("prediction failed:", e)
            rows.append((where, name, ms, pred, err, kern))
            print(f"{where:32s} {name:26s} {ms:8.3f} ms  predicted {pred:8.3f}  max diff {err:.3g}  {kern}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    lines = [f"# SDPA with K/V broadcast over heads ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "| shape | call | measured ms | predicted ms | max diff vs first | kernels |", "| --- | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {w} | {n} | {ms:.3f} | {p:.3f} | {e:.3g} | {k} |" for w, n, ms, p, e, k in rows]
    (out / f"diag_sdpa_broadcast_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
