# Answered: Which ops besides GEMMs take GLM-4 bs8's time? Norms, SDPA, SwiGLU, a cache cat, rotary (~2.3 ms); led to the sandwich-norm kernel and the copy-free cache (results/archive/diag_glm_ops_2026-11-30_173148.md).
"""Which ops besides the GEMMs take the GLM-4 decoder's time at bs8, and how SDPA treats its GQA.

    python benchmarks/diag/diag_glm_ops.py --out DIR [--batch 8]

1. SDPA on GLM-4's attention shape (32 query heads, 2 key/value heads, head dim 128, causal,
   q/k/v laid out [B, S, H, D] as the QKV projection makes them), per backend (cuDNN, flash,
   memory-efficient, torch's choice): time per call, the kernels it launches, its output strides.
2. The 4-layer decoder as graphopt.optimize returns it, without the CUDA graph, under the profiler:
   the ops by CUDA time with their input shapes (GEMMs summed apart).
Writes diag_glm_ops_<date>.md under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import cuda_median_ms  # noqa: E402


def kernels_of(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
            for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, S, H, KV, D = a.batch, 1024, 32, 2, 128
    lines = [f"# GLM-4 ops at bs{B} — {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "## SDPA, q/k/v laid out [B, S, H, D], causal, GQA 32/2", "",
             "| backend | ms | output strides | kernels (µs) |", "| --- | ---: | --- | --- |"]
    qkv = torch.randn(B, S, H * D + 2 * KV * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[..., :H * D].view(B, S, H, D).transpose(1, 2)
    k = qkv[..., H * D:H * D + KV * D].reshape(B, S, KV, D).transpose(1, 2)
    v = qkv[..., H * D + KV * D:].reshape(B, S, KV, D).transpose(1, 2)
    for name, be in (("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("flash", [SDPBackend.FLASH_ATTENTION]),
                     ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("default", None)):
        def f(be=be):
            if be is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            o = f()
            ks = kernels_of(f)
            lines.append(f"| {name} | {cuda_median_ms(f, reps=20, warmup=1):.3f} | {tuple(o.stride())} | "
                         + "; ".join(f"{n[:70]} ({t:.0f})" for n, t in ks) + " |")
        except Exception as e:  # noqa: BLE001
            lines.append(f"| {name} | — | — | {type(e).__name__}: {str(e).splitlines()[0][:150]} |")
        print(lines[-1], flush=True)

    import graphopt
    from graphopt.examples import zoo
    from torch.profiler import ProfilerActivity, profile

    m, inputs = zoo.get("glm4-9b-4l", batch=B, seq_len=S)
    m = m.to("cuda", torch.bfloat16).eval()
    inputs = tuple(x.cuda() for x in inputs)
    opt = graphopt.optimize(m, inputs, check_accuracy=False, cuda_graphs=False)
    with torch.no_grad():
        for _ in range(3):
            opt(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            opt(*inputs)
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0:
            rows.append((t, e.key, e.count, str(e.input_shapes)[:160]))
    rows.sort(reverse=True)
    lines += ["", "## graphopt, bs%d, no CUDA graph: ops by self CUDA µs" % B, "",
              "| µs | op | calls | input shapes |", "| ---: | --- | ---: | --- |"]
    lines += [f"| {t:.0f} | {k} | {c} | {s} |" for t, k, c, s in rows[:30]]
    print("\n".join(lines[-32:]), flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"diag_glm_ops_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
