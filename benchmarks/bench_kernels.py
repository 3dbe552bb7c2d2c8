"""Kernel benchmark: each graphopt kernel's achieved bandwidth against a measured copy ceiling,
and its speed-up over the eager PyTorch composite it replaces (and over torch.compile of that
composite, when it compiles within --compile-timeout seconds).

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_<date>_<gpu>

bandwidth = (bytes read + bytes written, each tensor once) / median time (CUDA events, after
warm-up). Prints a Markdown table; writes <out>.md and <out>.json. Needs a CUDA GPU
(``--tiny`` runs tiny sizes on the CPU too, to check the script itself).

Timers: ``--timer queued`` (default) enqueues a ~1 ms GPU sleep before the start event, so the
host work of the call (op dispatch, output allocation, Triton's Python launcher) happens while
the GPU is busy and the events bracket only the GPU time of the op (the kernel's bandwidth);
``--timer isolated`` is the old timer (device idle before each call, so host overhead before
the launch counts). The JSON has both for every kernel (``us`` and ``us_isolated``).

``--variants`` also times the kernels' alternative launch configurations (norm: 1 = two vectors
per thread, 2 = one CTA per row, 3 = both; softmax_mask: 1 = one warp per row, not persistent;
rotary: 1 = 8 heads in flight per thread instead of 4), set through the extension's
``graphopt_set_variant`` C symbol, in a second table, so the fastest can be made the default.
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


TIMER = "queued"
DEVICE = "cuda"


def bench(fn, reps: int = 50, warmup: int = 10, timer: str | None = None) -> float:
    """Median seconds per call. ``queued``: CUDA events around each call with a GPU sleep queued
    first (host overhead hidden); ``isolated``: graphopt.tools.bench's timer (device idle before each
    call); on the CPU (--tiny without a GPU) perf_counter."""
    from graphopt.tools.bench import time_call

    timer = timer or TIMER
    if DEVICE != "cuda" or timer == "isolated":
        return statistics.median(time_call(fn, reps=reps, warmup=warmup, device=DEVICE))
    from _timing import cuda_median_ms

    # ~1 ms of GPU sleep queued first: the host enqueues the op meanwhile
    return cuda_median_ms(fn, reps=reps, warmup=warmup, sleep_cycles=2_000_000) / 1e3


VARIANT_FAMILY = {"norm": 0, "softmax": 1, "rotary": 2}  # kernels.h VariantKernel


def set_variant(family: str, v: int) -> bool:
    """Select a launch variant in the loaded extension (False where there is none to set)."""
    import ctypes

    lib = ce.backend_info().get("library")
    if not lib or ce.backend() != "cuda":
        return False
    try:
        f = ctypes.CDLL(lib).graphopt_set_variant
    except (OSError, AttributeError):
        return False
    return f(VARIANT_FAMILY[family], v) >= 0


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def cases(dev="cuda", dt=torch.bfloat16, tiny=False):
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    T = 64 if tiny else 8192  # tokens (rows)
    out = []
    # bias + GELU(tanh), GLM MLP shape
    x, b = r(T, 13696), r(13696)
    out.append(("bias_act gelu_tanh 8192x13696", lambda: ce.bias_act(x, b, "gelu_tanh"),
                lambda: eager.bias_act(x, b, "gelu_tanh", None), nbytes(x, b, x)))
    x2, b2, res = r(T, 8192), r(8192), r(T, 8192)
    out.append(("bias_act silu+residual 8192x8192", lambda: ce.bias_act(x2, b2, "silu", res),
                lambda: eager.bias_act(x2, b2, "silu", res), nbytes(x2, b2, res, x2)))
    xn, rn, w = r(T, 4096), r(T, 4096), r(4096)
    out.append(("add_rms_norm 8192x4096", lambda: ce.add_rms_norm(xn, rn, w, 1e-6),
                lambda: eager.add_rms_norm(xn, rn, w, 1e-6), nbytes(xn, rn, w, xn, xn)))
    wb = r(4096)
    out.append(("add_layer_norm 8192x4096", lambda: ce.add_layer_norm(xn, rn, w, wb, 1e-5),
                lambda: eager.add_layer_norm(xn, rn, w, wb, 1e-5), nbytes(xn, rn, w, wb, xn, xn)))
    gu = r(T, 2 * 13696)
    out.append(("swiglu 8192x(2x13696)", lambda: ce.swiglu(gu), lambda: eager.swiglu(gu), nbytes(gu) * 3 // 2))
    B, S, Hq, Hk, D = (1, 64, 32, 2, 128) if tiny else (4, 4096, 32, 2, 128)
    q = r(B, S, Hq, D).transpose(1, 2)
    k = r(B, S, Hk, D).transpose(1, 2)
    cos, sin = r(1, S, D // 2), r(1, S, D // 2)
    out.append(("rotary GLM partial q[4,32,4096,128]", lambda: ce.rotary(q, k, cos, sin, True),
                lambda: eager.rotary(q, k, cos, sin, True), 2 * nbytes(q, k) + nbytes(cos, sin)))
    L = 128 if tiny else 1024
    sc = r(2, 32, L, L)
    m = torch.rand(2, 1, 1, L, device=dev) > 0.1
    out.append(("softmax_mask [2,32,1024,1024] bool", lambda: ce.softmax_mask(sc, 0.088, m),
                lambda: eager.softmax_mask(sc, 0.088, m), 2 * nbytes(sc) + nbytes(m)))
    p = ce.Program()
    a, bb, c = p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(a + bb) * c, dt)
    src = p.source
    xa, xb, xc = r(T, 8192), r(8192), r(T, 8192)
    out.append(("fused_pointwise gelu_tanh(a+b)*c 8192x8192", lambda: ce.fused_pointwise(src, [xa, xb, xc]),
                lambda: F.gelu(xa + xb, approximate="tanh") * xc, nbytes(xa, xb, xc, xa)))
    return out


def narrow_cases(dev="cuda", dt=torch.bfloat16, tiny=False):
    """Narrow rows (--variants only): where a one-block-per-row norm is bound by block scheduling
    (the profile's op_efficiency row_norm), against the persistent kernel."""
    rows = 256 if tiny else 131072
    x, r, w, b = (torch.randn(rows, 768, device=dev, dtype=dt), torch.randn(rows, 768, device=dev, dtype=dt),
                  torch.randn(768, device=dev, dtype=dt), torch.randn(768, device=dev, dtype=dt))
    return [(f"add_layer_norm {rows}x768 (narrow rows)", lambda: ce.add_layer_norm(x, r, w, b, 1e-5),
             nbytes(x, r, w, b, x, x)),
            (f"add_rms_norm {rows}x768 (narrow rows)", lambda: ce.add_rms_norm(x, r, w, 1e-6), nbytes(x, r, w, x, x))]


VARIANTS = {  # case name prefix -> (family, [(variant, label)]); variant 0 (the default) is the
    # fastest measured on the H200: a CTA per row, RMSNorm one vector per thread, LayerNorm two
    "add_rms_norm": ("norm", [(1, "2 vectors/thread"), (2, "persistent grid"), (3, "2 vectors/thread, persistent")]),
    "add_layer_norm": ("norm", [(1, "1 vector/thread"), (2, "persistent grid"), (3, "1 vector/thread, persistent")]),
    "rotary": ("rotary", [(1, "8 heads in flight")]),
    "softmax_mask": ("softmax", [(1, "persistent grid")]),
}


def main() -> int:
    global TIMER, DEVICE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="path prefix for .md and .json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-timeout", type=float, default=60.0)
    ap.add_argument("--timer", choices=("queued", "isolated"), default="queued")
    ap.add_argument("--variants", action="store_true", help="also time the alternative launch configurations")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a dry run of this script; CPU if no GPU)")
    a = ap.parse_args()
    TIMER = a.timer
    if not torch.cuda.is_available():
        if not a.tiny:
            print("bench_kernels: needs a CUDA GPU (or --tiny for a CPU dry run)", file=sys.stderr)
            return 2
        DEVICE = "cpu"
    torch.manual_seed(0)
    info = ce.backend_info()
    src = torch.randn((1 if a.tiny else 256) * 2**20, device=DEVICE, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src), reps=a.reps)
    ceiling = 2 * nbytes(src) / t_copy
    del src, dst
    rows, vrows = [], []
    for name, fn, eager_fn, nb in cases(DEVICE, tiny=a.tiny):
        t = bench(fn, reps=a.reps)
        t_iso = bench(fn, reps=a.reps, timer="isolated")
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
        rows.append(dict(kernel=name, bytes=nb, us=t * 1e6, us_isolated=t_iso * 1e6, tbps=bw / 1e12,
                         frac=bw / ceiling, eager_us=te * 1e6,
                         speedup_eager=te / t, compile_us=None if tc is None else tc * 1e6,
                         speedup_compile=None if tc is None else tc / t, floor_us=nb / ceiling * 1e6, note=note))
        print(f"  {name}: {t * 1e6:.1f} us ({t_iso * 1e6:.1f} us isolated), {bw / 1e12:.2f} TB/s "
              f"({bw / ceiling:.0%})", flush=True)
        fam = next((v for k, v in VARIANTS.items() if name.startswith(k)), None)
        if a.variants and fam is not None:
            family, vs = fam
            for v, label in vs:
                if not set_variant(family, v):
                    print(f"    variant {family}={v}: cannot be set (backend {ce.backend()})", flush=True)
                    break
                try:
                    tv = bench(fn, reps=a.reps)
                finally:
                    set_variant(family, 0)
                vrows.append(dict(kernel=name, family=family, variant=v, label=label, us=tv * 1e6,
                                  frac=nb / tv / ceiling, default_us=t * 1e6))
                print(f"    variant {family}={v} ({label}): {tv * 1e6:.1f} us ({nb / tv / ceiling:.0%})", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if a.variants:
        for name, fn, nb in narrow_cases(DEVICE, tiny=a.tiny):
            t = bench(fn, reps=a.reps)
            vrows.append(dict(kernel=name, family="norm", variant=0, label="default", us=t * 1e6,
                              frac=nb / t / ceiling, default_us=t * 1e6))
            print(f"  {name}: {t * 1e6:.1f} us ({nb / t / ceiling:.0%})", flush=True)
            if set_variant("norm", 2):
                try:
                    tv = bench(fn, reps=a.reps)
                finally:
                    set_variant("norm", 0)
                vrows.append(dict(kernel=name, family="norm", variant=2, label="persistent grid", us=tv * 1e6,
                                  frac=nb / tv / ceiling, default_us=t * 1e6))
                print(f"    variant norm=2 (persistent grid): {tv * 1e6:.1f} us ({nb / tv / ceiling:.0%})", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    meta = dict(date=datetime.date.today().isoformat(),
                gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (--tiny dry run)",
                torch=torch.__version__, cuda=torch.version.cuda, backend=info["backend"],
                pointwise=info["pointwise"], copy_ceiling_tbps=ceiling / 1e12, reps=a.reps, timer=a.timer,
                tiny=a.tiny)
    timer_txt = ("a ~1 ms GPU sleep queued before each timed call, so host overhead is hidden"
                 if a.timer == "queued" else "the device idle before each call, so host overhead counts")
    md = [f"# graphopt kernel benchmark, {meta['date']}, {meta['gpu']}", "",
          f"torch {meta['torch']}, CUDA {meta['cuda']}, backend `{meta['backend']}`, fused_pointwise via "
          f"`{meta['pointwise']}`. bf16. Copy ceiling (1 GiB device-to-device copy, read+write): "
          f"**{ceiling / 1e12:.2f} TB/s**. Median of {a.reps} timed calls (CUDA events, {timer_txt}) after "
          "warm-up. Bytes = every input read once + every output written once."
          + (" **--tiny sizes: a dry run, not a measurement.**" if a.tiny else ""), "",
          "| kernel | MB moved | µs | floor µs | TB/s | % of copy | eager µs | × eager | torch.compile µs | × compile |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        comp = "—" if r["compile_us"] is None else f"{r['compile_us']:.1f}"
        sc = "—" if r["speedup_compile"] is None else f"{r['speedup_compile']:.2f}"
        md.append(f"| {r['kernel']} | {r['bytes'] / 1e6:.0f} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['tbps']:.2f} | "
                  f"{r['frac']:.0%} | {r['eager_us']:.1f} | {r['speedup_eager']:.2f} | {comp} | {sc} |"
                  + (f" {r['note']}" if r["note"] else ""))
    md += ["", "Host overhead: the same calls timed with the device idle before each (`--timer isolated`, "
           "the timer of earlier runs), so the op's host work before its kernel starts is included:", "",
           "| kernel | µs isolated | µs queued | host µs |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        md.append(f"| {r['kernel']} | {r['us_isolated']:.1f} | {r['us']:.1f} | {r['us_isolated'] - r['us']:.1f} |")
    if vrows:
        md += ["", "Launch variants (same kernels, other configurations; variant 0 is the default above):", "",
               "| kernel | variant | µs | % of copy | default µs |", "| --- | --- | ---: | ---: | ---: |"]
        for r in vrows:
            md.append(f"| {r['kernel']} | {r['family']}={r['variant']} ({r['label']}) | {r['us']:.1f} | "
                      f"{r['frac']:.0%} | {r['default_us']:.1f} |")
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        base = Path(a.out)
        if base.suffix in (".md", ".json"):
            base = base.with_suffix("")
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".md").write_text(text)
        base.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, variants=vrows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
