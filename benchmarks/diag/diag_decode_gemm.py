"""Decode GEMMs (M = 1, 8, 32 tokens): cuBLAS's weight-read bandwidth against the copy bandwidth, and
the cost model's price of each projection against the measured time.

    python benchmarks/diag/diag_decode_gemm.py --out DIR

For the projections of Llama-3-8B (qkv 4096x6144, o 4096x4096, gate+up 4096x28672, down
14336x4096, lm_head 4096x128256) and GLM-4-9B (qkv 4096x4608 with bias, o 4096x4096, gate+up
4096x27392, down 13696x4096, lm_head 4096x151552), bf16, ``F.linear(x, W)`` with x [M, K] under
both BLAS back ends torch offers (cublas, cublaslt). Each call reads its own copy of W (enough
copies to outgrow the L2 cache, as a decode step's layers do), captured into a CUDA graph and
replayed; µs per call, the weight bytes over that time (GB/s) and as a fraction of the measured
copy bandwidth, the kernels one call launches (torch.profiler), and the cost model's prediction
(the shipped h200 profile with CUDA-graph launch costs). The last table adds the shapes up into
one decode step per model (32 / 40 layers + the LM head): measured, predicted and the weight-read
floor. A last table times the SwiGLU MLP's gate+up half at each M both ways lower_gemm_swiglu chooses
between (cuBLAS + graphopt::swiglu, graphopt::gemm_swiglu). Writes diag_decode_gemm_<date>.{json,md}
under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from graphopt.cost.model import CostModel  # noqa: E402
from graphopt.cost.profiles import get_profile  # noqa: E402
from _timing import graph_us_per_call, measure_row, table_lines, write_rows  # noqa: E402

# model: (layers, {name: (K, N, bias)})
MODELS = {
    "llama3-8b": (32, {"qkv": (4096, 6144, False), "o": (4096, 4096, False), "gate_up": (4096, 28672, False),
                       "down": (14336, 4096, False), "lm_head": (4096, 128256, False)}),
    "glm4-9b": (40, {"qkv": (4096, 4608, True), "o": (4096, 4096, False), "gate_up": (4096, 27392, False),
                     "down": (13696, 4096, False), "lm_head": (4096, 151552, False)}),
}
TOKENS = (1, 8, 32)
L2_BYTES = 60e6


def copy_bandwidth() -> float:
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = graph_us_per_call(lambda: dst.copy_(src), 1, replays=3, reps=10)
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


def predicted_us(cm: CostModel, M: int, K: int, N: int, bias: bool) -> float:
    """The cost model's time of ``linear(x [M, K], W [N, K], b)`` (a scratch graph of meta tensors)."""
    g = fx.Graph()
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = meta(M, K), meta(N, K)
    args = [x, w]
    if bias:
        b = g.placeholder("b")
        b.meta["val"] = meta(N)
        args.append(b)
    n = g.call_function(torch.ops.aten.linear.default, tuple(args))
    n.meta["val"] = meta(M, N)
    return float(cm.node_cost(n).time_s) * 1e6


