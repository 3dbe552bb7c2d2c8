"""Answers: does asking L2 to prefetch a decode GEMM's weight before a latency-bound kernel (the
decode attention, or a GPU sleep of a few µs) shorten that GEMM, and by how much for each weight
size, prefetch size and window? No (results/diag_l2_prefetch_2026-12-02.md). Each case is a CUDA graph [L2 flush, prefetch?, window, GEMM]
replayed under the profiler; reported per replay: the GEMM kernel and the span from the flush's
end to the GEMM's end (medians)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def profile(g, replays: int):
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    g.replay()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ks = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            ks.append((e.name, e.time_range.start, e.time_range.end))
    ks.sort(key=lambda k: k[1])
    return ks


def measure(case, replays: int) -> dict:
    from _timing import captured

    g = captured(case)
    ks = profile(g, replays)
    spans, gemm = [], []
    groups = []
    for name, start, end in ks:   # one group per replay: the flush, then what follows it
        if "reduce_kernel" in name:
            groups.append([end, []])
        elif groups:
            groups[-1][1].append((name, start, end))
    for flush_end, rest in groups:
        g_ks = [k for k in rest if "nvjet" in k[0] or "gemm" in k[0].lower() or "gemv" in k[0] or "splitK" in k[0]]
        if g_ks:
            spans.append(max(k[2] for k in rest) - flush_end)
            gemm.append(sum(k[2] - k[1] for k in g_ks))
    if not spans:
        raise SystemExit("no flush/GEMM kernels recognised among: " + ", ".join(sorted({k[0][:60] for k in ks})))
    return {"span_us": statistics.median(spans), "gemm_us": statistics.median(gemm), "n": len(spans)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)
    os.environ.setdefault("GRAPHOPT_KERNELS", "reference")
    import graphopt.cuda_ext  # noqa: F401  (registers the Triton decode attention)
    import triton
    import triton.language as tl

    @triton.jit
    def bulk_prefetch_kernel(BASE, SINK, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # each lane asks L2 for up to CHUNK bytes (cp.async.bulk.prefetch.L2, sm_90) and does not wait
        off = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
        size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32) & -16
        done = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [BASE + off, size], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(SINK + tl.program_id(0), tl.sum(done, axis=0), mask=tl.sum(done, axis=0) != 0)  # never: keeps the asm

    class pf:  # noqa: N801  (the prefetch launcher)
        @staticmethod
        def prefetch(t, nbytes, sink, chunk, block):
            grid = (-(-nbytes // (chunk * block)),)
            bulk_prefetch_kernel[grid](t.view(-1).view(torch.uint8), sink, nbytes, CHUNK=chunk, BLOCK=block,
                                       num_warps=max(1, min(4, block // 32)))

    dev = torch.device("cuda")
    dt = torch.bfloat16
    torch.manual_seed(0)
    flush_src = torch.empty(1 << 27, dtype=dt, device=dev).normal_()   # 256 MB
    flush_acc = torch.zeros((), dtype=torch.float32, device=dev)
    x = torch.randn(1, 4096, dtype=dt, device=dev)
    q = torch.randn(1, 32, 1, 128, dtype=dt, device=dev)
    kc = torch.randn(1, 8, 1024, 128, dtype=dt, device=dev)
    vc = torch.randn(1, 8, 1024, 128, dtype=dt, device=dev)
    weights = {"o 4096x4096": torch.randn(4096, 4096, dtype=dt, device=dev),
               "qkv 6144x4096": torch.randn(6144, 4096, dtype=dt, device=dev),
               "gate 14336x4096": torch.randn(14336, 4096, dtype=dt, device=dev)}
    cycles_per_us = torch.cuda.get_device_properties(dev).clock_rate / 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1980.0

    def window(kind):
        if kind == "attention":
            torch.ops.graphopt.decode_attention(q, kc, vc, None, None, 0.088)
        elif kind.startswith("sleep"):
            torch.cuda._sleep(int(float(kind[5:]) * cycles_per_us))

    @triton.jit
    def line_prefetch_kernel(BASE, SINK, nbytes, LINES: tl.constexpr):
        off = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
        ok = (off < nbytes).to(tl.int32)
        done = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_normal [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [BASE + off, ok], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(SINK + tl.program_id(0), tl.sum(done, axis=0), mask=tl.sum(done, axis=0) != 0)

    side = torch.cuda.Stream()
    big_sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)

    def issue(variant, w, nbytes):
        if variant == "bulk 64K x128":
            pf.prefetch(w, nbytes, big_sink, chunk=1 << 16, block=128)
        elif variant == "bulk 16K x8":
            pf.prefetch(w, nbytes, big_sink, chunk=1 << 14, block=8)
        elif variant == "bulk 64K x2":
            pf.prefetch(w, nbytes, big_sink, chunk=1 << 16, block=2)
        elif variant == "line x1024":
            line_prefetch_kernel[(-(-nbytes // (128 * 1024)),)](w.view(-1).view(torch.uint8), big_sink, nbytes,
                                                                 LINES=1024, num_warps=8)
        elif variant == "side stream bulk 16K x8":
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pf.prefetch(w, nbytes, big_sink, chunk=1 << 14, block=8)

    rows = []
    for wname, w in weights.items():
        wb = w.numel() * w.element_size()
        for kind in ("none", "attention", "sleep10"):
            for variant in ("-", "bulk 64K x128", "bulk 16K x8", "bulk 64K x2", "line x1024", "side stream bulk 16K x8"):
                nbytes = 0 if variant == "-" else int(min(wb, 40e6)) // 16 * 16

                def case(w=w, kind=kind, nbytes=nbytes, variant=variant):
                    flush_src.sum(dtype=torch.float32)  # reads 256 MB, writes one value
                    if nbytes:
                        issue(variant, w, nbytes)
                    window(kind)
                    if variant.startswith("side"):
                        torch.cuda.current_stream().wait_stream(side)
                    torch.nn.functional.linear(x, w)

                try:
                    r = measure(case, args.replays)
                except Exception as e:
                    print(f"{wname} {kind} {variant}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                r.update(weight=wname, weight_mb=wb / 1e6, window=kind, variant=variant, prefetch_mb=nbytes / 1e6)
                rows.append(r)
                print(f"{wname:16s} {kind:10s} {variant:24s} {nbytes / 1e6:5.1f} MB: gemm {r['gemm_us']:6.2f} µs, "
                      f"flush end -> gemm end {r['span_us']:6.2f} µs", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "diag_l2_prefetch.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
