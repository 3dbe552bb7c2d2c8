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
between (cuBLAS + graphopt::swiglu, graphopt::gemm_swiglu).

At M <= 16 the same calls run through ``graphopt::gemv`` too (lib "gemv": the split-K Triton GEMV
with its planned blocks; at M = 1 on Llama's shapes also three other block/stage choices, lib
"gemv <config>"), and the run ends with the fits ``lower_gemv`` prices with: cuBLAS's small-M calls
(the faster library per call) and the GEMV's, each as ``bytes / (bandwidth * memory_scale) +
fixed_s`` over the shapes, printed as the profile's ``op_efficiency`` entries ("small_m_linear",
"gemv") to paste into ``graphopt/cost/profiles/h200.json``, with each fit's worst error. Writes
diag_decode_gemm_<date>.{json,md} under --out; ``--quick``: Llama's shapes at M = 1 and 8 only.
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
from _timing import copy_bandwidth, graph_us_per_call, measure_row, table_lines, write_rows  # noqa: E402

# model: (layers, {name: (K, N, bias)})
MODELS = {
    "llama3-8b": (32, {"qkv": (4096, 6144, False), "o": (4096, 4096, False), "gate_up": (4096, 28672, False),
                       "down": (14336, 4096, False), "lm_head": (4096, 128256, False)}),
    "glm4-9b": (40, {"qkv": (4096, 4608, True), "o": (4096, 4096, False), "gate_up": (4096, 27392, False),
                     "down": (13696, 4096, False), "lm_head": (4096, 151552, False)}),
}
TOKENS = (1, 8, 32)
L2_BYTES = 60e6


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
    p.add_argument("--quick", action="store_true", help="Llama's shapes at M = 1 and 8 only, no SwiGLU table")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    import graphopt.cuda_ext  # noqa: F401  (torch.ops.graphopt.gemv)
    from graphopt.cuda_ext import gemv_triton

    bw = copy_bandwidth()
    prof, _ = get_profile("h200")
    cm = CostModel(dataclasses.replace(prof, launch_overhead_s=prof.launch_overhead_graph_s))
    rows: list = []
    models = {"llama3-8b": MODELS["llama3-8b"]} if a.quick else MODELS
    tokens = (1, 8) if a.quick else TOKENS
    for model, (layers, shapes) in models.items():
        for name, (K, N, bias) in shapes.items():
            wbytes = N * K * 2
            copies = max(2, min(8, math.ceil(4 * L2_BYTES / wbytes)))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
            b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
            for M in tokens:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                libs = {"cublas": None, "cublaslt": None}
                if M <= gemv_triton.MAX_M:
                    libs["gemv"] = {}
                    if M == 1 and model == "llama3-8b":
                        for cfg in GEMV_CONFIGS:
                            libs["gemv " + ",".join(f"{k}={v}" for k, v in cfg.items())] = cfg
                for lib, cfg in libs.items():
                    def measure(row, x=x, ws=ws, b=b, lib=lib, cfg=cfg):
                        if cfg is None:
                            torch.backends.cuda.preferred_blas_library(lib)
                            one = lambda w: F.linear(x, w, b)  # noqa: E731
                        else:
                            one = lambda w: gemv_triton.gemv_triton(x, w, b, **cfg)  # noqa: E731
                            ref = F.linear(x.double(), ws[0].double(), None if b is None else b.double())
                            row["max_abs_err"] = (one(ws[0]).double() - ref).abs().max().item()
                            row.update(plan={k: v for k, v in gemv_triton.plan(M, N, K, _sms(), **cfg).items()})
                        fn = lambda: [one(w) for w in ws]  # noqa: E731
                        us = graph_us_per_call(fn, len(ws), replays=3, reps=10)
                        row.update(us=us, gbps=wbytes / (us * 1e-6) / 1e9, of_copy=wbytes / (us * 1e-6) / bw,
                                   kernels=kernels(lambda: one(ws[0])))
                    measure_row(rows, {"model": model, "proj": name, "K": K, "N": N, "M": M, "lib": lib,
                                       "bias": bias, "weight_MB": wbytes / 1e6, "floor_us": wbytes / bw * 1e6,
                                       "predicted_us": predicted_us(cm, M, K, N, bias)}, measure)
            del ws
            torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    swiglu_rows = [] if a.quick else swiglu_epilogue(cm, bw)
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
    lines = table_lines("# Decode GEMMs: cuBLAS and graphopt::gemv at M = 1, 8, 32", intro, cols, rows)
    # one decode step's projections per model, with the faster library per shape
    lines += ["", "## A decode step's projections (layers x (qkv + o + gate_up + down) + lm_head)", "",
              "| model | M | measured ms | predicted ms | floor ms | measured / floor |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for model, (layers, shapes) in models.items():
        for M in tokens:
            meas = pred = floor = 0.0
            ok = True
            for name in shapes:
                rs = [r for r in rows if r["model"] == model and r["proj"] == name and r["M"] == M and "us" in r
                      and r["lib"] in ("cublas", "cublaslt")]
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
    glines, entries = gemv_lines(rows, models, tokens, bw, prof)
    lines += [""] + glines
    if entries:  # the shipped profile with the fitted entries: --target for optimize, the bench, diag_decode_step
        import json
        from pathlib import Path

        fitted = prof
        for key, entry in entries.items():
            fitted = fitted.with_efficiency(key, entry)
        d = fitted.to_dict()
        d["name"] = "h200-decode-fit"
        d["source"] = {**d.get("source", {}), "decode_fit": "op_efficiency small_m_linear and gemv fitted by "
                       "benchmarks/diag/diag_decode_gemm.py on this device"}
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "h200_decode_fit.json").write_text(json.dumps(d, indent=1))
        lines += ["", f"Wrote {Path(a.out) / 'h200_decode_fit.json'}: the h200 profile with these entries "
                  "(optimize(target=that path))."]
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


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
        if torch.cuda.is_available() else 132


