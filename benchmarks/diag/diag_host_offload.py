"""Answers: what does the accuracy guard pay to hold a large reference output (a decoder's logits at
batch 8: 1.24 G fp32 elements, 5 GB) on the host and read it back for one check, by the kind of host
memory: page-locked (cudaHostAlloc, torch's default), page-locked by registering pages with several
threads (torch's pinned_use_cuda_host_register), page-locked in place (graphopt's: pages zeroed by torch's CPU threads, then cudaHostRegister), or
pageable; and what one comparison costs with
everything on the device. Each step is timed on its own (device synchronized); the comparison is
graphopt.accuracy._stats, the guard's own.

    python benchmarks/diag/diag_host_offload.py --gb 5 --out DIR

Writes diag_host_offload_<date>.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from graphopt import accuracy


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t


def host_copy(x, how: str):
    if how == "pageable":
        dst, alloc = timed(lambda: torch.empty(x.shape, dtype=x.dtype))
    elif how == "registered":
        dst, alloc = timed(lambda: accuracy._page_locked_empty(x.shape, x.dtype, x.device))
    else:
        dst, alloc = timed(lambda: torch.empty(x.shape, dtype=x.dtype, pin_memory=True))
    _, copy = timed(lambda: dst.copy_(x))
    return dst, alloc, copy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=5.0)
    ap.add_argument("--out", default="/tmp/out")
    a = ap.parse_args()
    n = int(a.gb * 1e9 / 4)
    ref = torch.randn(n, device="cuda")
    out = (ref + 1e-3 * torch.randn_like(ref)).to(torch.bfloat16)
    rows = []
    _, dev = timed(lambda: accuracy._stats(out, ref, 1e-2)[0].tolist())
    rows.append({"memory": "on the device", "alloc_s": 0.0, "to_host_s": 0.0, "compare_s": dev, "free_s": 0.0})
    for how in ("pinned", "pinned-register-16", "registered", "pageable"):
        if how == "pinned-register-16":
            torch.cuda.memory._set_allocator_settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:16")
        host, alloc, copy = host_copy(ref, how)
        _, cmp_ = timed(lambda: accuracy._stats(out, host, 1e-2)[0].tolist())
        pinned = host.is_pinned()
        if how == "registered":
            _, free = timed(accuracy.release_host_memory)
            del host
        else:
            del host
            _, free = timed(torch._C._host_emptyCache)
        if how == "pinned-register-16":
            torch.cuda.memory._set_allocator_settings("pinned_use_cuda_host_register:False")
        rows.append({"memory": how, "alloc_s": alloc, "to_host_s": copy, "compare_s": cmp_, "free_s": free,
                     "page_locked": pinned})
        print(rows[-1], flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "gb": a.gb}
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"diag_host_offload_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# A {a.gb:.1f} GB fp32 reference held on the host and read back for one check ({meta['gpu']}, torch {meta['torch']}, {stamp})",
             "", "| host memory | allocate s | device to host s | one comparison s | free s | total s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        tot = r["alloc_s"] + r["to_host_s"] + r["compare_s"] + r["free_s"]
        lines.append(f"| {r['memory']} | {r['alloc_s']:.3f} | {r['to_host_s']:.3f} | {r['compare_s']:.3f} | {r['free_s']:.3f} | {tot:.3f} |")
    (outdir / f"diag_host_offload_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
