"""Kernel benchmark: each graphopt kernel's achieved bandwidth against a measured copy ceiling,
and its speed-up over the eager PyTorch composite it replaces (and over torch.compile of that
composite, when it compiles within --compile-timeout seconds).

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_<date>_<gpu>

bandwidth = (bytes read + bytes written, each tensor once) / median time (CUDA events, after
warm-up). Prints a Markdown table; writes <out>.md and <out>.json. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cuda_ext"))
import kx_eager as eager  # noqa: E402  (the composites, shared with the tests)

import graphopt.cuda_ext as ce  # noqa: E402


def bench(fn, reps: int = 50, warmup: int = 10) -> float:
    """Median seconds per call, CUDA events around each call (graphopt.bench's timer)."""
    from graphopt.bench import time_call

    return statistics.median(time_call(fn, reps=reps, warmup=warmup, device="cuda"))


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def cases(dev="cuda", dt=torch.bfloat16):
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    out = []
    # bias + GELU(tanh), GLM MLP shape
    x, b = r(8192, 13696), r(13696)
    out.append(("bias_act gelu_tanh 8192x13696", lambda: ce.bias_act(x, b, "gelu_tanh"),
                lambda: eager.bias_act(x, b, "gelu_tanh", None), nbytes(x, b, x)))
    x2, b2, res = r(8192, 8192), r(8192), r(8192, 8192)
    out.append(("bias_act silu+residual 8192x8192", lambda: ce.bias_act(x2, b2, "silu", res),
                lambda: eager.bias_act(x2, b2, "silu", res), nbytes(x2, b2, res, x2)))
    xn, rn, w = r(8192, 4096), r(8192, 4096), r(4096)
    out.append(("add_rms_norm 8192x4096", lambda: ce.add_rms_norm(xn, rn, w, 1e-6),
                lambda: eager.add_rms_norm(xn, rn, w, 1e-6), nbytes(xn, rn, w, xn, xn)))
    wb = r(4096)
    out.append(("add_layer_norm 8192x4096", lambda: ce.add_layer_norm(xn, rn, w, wb, 1e-5),
                lambda: eager.add_layer_norm(xn, rn, w, wb, 1e-5), nbytes(xn, rn, w, wb, xn, xn)))
    gu = r(8192, 2 * 13696)
    out.append(("swiglu 8192x(2x13696)", lambda: ce.swiglu(gu), lambda: eager.swiglu(gu), nbytes(gu) * 3 // 2))
    B, S, Hq, Hk, D = 4, 4096, 32, 2, 128
    q = r(B, S, Hq, D).transpose(1, 2)
    k = r(B, S, Hk, D).transpose(1, 2)
    cos, sin = r(1, S, D // 2), r(1, S, D // 2)
    out.append(("rotary GLM partial q[4,32,4096,128]", lambda: ce.rotary(q, k, cos, sin, True),
                lambda: eager.rotary(q, k, cos, sin, True), 2 * nbytes(q, k) + nbytes(cos, sin)))
    sc = r(2, 32, 1024, 1024)
    m = torch.rand(2, 1, 1, 1024, device=dev) > 0.1
    out.append(("softmax_mask [2,32,1024,1024] bool", lambda: ce.softmax_mask(sc, 0.088, m),
                lambda: eager.softmax_mask(sc, 0.088, m), 2 * nbytes(sc) + nbytes(m)))
    p = ce.Program()
    a, bb, c = p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(a + bb) * c, dt)
    src = p.source
    xa, xb, xc = r(8192, 8192), r(8192), r(8192, 8192)
    out.append(("fused_pointwise gelu_tanh(a+b)*c 8192x8192", lambda: ce.fused_pointwise(src, [xa, xb, xc]),
                lambda: F.gelu(xa + xb, approximate="tanh") * xc, nbytes(xa, xb, xc, xa)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="path prefix for .md and .json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-timeout", type=float, default=60.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    info = ce.backend_info()
    src = torch.randn(256 * 2**20, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src), reps=a.reps)
    ceiling = 2 * nbytes(src) / t_copy
    del src, dst
    rows = []
    for name, fn, eager_fn, nb in cases():
        t = bench(fn, reps=a.reps)
        te = bench(eager_fn, reps=a.reps)
        tc = None
        note = ""
        if not a.no_compile:
            try:
                t0 = time.time()
                cf = torch.compile(eager_fn)
                cf()
                ct = time.time() - t0
                if ct <= a.compile_timeout:
                    tc = bench(cf, reps=a.reps)
                else:
                    note = f"compile {ct:.0f}s > limit"
            except Exception as e:  # noqa: BLE001
                note = f"compile failed: {type(e).__name__}"
        bw = nb / t
        rows.append(dict(kernel=name, bytes=nb, us=t * 1e6, tbps=bw / 1e12, frac=bw / ceiling, eager_us=te * 1e6,
                         speedup_eager=te / t, compile_us=None if tc is None else tc * 1e6,
                         speedup_compile=None if tc is None else tc / t, floor_us=nb / ceiling * 1e6, note=note))
        print(f"  {name}: {t * 1e6:.1f} us, {bw / 1e12:.2f} TB/s ({bw / ceiling:.0%})", flush=True)
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, cuda=torch.version.cuda, backend=info["backend"],
                pointwise=info["pointwise"], copy_ceiling_tbps=ceiling / 1e12, reps=a.reps)
    md = [f"# graphopt kernel benchmark, {meta['date']}, {meta['gpu']}", "",
          f"torch {meta['torch']}, CUDA {meta['cuda']}, backend `{meta['backend']}`, fused_pointwise via "
          f"`{meta['pointwise']}`. bf16. Copy ceiling (1 GiB device-to-device copy, read+write): "
          f"**{ceiling / 1e12:.2f} TB/s**. Median of {a.reps} timed calls (CUDA events) after warm-up. "
          "Bytes = every input read once + every output written once.", "",
          "| kernel | MB moved | µs | floor µs | TB/s | % of copy | eager µs | × eager | torch.compile µs | × compile |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        comp = "—" if r["compile_us"] is None else f"{r['compile_us']:.1f}"
        sc = "—" if r["speedup_compile"] is None else f"{r['speedup_compile']:.2f}"
        md.append(f"| {r['kernel']} | {r['bytes'] / 1e6:.0f} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['tbps']:.2f} | "
                  f"{r['frac']:.0%} | {r['eager_us']:.1f} | {r['speedup_eager']:.2f} | {comp} | {sc} |"
                  + (f" {r['note']}" if r["note"] else ""))
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        base = Path(a.out)
        if base.suffix in (".md", ".json"):
            base = base.with_suffix("")
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".md").write_text(text)
        base.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