GEMV_CONFIGS = ({"block_n": 32}, {"block_n": 128}, {"block_k": 256, "stages": 3})


def _fit(points: list) -> tuple[float, float, float]:
    """``us = slope * x + fixed`` over (x, us) points, least squares on the relative error (a
    13 µs projection weighs as much as a 250 µs vocabulary projection): (memory_scale = 1 / slope,
    fixed_s, worst relative error)."""
    # minimise sum((slope * x + fixed - y) / y)^2: normal equations in u = x / y, v = 1 / y
    suu = sum((x / y) ** 2 for x, y in points)
    suv = sum(x / y ** 2 for x, y in points)
    svv = sum(1 / y ** 2 for _, y in points)
    su = sum(x / y for x, y in points)
    sv = sum(1 / y for _, y in points)
    det = suu * svv - suv * suv
    slope, fixed = (su * svv - sv * suv) / det, (suu * sv - suv * su) / det
    if fixed < 0:  # no negative fixed time: the best slope through the origin
        slope, fixed = su / suu, 0.0
    worst = max(abs(slope * x + fixed - y) / y for x, y in points)
    return 1.0 / slope, fixed * 1e-6, worst


def gemv_lines(rows: list, models: dict, tokens, bw: float, prof) -> tuple[list, dict]:
    """cuBLAS (the faster library per call) against graphopt::gemv per projection at M <= 16, the
    step's projections added up, and the op_efficiency fits lower_gemv prices with: (Markdown
    lines, {key: entry} of the fits, empty without enough calls)."""
    from graphopt.cuda_ext import gemv_triton

    lines = ["## graphopt::gemv against cuBLAS at M <= 16 (µs per call, CUDA graph, own weight copy per call)", "",
             "| model | proj | M | cuBLAS µs | gemv µs | gemv best config µs | gemv / cuBLAS | gemv of copy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lin_pts, gemv_pts, step, sizes = [], [], {}, []
    for model, (layers, shapes) in models.items():
        for name, (K, N, bias) in shapes.items():
            for M in tokens:
                if M > gemv_triton.MAX_M:
                    continue
                at = [r for r in rows if r["model"] == model and r["proj"] == name and r["M"] == M and "us" in r]
                cub = [r for r in at if r["lib"] in ("cublas", "cublaslt")]
                gem = [r for r in at if r["lib"] == "gemv"]
                cfgs = [r for r in at if r["lib"].startswith("gemv ")]
                if not cub or not gem:
                    continue
                c, g = min(cub, key=lambda r: r["us"]), gem[0]
                best = min(cfgs + [g], key=lambda r: r["us"])
                lines.append(f"| {model} | {name} | {M} | {c['us']:.1f} | {g['us']:.1f} | {best['us']:.1f} "
                             f"({best['lib'][5:] or 'planned'}) | {g['us'] / c['us']:.3f} | {g['of_copy']:.0%} |")
                n = 1 if name == "lm_head" else layers
                s = step.setdefault((model, M), [0.0, 0.0, 0.0])
                s[0] += n * c["us"]
                s[1] += n * g["us"]
                s[2] += n * min(c["us"], g["us"])
                lin_bytes = (N * K + M * K + M * N + (N if bias else 0)) * 2
                sizes.append(N * K * 2)
                lin_pts.append((lin_bytes / prof.bandwidth * 1e6, c["us"]))
                p = gemv_triton.plan(M, N, K, _sms())
                gb = lin_bytes + (2 * p["splits"] * M * N * 4 if p["splits"] > 1 else 0)
                extra = prof.kernel_fixed_s if p["splits"] > 1 else 0.0
                gemv_pts.append(((gb / prof.bandwidth + extra) * 1e6, g["us"]))
    lines += ["", "| model | M | projections with cuBLAS ms | with gemv ms | each the faster ms |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for (model, M), (c, g, b) in step.items():
        lines.append(f"| {model} | {M} | {c / 1e3:.3f} | {g / 1e3:.3f} | {b / 1e3:.3f} |")
    entries: dict = {}
    if len(lin_pts) >= 3 and len(gemv_pts) >= 3:
        for key, pts in (("small_m_linear", lin_pts), ("gemv", gemv_pts)):
            scale, fixed, worst = _fit(pts)
            # below the smallest weight timed the fixed time is extrapolated: lower_gemv refuses there
            entries[key] = {"memory_scale": round(scale, 4), "fixed_s": round(fixed, 8), "min_bytes": min(sizes)}
            lines.append("")
            lines.append(f"- fit `{key}`: memory_scale {scale:.4f} of the profile's {prof.bandwidth / 1e12:.2f} TB/s, "
                         f"fixed {fixed * 1e6:.2f} µs; worst error {worst:.1%} over {len(pts)} calls")
        import json

        lines += ["", "Profile entries for graphopt/cost/profiles/h200.json (`op_efficiency`; lower_gemv lowers where "
                  "the gemv entry prices below small_m_linear):", "", "```json", json.dumps(entries, indent=1), "```"]
    return lines, entries


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