def kernels(fn) -> list:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:70] for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    prof, _ = get_profile("h200")
    cm = CostModel(dataclasses.replace(prof, launch_overhead_s=prof.launch_overhead_graph_s))
    rows: list = []
    for model, (layers, shapes) in MODELS.items():
        for name, (K, N, bias) in shapes.items():
            wbytes = N * K * 2
            copies = max(2, min(8, math.ceil(4 * L2_BYTES / wbytes)))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
            b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
            for M in TOKENS:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                for lib in ("cublas", "cublaslt"):
                    def measure(row, x=x, ws=ws, b=b, lib=lib):
                        torch.backends.cuda.preferred_blas_library(lib)
                        fn = lambda: [F.linear(x, w, b) for w in ws]  # noqa: E731
                        us = graph_us_per_call(fn, len(ws), replays=3, reps=10)
                        row.update(us=us, gbps=wbytes / (us * 1e-6) / 1e9, of_copy=wbytes / (us * 1e-6) / bw,
                                   kernels=kernels(lambda: F.linear(x, ws[0], b)))
                    measure_row(rows, {"model": model, "proj": name, "K": K, "N": N, "M": M, "lib": lib,
                                       "weight_MB": wbytes / 1e6, "floor_us": wbytes / bw * 1e6,
                                       "predicted_us": predicted_us(cm, M, K, N, bias)}, measure)
            del ws
            torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    swiglu_rows = swiglu_epilogue(cm, bw)
    cols = [("model", lambda r: r["model"], False), ("proj", lambda r: r["proj"], False),
            ("K x N", lambda r: f"{r['K']}x{r['N']}", False), ("M", lambda r: str(r["M"]), True),
            ("lib", lambda r: r["lib"], False), ("MB", lambda r: f"{r['weight_MB']:.1f}", True),
            ("floor µs", lambda r: f"{r['floor_us']:.1f}", True), ("µs", lambda r: f"{r['us']:.1f}", True),
            ("GB/s", lambda r: f"{r['gbps']:.0f}", True), ("of copy", lambda r: f"{r['of_copy']:.0%}", True),
            ("predicted µs", lambda r: f"{r['predicted_us']:.1f}", True),
            ("kernels", lambda r: ", ".join(f"`{k}`" for k in r["kernels"]), False)]
    intro = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s; "
             "µs per call replayed from a CUDA graph, each call over its own copy of the weight; floor = weight "
             "bytes / copy bandwidth; predicted: the shipped h200 profile with CUDA-graph launch costs")
    lines = table_lines("# Decode GEMMs: cuBLAS at M = 1, 8, 32", intro, cols, rows)
    # one decode step's projections per model, with the faster library per shape
    lines += ["", "## A decode step's projections (layers x (qkv + o + gate_up + down) + lm_head)", "",
              "| model | M | measured ms | predicted ms | floor ms | measured / floor |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for model, (layers, shapes) in MODELS.items():
        for M in TOKENS:
            meas = pred = floor = 0.0
            ok = True
            for name in shapes:
                rs = [r for r in rows if r["model"] == model and r["proj"] == name and r["M"] == M and "us" in r]
                if not rs:
                    ok = False
                    continue
                best = min(rs, key=lambda r: r["us"])
                n = 1 if name == "lm_head" else layers
                meas += n * best["us"]
                pred += n * best["predicted_us"]
                floor += n * best["floor_us"]
            if ok:
                lines.append(f"| {model} | {M} | {meas / 1e3:.3f} | {pred / 1e3:.3f} | {floor / 1e3:.3f} | "
                             f"{meas / floor:.2f} |")
    lines += [""] + table_lines(
        "## SwiGLU epilogue at decode: cuBLAS gate+up then graphopt::swiglu, against graphopt::gemm_swiglu",
        "what lower_gemm_swiglu chooses between (the persistent Triton GEMM's tiles are 128 rows: at M <= 32 most "
        "of each tile is padding); µs per MLP half, CUDA graph, own weight copy per call",
        [("model", lambda r: r["model"], False), ("M", lambda r: str(r["M"]), True),
         ("variant", lambda r: r["variant"], False), ("µs", lambda r: f"{r['us']:.1f}", True),
         ("of copy", lambda r: f"{r['of_copy']:.0%}", True), ("predicted µs", lambda r: f"{r['predicted_us']:.1f}", True)],
        swiglu_rows)
    write_rows(a.out, "diag_decode_gemm", rows + swiglu_rows, lines)
    return 0


def swiglu_epilogue(cm: CostModel, bw: float) -> list:
    """The gate+up projection and its activation, both ways, at each M (rows tagged "swiglu")."""
    import graphopt.cuda_ext  # noqa: F401  (the graphopt ops; builds the CUDA kernels once if needed)
    from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up

    rows: list = []
    for model, (_, shapes) in MODELS.items():
        K, N2, _ = shapes["gate_up"]
        n = N2 // 2
        wbytes = N2 * K * 2
        copies = max(2, min(8, math.ceil(4 * L2_BYTES / wbytes)))
        ws = [torch.randn(N2, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        wis = [interleave_gate_up(w, 128) for w in ws]
        for M in TOKENS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            variants = {
                "linear + swiglu": (lambda: [torch.ops.graphopt.swiglu(F.linear(x, w)) for w in ws],
                                    predicted_us(cm, M, K, N2, False) + _swiglu_predicted(cm, M, n)),
                "gemm_swiglu": (lambda: [torch.ops.graphopt.gemm_swiglu(x, w, n, 128) for w in wis],
                                _gemm_swiglu_predicted(cm, M, K, wis[0].shape[0], n)),
            }
            for name, (fn, pred) in variants.items():
                def measure(row, fn=fn):
                    us = graph_us_per_call(fn, copies, replays=3, reps=10)
                    row.update(us=us, of_copy=wbytes / (us * 1e-6) / bw)
                measure_row(rows, {"table": "swiglu", "model": model, "M": M, "variant": name, "predicted_us": pred},
                            measure)
        del ws, wis
        torch.cuda.empty_cache()
    return rows


def _swiglu_predicted(cm: CostModel, M: int, n: int) -> float:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(M, 2 * n, dtype=torch.bfloat16, device="meta")
    node = g.call_function(torch.ops.graphopt.swiglu.default, (x,))
    node.meta["val"] = torch.empty(M, n, dtype=torch.bfloat16, device="meta")
    return float(cm.node_cost(node).time_s) * 1e6


def _gemm_swiglu_predicted(cm: CostModel, M: int, K: int, rows: int, n: int) -> float:
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"] = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
    w.meta["val"] = torch.empty(rows, K, dtype=torch.bfloat16, device="meta")
    node = g.call_function(torch.ops.graphopt.gemm_swiglu.default, (x, w, n, 128))
    node.meta["val"] = torch.empty(M, n, dtype=torch.bfloat16, device="meta")
    return float(cm.node_cost(node).time_s) * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
