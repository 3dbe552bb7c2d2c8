"""Answers: which key split count and launch configuration make graphopt's decode attention fastest
for a batch-1 grouped-query decode step (Llama-3-8B heads: 32 query, 8 key/value, head dim 128),
with the combine fused into the split kernel or as a second kernel, and how it compares with a trivial kernel's time in a CUDA graph? Per case: µs per call
from CUDA-graph replays (20 calls per graph), and the kernels' own times under the profiler."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--past", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--splits", default="4,8,16,32")
    ap.add_argument("--quick", action="store_true", help="num_warps 4 and default stages only")
    args = ap.parse_args(argv)
    os.environ.setdefault("GRAPHOPT_KERNELS", "reference")
    import graphopt.cuda_ext  # noqa: F401
    from graphopt.cuda_ext import decode_attention_triton as dat
    from _timing import graph_us_per_call

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows = []
    trivial = torch.zeros(1, device=dev)
    rows.append({"case": "trivial add (1 element)", "us": graph_us_per_call(lambda: [trivial.add_(1) for _ in range(20)], 20)})
    print(rows[-1], flush=True)
    for cache in (args.past + 16, 2 * args.past):
        q = torch.randn(1, args.heads, 1, 128, dtype=dt, device=dev)
        k = torch.randn(1, args.kv_heads, cache, 128, dtype=dt, device=dev)
        v = torch.randn(1, args.kv_heads, cache, 128, dtype=dt, device=dev)
        kv_len = torch.tensor([args.past + 1], device=dev)
        mask = torch.zeros(1, 1, 1, cache, dtype=dt, device=dev)
        mask[..., args.past + 1:] = float("-inf")
        default = dat.plan(q.shape, k.shape, torch.cuda.get_device_properties(dev).multi_processor_count)["splits"]
        split_list = [int(x) for x in args.splits.split(",")]
        if args.quick:
            configs = [(s, 4, None, f) for s in split_list for f in (True, False)]
        else:
            configs = [(s, w, st, True) for s, w, st in itertools.product(split_list, (2, 4, 8), (1, 2, 3))]
            configs += [(s, 4, st, False) for s, st in itertools.product(split_list, (1, 2, 3))]
        for splits, warps, stages, fused in configs:
            def call():
                for _ in range(20):
                    dat.decode_attention_triton(q, k, v, mask, kv_len, 0.088, splits=splits,
                                                num_warps=warps, num_stages=stages, fused_combine=fused)
            try:
                us = graph_us_per_call(call, 20)
            except Exception as e:  # a configuration Triton cannot compile
                print(f"cache {cache} splits {splits} warps {warps} stages {stages} fused {fused}: "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"cache": cache, "splits": splits, "warps": warps, "stages": stages, "fused": fused, "us": us,
                         "default_splits": default})
            print(rows[-1], flush=True)
    best = {}
    for r in rows[1:]:
        if r["cache"] not in best or r["us"] < best[r["cache"]]["us"]:
            best[r["cache"]] = r
    print("best:", best)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "diag_decode_attention_configs.json"), "w") as f:
            json.dump({"meta": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "rows": rows, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
