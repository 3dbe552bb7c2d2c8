# Answered: How fast can a pipeline's last stage send its logits to the host? Pinned copies 55 GB/s, but torch.cat of the chunks 162 ms: one persistent pinned buffer, outputs_to_host (results/archive/diag_host_outputs_2026-11-30_145505.json).
"""Where the time goes when a pipeline's last stage sends its outputs to host memory.

    python benchmarks/diag/diag_host_outputs.py --out DIR

GLM-4's logits at bs8 seq1024 (8 micro-batches of 1 x 1024 x 151552 bf16, 310 MB each): per step,
the device-to-host copies into freshly allocated pinned memory (torch's caching host allocator),
into pageable memory (``.to("cpu")``), into one persistent pinned buffer, and the merge
(``torch.cat``) of the 8 host chunks, which torch.distributed.pipelining does at the end of a step.
Writes diag_host_outputs_<date>.json under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return min(ts)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    M, shape = 8, (1, 1024, 151552)
    xs = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(M)]
    nbytes = xs[0].numel() * 2
    keep = {}
    res = {"chunk_bytes": nbytes, "chunks": M, "torch": torch.__version__}

    def pinned():
        keep["c"] = [torch.empty_like(x, device="cpu", pin_memory=True).copy_(x) for x in xs]

    def pageable():
        keep["c"] = [x.to("cpu") for x in xs]

    buf = torch.empty((M,) + shape[1:], dtype=torch.bfloat16, pin_memory=True)

    def persistent():
        for i, x in enumerate(xs):
            buf[i:i + 1].copy_(x)

    def pinned_then_cat():
        pinned()
        keep["m"] = torch.cat(keep["c"])

    for name, fn in (("fresh pinned per chunk", pinned), ("pageable .to('cpu')", pageable),
                     ("one persistent pinned buffer", persistent), ("fresh pinned + torch.cat merge", pinned_then_cat)):
        keep.clear()
        s = timed(fn)
        res[name] = {"s": s, "GB_per_s": M * nbytes / s / 1e9}
        print(name, f"{s * 1e3:.1f} ms", f"{M * nbytes / s / 1e9:.1f} GB/s", flush=True)
    c = [torch.empty_like(x, device="cpu", pin_memory=True).copy_(x) for x in xs]
    s = timed(lambda: keep.__setitem__("m", torch.cat(c)))
    res["torch.cat of 8 pinned chunks alone"] = {"s": s}
    print("cat alone", f"{s * 1e3:.1f} ms", torch.get_num_threads(), "threads", flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"diag_host_outputs_{stamp}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
