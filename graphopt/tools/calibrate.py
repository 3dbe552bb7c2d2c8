"""``graphopt calibrate``: measure a device and write a DeviceProfile JSON the cost model loads.

    graphopt calibrate [--device cuda:0] [-o h200-measured.json] [--quick]
    graphopt explain MODEL --target h200-measured.json

On CUDA: dense matmul rate per dtype (bf16, fp16, fp32 without TF32, fp32 with TF32 as "tf32",
fp64) at 8192^3 (4096^3 with --quick), device copy bandwidth (read + write of a 1 GiB copy,
256 MiB with --quick), launch overhead (many tiny kernels back to back, wall time per kernel; and
the same kernels replayed from a CUDA graph), the host time of an fx node
(``host_node_s``: a GraphModule of back-to-back views) and of a kernel launch from a GraphModule
(``launch_overhead_s``: back-to-back tiny aten.add nodes, host issue time), SDPA rate (bf16 flash attention), host<->device
bandwidth (pinned memory) and device<->device bandwidth when there are two GPUs. The
elementwise rate is the fp32 (no TF32) matmul rate (the SIMT FMA rate). ``conv_nchw_slowdown``
and int8 are kept from the shipped profile of the same GPU when there is one.

On the CPU: ``graphopt.cost.profiles.calibrate_cpu`` plus an SDPA rate, small sizes.

Every rate is the best of a few timed chunks (CUDA events on CUDA, perf_counter on the CPU).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from ..cost.profiles import DeviceProfile, _load_json, calibrate_cpu, shipped
from ..errors import GraphoptError

__all__ = ["calibrate", "run_cli"]


def _resolve(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GraphoptError(f"unknown device '{device}'; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GraphoptError(f"--device {device}: CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise GraphoptError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) here")
    elif dev.type != "cpu":
        raise GraphoptError(f"cannot calibrate device type '{dev.type}'; use cpu or cuda")
    return dev


def _best_seconds(fn, device: torch.device, iters: int, chunks: int = 3, warmup: int = 1, queued: bool = False) -> float:
    """Seconds per call of fn: best over ``chunks`` of ``iters`` back-to-back calls. ``queued``
    (CUDA): a GPU sleep runs first while the host enqueues the calls, so the events time the
    device work alone, not the host's launch cost (cuDNN spends ~25 us of host time per
    convolution, as long as a small convolution runs)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(chunks):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(200_000 * iters)  # ~0.1 ms of GPU time per call to enqueue
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            t = time.perf_counter() - t0
        best = min(best, t / iters)
    return best


def _matmul_rate(n: int, dtype, device, iters: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _best_seconds(lambda: torch.mm(a, b), device, iters)
    return 2 * n**3 / t


def gemm_rates(a: torch.Tensor, b: torch.Tensor, seconds: float, window: float = 0.5) -> list[float]:
    """FLOP/s of ``a @ b`` run back to back for ``seconds``, one rate per ``window`` seconds (CUDA
    events around each window's calls): how the rate falls as a GPU reaches its power limit."""
    flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    rates = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls, start = 0, time.perf_counter()
        e0.record()
        while time.perf_counter() - start < window:
            for _ in range(10):
                torch.mm(a, b)
            calls += 10
            if calls % 50 == 0:  # keep the queue short, so the window's wall time is the GPU's
                torch.cuda.current_stream().synchronize()
        e1.record()
        e1.synchronize()
        rates.append(calls * flop / (e0.elapsed_time(e1) / 1e3))
    return rates


def _matmul_sustained(n: int, device, burst: float, seconds: float) -> float:
    """The bf16 n³ GEMM rate sustained back to back for ``seconds`` (the median of the later half
    of its half-second windows), as a fraction of ``burst`` (at most 1)."""
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    rates = gemm_rates(a, b, seconds)
    later = sorted(rates[len(rates) // 2:])
    return min(1.0, later[len(later) // 2] / burst)


# model-shaped work for the efficiency fits: (M, N, K) GEMMs from BERT/ViT/GLM layers and the
# LM head, and ResNet-50's convolutions (batch, Cin, H, W, Cout, kernel, stride) in channels_last
GEMM_SHAPES = [(8192, 768, 768), (8192, 3072, 768), (8192, 768, 3072), (12608, 2304, 768), (8192, 4608, 4096),
               (8192, 4096, 4096), (8192, 27392, 4096), (8192, 4096, 13696), (1024, 4608, 4096),
               (1024, 4096, 13696), (128, 768, 768), (8192, 32768, 4096)]
CONV_SHAPES = [(64, 64, 56, 56, 64, 3, 1), (64, 64, 56, 56, 256, 1, 1), (64, 256, 56, 56, 64, 1, 1),
               (64, 128, 28, 28, 128, 3, 1), (64, 512, 28, 28, 128, 1, 1), (64, 256, 14, 14, 256, 3, 1),
               (64, 1024, 14, 14, 256, 1, 1), (64, 512, 7, 7, 512, 3, 1), (64, 2048, 7, 7, 512, 1, 1),
               (64, 3, 224, 224, 64, 7, 2), (8, 256, 14, 14, 256, 3, 1), (1, 64, 56, 56, 64, 3, 1),
               # the stride-2 convolutions (torchvision's v1.5 bottleneck strides its 3x3) and expansions
               (64, 128, 56, 56, 128, 3, 2), (64, 256, 28, 28, 256, 3, 2), (64, 512, 14, 14, 512, 3, 2),
               (64, 128, 28, 28, 512, 1, 1), (64, 256, 14, 14, 1024, 1, 1), (64, 512, 7, 7, 2048, 1, 1),
               # few input channels: the space-to-depth stem's 16-channel 4x4 convolution (the chunk fit)
               (64, 16, 112, 112, 64, 4, 1)]
# (batch, heads, seq, head dim, mask): BERT-base (additive padding mask), ViT-B/16 (none), GLM-4 (causal)
ATTENTION_SHAPES = [(64, 12, 128, 64, "mask"), (1, 12, 128, 64, "mask"), (64, 12, 197, 64, None),
                    (1, 12, 197, 64, None), (1, 32, 1024, 128, "causal"), (8, 32, 1024, 128, "causal"),
                    (4, 32, 2048, 128, "causal"), (8, 16, 512, 64, None)]
COPY_BYTES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def fit_line(xs, ts) -> tuple[float, float]:
    """Least-squares t = a * x + b with b >= 0 (a fixed time per kernel cannot be negative)."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx > 0 else (mt / mx if mx else 0.0)
    b = mt - a * mx
    if b < 0:  # refit through the origin
        a, b = sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs), 0.0
    return a, b


def _fit_efficiency(samples, peak: float) -> tuple[float, float]:
    """(scale, fixed_s) with t = flops / (peak * scale) + fixed_s fitted to [(flops, seconds)]."""
    a, b = fit_line([f for f, _ in samples], [t for _, t in samples])
    scale = 1.0 / (a * peak) if a > 0 else 1.0
    return min(scale, 1.0), b


def _gemm_samples(device, dtype, quick: bool) -> list[tuple[float, float]]:
    out = []
    for m, n, k in (GEMM_SHAPES[::3] if quick else GEMM_SHAPES):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(n, k, device=device, dtype=dtype)
        t = _best_seconds(lambda: torch.nn.functional.linear(a, b), device, 5 if quick else 10)
        out.append((2.0 * m * n * k, t))
        del a, b
    return out


def _conv_samples(device, dtype, quick: bool) -> dict:
    """ResNet-shaped channels_last convolutions + bias + ReLU as lowered graphs run them: graphopt's
    fused ``conv_bias_relu`` (cuDNN's fused engine) when the CUDA kernels are loaded, else
    ``conv2d`` then bias and ReLU. Returns ``samples`` [(FLOPs, bytes, seconds)] of the shapes whose
    input channels are a multiple of 8 and at least 64, ``few`` (FLOPs, bytes, seconds, C_in) of
    those with fewer (the channel-chunk fit), ``narrow`` the same for channel counts that are not a
    multiple of 8 (ResNet's 3-channel stem, which cuDNN runs on a slow path), ``how`` (what ran them), ``unfused`` (median ratio of
    aten's ``conv2d`` without a bias to the fused op: 1.0 without the fused op) and ``bias_add_scale``
    (the fraction of the copy bandwidth aten's separate bias add reaches, from conv2d with and
    without a bias; None without a GPU)."""
    import torch.nn.functional as F

    fused = False
    try:
        from graphopt import cuda_ext

        fused = device.type == "cuda" and cuda_ext.backend() == "cuda"
    except Exception:  # noqa: BLE001 - no kernels: time what eager runs
        fused = False
    iters = 5 if quick else 10
    samples, narrow, few, ratios, scales = [], [], [], [], []
    bw = None
    for bsz, cin, h, w, cout, kk, st in (CONV_SHAPES[::3] if quick else CONV_SHAPES):
        x = torch.randn(bsz, cin, h, w, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        wt = torch.randn(cout, cin, kk, kk, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        b = torch.randn(cout, device=device, dtype=dtype)
        pad = kk // 2
        if fused:
            fn = lambda: cuda_ext.conv_bias_relu(x, wt, b, None, (st, st), (pad, pad))  # noqa: E731
        else:
            fn = lambda: F.relu(F.conv2d(x, wt, b, stride=st, padding=pad))  # noqa: E731
        y = fn()
        t = _best_seconds(fn, device, iters, queued=True)
        nbytes = (x.numel() + wt.numel() + b.numel() + y.numel()) * x.element_size()
        sample = (2.0 * y.numel() * cin * kk * kk, float(nbytes), t)
        if cin % 8:
            narrow.append(sample + (cin,))
        elif cin < 64:
            few.append(sample + (cin,))
        else:
            samples.append(sample)
        if device.type == "cuda" and cin % 8 == 0 and cin >= 64:
            plain = _best_seconds(lambda: F.conv2d(x, wt, None, stride=st, padding=pad), device, iters, queued=True)
            with_bias = _best_seconds(lambda: F.conv2d(x, wt, b, stride=st, padding=pad), device, iters, queued=True)
            if fused:
                ratios.append(plain / t)
            if bw is None:
                bw = _copy_bw(64 << 20, device, 10)
            if with_bias > plain:
                scales.append(2 * y.numel() * y.element_size() / (with_bias - plain) / bw)
        del x, wt, b, y
    ratios.sort()
    scales.sort()
    return {"samples": samples, "narrow": narrow, "few": few,
            "how": "graphopt::conv_bias_relu (cuDNN fused conv + bias + ReLU)" if fused else "conv2d + bias + relu",
            "unfused": max(1.0, ratios[len(ratios) // 2]) if ratios else 1.0,
            "bias_add_scale": min(1.0, scales[len(scales) // 2]) if scales else None}


def _pool_bandwidth_scale(device, dtype, bw: float, quick: bool) -> float:
    """Fraction of the copy bandwidth aten's max_pool2d reaches on ResNet's stem (3x3, stride 2,
    64 x 112 x 112 channels_last), counting each input and output byte once."""
    import torch.nn.functional as F

    x = torch.randn(32 if quick else 64, 64, 112, 112, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    y = F.max_pool2d(x, 3, 2, 1)
    t = _best_seconds(lambda: F.max_pool2d(x, 3, 2, 1), device, 5 if quick else 10)
    return min(1.0, (x.numel() + y.numel()) * x.element_size() / t / bw)


def _batch_norm_scales(device, dtype, bw: float, quick: bool) -> dict:
    """Fractions of the copy bandwidth aten's BatchNorm in inference (running statistics) reaches
    over a 64 x 256 x 56 x 56 input, NCHW (``memory_scale``) and channels_last (``memory_scale_cl``),
    counting the input and output bytes once (the small kernels before its transform included)."""
    import torch.nn.functional as F

    x = torch.randn(32 if quick else 64, 256, 56, 56, device=device, dtype=dtype)
    w, b, mean, var = (torch.rand(256, device=device, dtype=dtype) + 0.5 for _ in range(4))
    out = {}
    for key, t in (("memory_scale", x), ("memory_scale_cl", x.to(memory_format=torch.channels_last))):
        s = _best_seconds(lambda t=t: F.batch_norm(t, mean, var, w, b, False), device, 5 if quick else 10)
        out[key] = min(1.0, 2 * t.numel() * t.element_size() / s / bw)
    return out


def _gemm_partial_alignment_scale(device, dtype, quick: bool) -> float:
    """How fast cuBLAS runs 16-bit GEMMs whose rows are 8-byte aligned only, as a fraction of the
    aligned neighbour's rate: MLP-Mixer-shaped projections with K, then N, of 196 against 200 (a
    linear over [64 * 384, K] rows to 384 features, and from 384 to N), the mean of the two."""
    import torch.nn.functional as F

    rows = (16 if quick else 64) * 384
    ratios = []
    for which in ("k", "n"):
        times = {}
        for size in (196, 200):
            if which == "k":
                x, w = torch.randn(rows, size, device=device, dtype=dtype), torch.randn(384, size, device=device, dtype=dtype)
            else:
                x, w = torch.randn(rows, 384, device=device, dtype=dtype), torch.randn(size, 384, device=device, dtype=dtype)
            times[size] = _best_seconds(lambda x=x, w=w: F.linear(x, w), device, 10 if quick else 20) / size
        ratios.append(times[200] / times[196])
    return min(1.0, sum(ratios) / len(ratios))


def fit_conv(samples, peak: float, bandwidth: float, forms=(False, True)) -> tuple[float, float, float, bool]:
    """(scale, memory_scale, fixed_s, overlap) for convolutions priced as
    ``max(flops / (peak * scale), bytes / (bandwidth * memory_scale)) + fixed_s`` (overlap: compute
    and memory traffic overlap) or as the sum of the two terms + fixed_s, fitted to [(flops, bytes,
    seconds)] by a grid search minimizing the squared log error over both forms, both scales at
    most 1; the form with the smaller error wins. ``forms``: the overlap values to try (attention
    is priced in the max form only)."""
    f = torch.tensor([x[0] for x in samples], dtype=torch.float64) / peak
    m = torch.tensor([x[1] for x in samples], dtype=torch.float64) / bandwidth
    t = torch.tensor([x[2] for x in samples], dtype=torch.float64)
    scales = torch.arange(10, 101, dtype=torch.float64) / 100
    fixed = torch.arange(0, 61, dtype=torch.float64) * 0.5e-6
    # [scale, memory scale, fixed, sample]
    c = f / scales[:, None, None, None]
    b = m / scales[None, :, None, None]
    n, k = len(fixed), len(scales)
    best = None
    for overlap, pred in ((False, c + b), (True, torch.maximum(c, b))):
        if overlap not in forms:
            continue
        err = ((pred + fixed[None, None, :, None]) / t).log().pow(2).sum(-1)
        i = int(err.argmin())
        if best is None or float(err.flatten()[i]) < best[0]:
            best = (float(err.flatten()[i]), float(scales[i // (k * n)]), float(scales[(i // n) % k]), float(fixed[i % n]),
                    overlap)
    return best[1], best[2], best[3], best[4]


def conv_fit_seconds(flops, nbytes, cin, fit, chunk: int, peak: float, bandwidth: float) -> float:
    """A convolution's time under a conv fit (scale, memory scale, fixed[, overlap]) and a channel
    chunk: what DeviceProfile.gpu_seconds(kind="conv") prices once the fit is in a profile."""
    from ..cost.model import channel_chunk_factor

    c = flops * channel_chunk_factor(chunk, cin) / (peak * fit[0])
    mem = nbytes / (bandwidth * fit[1])
    overlap = len(fit) > 3 and fit[3]
    return (max(c, mem) if overlap else c + mem) + fit[2]


def fit_channel_chunk(few, fit, peak: float, bandwidth: float) -> int:
    """The input-channel chunk (0, 16, 32, 64, 128 or 256) that best explains [(FLOPs, bytes,
    seconds, C_in)] of convolutions over few channels given the conv fit (scale, memory scale,
    fixed[, overlap]): compute at C_in / chunk of the rate where C_in < chunk. 0 when no chunk explains them
    better than the fit alone (or there are none)."""
    import math

    best, best_err = 0, None
    for chunk in (0, 16, 32, 64, 128, 256):
        err = 0.0
        for f, b, t, cin in few:
            err += math.log(conv_fit_seconds(f, b, cin, fit, chunk, peak, bandwidth) / t) ** 2
        if few and (best_err is None or err < best_err - 1e-12):
            best, best_err = chunk, err
    return best


ATTENTION_TILE = 128  # sequence positions per SDPA tile: the cost model pads the work up to whole tiles


def attention_work(b, h, sq, sk, d, causal: bool, tile: int = ATTENTION_TILE) -> float:
    """An SDPA call's FLOPs as the cost model counts them (QK^T and PV, halved when causal), padded
    to whole tiles of ``tile`` positions (cost.model.attention_tile_waste)."""
    waste = (-(-sq // tile) * tile / sq) * (-(-sk // tile) * tile / sk)
    return 4.0 * b * h * sq * sk * d / (2 if causal else 1) * waste


def _attention_samples(device, dtype, quick: bool) -> list[tuple[float, float, float]]:
    """(FLOPs padded to whole tiles, bytes, device seconds) of SDPA on model-shaped inputs, timed
    queued behind a GPU sleep (cuDNN's attention spends more host time per call than a short
    call runs). A padding mask is materialized [B, 1, S, S], as Hugging Face's models pass it."""
    import torch.nn.functional as F

    out = []
    for b, h, s, d, kind in (ATTENTION_SHAPES[::2] if quick else ATTENTION_SHAPES):
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
        mask = torch.zeros(b, 1, s, s, device=device, dtype=dtype) if kind == "mask" else None
        causal = kind == "causal"
        t = _best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal), device,
                          5 if quick else 10, queued=True)
        nbytes = 4 * q.nbytes + (mask.nbytes if mask is not None else 0)
        out.append((attention_work(b, h, s, s, d, causal), nbytes, t))
        del q, k, v, mask
    return out


# graphopt::short_attention's fit (B, H, S, D, mask): BERT-base bs1/bs8/bs64, ViT-B/16 bs1, a causal decoder prefill
SHORT_ATTENTION_SHAPES = [(1, 12, 128, 64, "mask"), (1, 12, 197, 64, None), (8, 12, 128, 64, "mask"),
                          (64, 12, 128, 64, "mask"), (1, 32, 256, 128, "causal")]


def _short_attention_samples(device, dtype, quick: bool) -> list[tuple[float, float]]:
    """(FLOPs of the padded tiles, device seconds) of graphopt::short_attention (the one-tile Triton
    kernel), timed queued behind a GPU sleep as the SDPA samples are."""
    from graphopt.cuda_ext.attention_triton import attention_triton, padded_flops

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    for b, h, s, d, kind in (SHORT_ATTENTION_SHAPES[::2] if quick else SHORT_ATTENTION_SHAPES):
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
        mask = torch.zeros(b, 1, 1, s, device=device, dtype=dtype) if kind == "mask" else None
        causal = kind == "causal"
        t = _best_seconds(lambda: attention_triton(q, k, v, mask, d ** -0.5, causal), device, 5 if quick else 20,
                          queued=True)
        out.append((float(padded_flops(b, h, s, s, d, sms)), t))
        del q, k, v, mask
    return out


def _copy_fixed(device, bw: float, quick: bool) -> float:
    """Fixed device time of a memory-bound kernel: copies of 1-256 MiB, t - bytes / bw, median."""
    extra = []
    for nbytes in (COPY_BYTES[:3] if quick else COPY_BYTES):
        t = 2 * nbytes / _copy_bw(nbytes, device, 20)  # _copy_bw returns read+write bytes / second
        extra.append(t - 2 * nbytes / bw)
    extra.sort()
    return max(0.0, extra[len(extra) // 2])


def _sdpa_rate(device, quick: bool) -> float:
    import torch.nn.functional as F

    if device.type == "cuda":
        b, h, s, d, dtype = (4, 16, 2048, 128, torch.bfloat16) if quick else (8, 32, 4096, 128, torch.bfloat16)
        iters = 5
    else:
        b, h, s, d, dtype = 1, 4, 256, 64, torch.float32
        iters = 2
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    t = _best_seconds(lambda: F.scaled_dot_product_attention(q, k, v), device, iters)
    return 4 * b * h * s * s * d / t


def _copy_bw(nbytes: int, device, iters: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    t = _best_seconds(lambda: dst.copy_(src), device, iters)
    return 2 * src.numel() * 4 / t


def _launch_overhead(device, n: int = 2000) -> tuple[float, float | None]:
    """(wall seconds per tiny kernel launched back to back, per kernel replayed in a CUDA graph)."""
    x = torch.ones(16, device=device)

    def many():
        for _ in range(n):
            x.add_(1.0)

    many()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        many()
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / n)
    graph_s = None
    try:
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            many()
        torch.cuda.current_stream(device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            many()
        g.replay()
        torch.cuda.synchronize(device)
        graph_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize(device)
            graph_s = min(graph_s, (time.perf_counter() - t0) / n)
        del g
    except Exception:  # noqa: BLE001 - keep the default
        graph_s = None
    return best, graph_s


def host_costs(device) -> tuple[float, float]:
    """(host_node_s, per-launch host seconds) on ``device``: the host's issue time per node of a
    GraphModule of back-to-back views, and of back-to-back tiny kernels
    (graphopt.cost.profiles.measure_host_seconds), what the cost model's host/device queue
    charges per fx node."""
    from ..cost.profiles import measure_host_seconds

    device = torch.device(device)
    return measure_host_seconds(device, launches=False), measure_host_seconds(device, launches=True)


def _host_op_samples(device, dtype) -> dict:
    """op name (as graphopt.cost.model names nodes) -> (callable, args, kwargs) on tiny tensors
    shaped like a transformer/CNN layer's (the shapes pick the same kernels: SDPA's flash path,
    cuBLASLt's bias epilogue), for the per-op host time."""
    aten = torch.ops.aten
    r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    x2, x3, w, b = r(8, 64), r(2, 8, 64), r(64, 64), r(64)
    q = r(1, 4, 16, 64)
    img, wc = r(1, 8, 8, 8), r(8, 8, 3, 3)
    idx = torch.randint(0, 64, (2, 8), device=device)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    out = {
        "linear": (aten.linear.default, (x3, w, b), {}),
        "mm": (aten.mm.default, (x2, w), {}),
        "addmm": (aten.addmm.default, (b, x2, w), {}),
        "bmm": (aten.bmm.default, (x3, r(2, 64, 8)), {}),
        "_addmm_activation": (aten._addmm_activation.default, (b, x2, w), {}),
        "layer_norm": (aten.layer_norm.default, (x3, [64], b, b, 1e-5), {}),
        "native_layer_norm": (aten.native_layer_norm.default, (x3, [64], b, b, 1e-5), {}),
        "_softmax": (aten._softmax.default, (x3, -1, False), {}),
        "softmax": (aten.softmax.int, (x3, -1), {}),
        "scaled_dot_product_attention": (aten.scaled_dot_product_attention.default, (q, q, q), {}),
        "gelu": (aten.gelu.default, (x3,), {}),
        "silu": (aten.silu.default, (x3,), {}),
        "relu": (aten.relu.default, (x3,), {}),
        "tanh": (aten.tanh.default, (x3,), {}),
        "add": (aten.add.Tensor, (x3, x3), {}),
        "mul": (aten.mul.Tensor, (x3, x3), {}),
        "where": (aten.where.self, (x3 > 0, x3, x3), {}),
        "embedding": (aten.embedding.default, (w, idx), {}),
        "cat": (aten.cat.default, ([x3, x3], -1), {}),
        "clone": (aten.clone.default, (x3,), {}),
        "_to_copy": (aten._to_copy.default, (x3,), {"dtype": other}),
        "mean": (aten.mean.dim, (x3, [-1], True), {}),
        "conv2d": (aten.conv2d.default, (img, wc, None, [1, 1], [1, 1]), {}),
        "max_pool2d": (aten.max_pool2d.default, (img, [3, 3], [2, 2], [1, 1]), {}),
        "adaptive_avg_pool2d": (aten.adaptive_avg_pool2d.default, (img, [1, 1]), {}),
        # views: no kernel, host time only (the cost model's VIEW_OPS names)
        "view": (aten.view.default, (x3, [16, 64]), {}),
        "_unsafe_view": (aten._unsafe_view.default, (x3, [16, 64]), {}),
        "t": (aten.t.default, (w,), {}),
        "transpose": (aten.transpose.int, (x3, 1, 2), {}),
        "permute": (aten.permute.default, (x3, [0, 2, 1]), {}),
        "unsqueeze": (aten.unsqueeze.default, (x3, 1), {}),
        "squeeze": (aten.squeeze.dim, (q, 0), {}),
        "select": (aten.select.int, (x3, 1, 0), {}),
        "slice": (aten.slice.Tensor, (x3, 2, 0, 32), {}),
        "expand": (aten.expand.default, (b, [8, 64]), {}),
        "split_with_sizes": (aten.split_with_sizes.default, (x3, [32, 32], -1), {}),
        "unflatten": (aten.unflatten.int, (x3, -1, [4, 16]), {}),
        "alias": (aten.alias.default, (x3,), {}),
        "detach": (aten.detach.default, (x3,), {}),
    }
    g = getattr(torch.ops, "graphopt", None)
    if g is not None:
        try:
            out.update({
                "add_layer_norm": (g.add_layer_norm.default, (x3, x3, b, b, 1e-5), {}),
                "add_rms_norm": (g.add_rms_norm.default, (x3, x3, b, 1e-6), {}),
                "bias_act": (g.bias_act.default, (x3, b, "gelu", None), {}),
                "swiglu": (g.swiglu.default, (r(2, 8, 128),), {}),
                "rotary": (g.rotary.default, (q, q, r(1, 16, 64), r(1, 16, 64), False), {}),
                "softmax_mask": (g.softmax_mask.default, (x3, 0.125, None), {}),
                "conv_bias_relu": (g.conv_bias_relu.default, (img, wc, r(8), None, [1, 1], [1, 1], [1, 1], 1), {}),
                "fused_pointwise": (g.fused_pointwise.default, (
                    "%0 = input 0\n%1 = input 1\n%2 = add %0 %1\n%3 = gelu %2\nout %3 "
                    + {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32"), [x3, x3]), {}),
            })
        except (AttributeError, RuntimeError):  # the graphopt ops are not registered here
            pass
    return out


def host_op_costs(device, dtype=None, n: int = 50, reps: int = 3) -> dict[str, float]:
    """Host seconds per call of common ops ({op name: seconds}): the time the host takes to issue
    ``n`` back-to-back calls on tiny tensors (perf_counter before synchronizing: the queue of a
    few hundred launches never fills, so the device's time does not show), best of ``reps``.
    An op that fails here (not supported on this device or dtype) is left out: the cost model
    then charges its launches * launch_overhead_s."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, (fn, args, kwargs) in _host_op_samples(device, dtype).items():
            try:
                fn(*args, **kwargs)  # first call: compile / pick the kernel
                fn(*args, **kwargs)
                if cuda:
                    torch.cuda.synchronize(device)
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn(*args, **kwargs)
                    best = min(best, time.perf_counter() - t0)
                    if cuda:
                        torch.cuda.synchronize(device)
                out[name] = best / n
            except Exception:  # noqa: BLE001 - an op this device/dtype lacks keeps the default
                continue
    return out


def _h2d_d2h(device, nbytes: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _best_seconds(lambda: dev.copy_(host, non_blocking=True), device, 3)
    d2h = _best_seconds(lambda: host.copy_(dev, non_blocking=True), device, 3)
    return nbytes / h2d, nbytes / d2h


def _d2d(device, nbytes: int) -> float | None:
    if torch.cuda.device_count() < 2:
        return None
    other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=other)
    t = _best_seconds(lambda: dst.copy_(src, non_blocking=True), device, 3)
    torch.cuda.synchronize(other)
    return nbytes / t


def _shipped_for(name: str) -> DeviceProfile | None:
    for key, path in shipped().items():
        if key in name.lower():
            return _load_json(path)
    return None


def keep_shipped_prices(op_eff: dict, source: dict, base: DeviceProfile) -> None:
    """Add to ``op_eff`` (a calibrated profile's op_efficiency) every entry of the shipped profile
    ``base`` this run did not measure (row_norm, depthwise_conv, cat_runs, ...), so a calibrated
    profile loses none of the prices measured for its GPU; ``source`` says where each came from."""
    for key, entry in base.op_efficiency.items():
        if key not in op_eff:
            op_eff[key] = dict(entry)
            source[key] = f"kept from the shipped {base.name} profile (not measured by calibrate)"


def calibrate(device=None, quick: bool = False, progress=None) -> DeviceProfile:
    """Measure ``device`` (default: cuda if present, else cpu) and return its DeviceProfile.
    ``progress(description)`` is called before each measurement."""
    device = _resolve(device)
    say = progress or (lambda d: None)
    from .bench import utc_now

    stamp = f"measured by graphopt calibrate on {utc_now()}"
    if device.type == "cpu":
        say("cpu: matmul, copy, dispatch overhead")
        prof = calibrate_cpu(quick=quick)
        say("cpu: sdpa")
        prof.peak_flops["sdpa"] = _sdpa_rate(device, quick)
        prof.launch_overhead_graph_s = prof.launch_overhead_s
        prof.description = f"{prof.description.replace(', measured at first use', '')}; {stamp} (torch {torch.__version__})"
        prof.source = {"all": stamp, "sdpa": f"{stamp} (peak_flops['sdpa'], fp32)",
                       "host_node": f"{stamp}: host time per node of a GraphModule of back-to-back views"}
        return prof

    props = torch.cuda.get_device_properties(device)
    gpu = torch.cuda.get_device_name(device)
    base = _shipped_for(gpu)
    n = 4096 if quick else 8192
    iters = 3 if quick else 5
    peak: dict[str, float] = {}
    source: dict[str, str] = {}
    op_eff: dict[str, dict] = {}  # DeviceProfile.op_efficiency
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        with torch.cuda.device(device):
            for label, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                                       ("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                       ("fp64", torch.float64, False)):
                say(f"matmul {n}³ {label}")
                torch.backends.cuda.matmul.allow_tf32 = tf32
                m = n if label != "fp64" else n // 2
                key = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "tf32", "fp64": "float64"}[label]
                peak[key] = _matmul_rate(m, dtype, device, iters if label in ("bf16", "fp16", "tf32") else 2)
                source[label] = f"{stamp} ({m}³ torch.mm)"
            torch.backends.cuda.matmul.allow_tf32 = saved_tf32
            if base is not None and "int8" in base.peak_flops:
                peak["int8"] = base.peak_flops["int8"]
                source["int8"] = f"kept from the shipped {base.name} profile"
            say("sdpa bf16")
            peak["sdpa"] = _sdpa_rate(device, quick)
            source["sdpa"] = f"{stamp} (peak_flops['sdpa'], bf16 flash attention)"
            copy_bytes = (256 << 20) if quick else (1 << 30)
            say(f"device copy {copy_bytes >> 20} MiB")
            bw = _copy_bw(copy_bytes, device, 5)
            source["bandwidth"] = f"{stamp} (read+write of a {copy_bytes >> 20} MiB copy)"
            say("GEMM efficiency (model-shaped bf16 GEMMs)")
            gemm = _gemm_samples(device, torch.bfloat16, quick)
            extra_fit = dict(zip(("matmul_scale", "matmul_fixed_s"), _fit_efficiency(gemm, peak["bfloat16"])))
            source["matmul_efficiency"] = (f"{stamp}: t = flops / (peak * scale) + fixed fitted to {len(gemm)} "
                                           "bf16 GEMMs shaped like BERT/ViT/GLM layers")
            seconds = 2.0 if quick else 5.0
            say(f"sustained bf16 GEMM rate ({n}³ back to back for {seconds:g} s)")
            extra_fit["matmul_sustained_fraction"] = _matmul_sustained(n, device, peak["bfloat16"], seconds)
            source["matmul_sustained"] = (f"{stamp}: {n}³ bf16 torch.mm back to back for {seconds:g} s, the median "
                                          "rate of the later half of its 0.5 s windows over the burst rate above")
            say("memory-bound kernel fixed time")
            extra_fit["kernel_fixed_s"] = _copy_fixed(device, bw, quick)
            source["kernel_fixed"] = f"{stamp}: median of (t - bytes / bandwidth) over 1-256 MiB copies"
            say("convolution efficiency (ResNet-50 channels_last bf16 conv + bias + ReLU, cudnn.benchmark as set)")
            cs = _conv_samples(device, torch.bfloat16, quick)
            fit = fit_conv(cs["samples"], peak["bfloat16"], bw)
            extra_fit.update(zip(("conv_scale", "conv_memory_scale", "conv_fixed_s", "conv_overlap"), fit))
            extra_fit["conv_unfused_slowdown"] = cs["unfused"]
            if cs["bias_add_scale"] is not None:
                extra_fit["conv_bias_add_scale"] = cs["bias_add_scale"]
            chunk = fit_channel_chunk(cs["few"], fit, peak["bfloat16"], bw)
            extra_fit["conv_channel_chunk"] = chunk

            narrow = [t / conv_fit_seconds(f, b, cin, fit, chunk, peak["bfloat16"], bw) for f, b, t, cin in cs["narrow"]]
            if narrow:
                extra_fit["conv_narrow_input_slowdown"] = max(1.0, sorted(narrow)[len(narrow) // 2])
            source["conv_efficiency"] = (
                f"{stamp}: {'max' if fit[3] else 'sum'} of flops / (peak * scale) and bytes / (bandwidth * memory scale) "
                f"+ fixed fitted to "
                f"{len(cs['samples'])} ResNet-50 convolutions run as {cs['how']}, "
                f"cudnn.benchmark={torch.backends.cudnn.benchmark}; aten conv2d without a bias "
                f"{cs['unfused']:.2f}x the fused op's time, aten's bias add at "
                f"{(cs['bias_add_scale'] or 1.0):.0%} of the copy rate (medians over the same shapes); "
                f"{len(cs['few'])} convolution(s) over fewer than 64 channels fitted a channel chunk of {chunk} "
                f"(compute at C_in / chunk of the rate; 0: none); {len(narrow)} convolution(s) whose input channels "
                f"are not a multiple of 8 {(sorted(narrow)[len(narrow) // 2] if narrow else 1.0):.2f}x that")
            say("pooling bandwidth (ResNet-50 stem max_pool2d)")
            op_eff["pool"] = {"memory_scale": _pool_bandwidth_scale(device, torch.bfloat16, bw, quick)}
            source["pool"] = f"{stamp}: max_pool2d 3x3/2 over 64x64x112x112 channels_last bf16"
            say("BatchNorm in inference (aten, both layouts)")
            op_eff["batch_norm"] = _batch_norm_scales(device, torch.bfloat16, bw, quick)
            source["batch_norm"] = f"{stamp}: aten batch_norm (running statistics) over 64x256x56x56 bf16, NCHW and channels_last"
            say("GEMMs with 8-byte aligned rows (K or N of 196 against 200)")
            op_eff["gemm_align_partial"] = {"scale": _gemm_partial_alignment_scale(device, torch.bfloat16, quick)}
            source["gemm_align_partial"] = (f"{stamp}: bf16 linears over 64x384 rows, K then N of 196 against 200, "
                                            "the mean of the two rates' ratios")
            say("attention efficiency (BERT/ViT/GLM-shaped bf16 SDPA)")
            attn = _attention_samples(device, torch.bfloat16, quick)
            afit = fit_conv(attn, peak["bfloat16"], bw, forms=(True,))
            extra_fit.update(attention_scale=afit[0], attention_memory_scale=afit[1], attention_fixed_s=afit[2],
                             attention_tile=ATTENTION_TILE)
            source["attention_efficiency"] = (
                f"{stamp}: max(flops padded to {ATTENTION_TILE}-position tiles / (peak * scale), bytes / (bandwidth * "
                f"memory scale)) + fixed fitted to {len(attn)} bf16 SDPA calls shaped like BERT-base (padding mask), "
                "ViT-B/16 and GLM-4 (causal) attention, timed queued behind a GPU sleep")
            say("short attention (graphopt::short_attention, one Triton tile)")
            try:
                sa = _short_attention_samples(device, torch.bfloat16, quick)
            except Exception as e:  # no Triton, or it cannot compile here: lower_attention stays off
                source["short_attention"] = f"{stamp}: not measured ({type(e).__name__}: {str(e)[:120]})"
            else:
                scale, fixed = _fit_efficiency(sa, peak["bfloat16"])
                op_eff["short_attention"] = {"scale": scale, "fixed_s": fixed}
                source["short_attention"] = (
                    f"{stamp}: flops of the padded tiles / (peak * scale) + fixed fitted to {len(sa)} bf16 calls of "
                    "graphopt::short_attention shaped like BERT-base bs1/bs8/bs64, ViT-B/16 bs1 and a 256-token causal "
                    "prefill, timed queued behind a GPU sleep")
            say("launch overhead")
            launch_wall, launch_graph = _launch_overhead(device)
            say("host time per fx node (views, tiny kernels)")
            host_node, launch = host_costs(device)
            source["launch"] = (f"{stamp}: host time per kernel node of a GraphModule of 400 tiny aten.add nodes "
                                f"(issue time, before synchronizing); {launch_wall * 1e6:.2f} us wall per tiny "
                                "kernel launched from Python, 2000 back to back")
            source["host_node"] = (f"{stamp}: host time per node of a GraphModule of 400 back-to-back views "
                                   "(aten.t/unsqueeze/view/squeeze)")
            extra_fit["host_node_s"] = host_node
            say("host time per op of a training step")

            extra_fit["host_train_op_s"], extra_fit["host_train_call_s"] = measure_host_train_op_s(device)
            source["host_train_op"] = (f"{stamp}: wall time per ATen op (as graphopt.partition counts them) of a "
                                       "host-bound training step, and the fixed time per step: captured 1- and "
                                       "4-block transformer stacks on tiny tensors, forward + backward")
            link: dict[str, float] = {}
            say("host<->device (pinned)")
            h2d, d2h = _h2d_d2h(device, (64 << 20) if quick else (256 << 20))
            link["pcie_h2d"], link["pcie_d2h"] = h2d, d2h
            source["link"] = f"{stamp} (pinned host memory)"
            say("device<->device")
            p2p = _d2d(device, (64 << 20) if quick else (256 << 20))
            if p2p is not None:
                link["nvlink"] = p2p
                source["link"] += "; nvlink = cuda:a -> cuda:b copy"
            elif base is not None and "nvlink" in base.link_bandwidth:
                link["nvlink"] = base.link_bandwidth["nvlink"]
                source["nvlink"] = f"kept from the shipped {base.name} profile (one GPU here)"
            # last: the custom ops among these run graphopt's own kernels on odd small shapes
            say("host time per op (tiny bf16 tensors)")
            extra_fit["host_op_s"] = host_op_costs(device, torch.bfloat16)
            source["host_op"] = (f"{stamp}: host issue time per call of each op on tiny bf16 tensors, 50 back to "
                                 "back (CostModel.execution_cost charges it instead of launches * launch_overhead_s)")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    source["elementwise"] = "the measured fp32 (no TF32) matmul rate"
    extra = dict(extra_fit)
    if launch_graph is not None:
        extra["launch_overhead_graph_s"] = launch_graph
        source["launch_graph"] = f"{stamp} (the same kernels replayed from a CUDA graph)"
    if base is not None:
        extra["conv_nchw_slowdown"] = base.conv_nchw_slowdown
        source["conv_nchw_slowdown"] = f"kept from the shipped {base.name} profile"
        keep_shipped_prices(op_eff, source, base)
    name = base.name if base is not None else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return DeviceProfile(
        name=name,
        kind="cuda",
        peak_flops=peak,
        elementwise_flops=peak["float32"],
        bandwidth=bw,
        launch_overhead_s=launch,
        memory_bytes=float(props.total_memory),
        description=f"{gpu}, {stamp} (torch {torch.__version__}, CUDA {torch.version.cuda})",
        source=source,
        link_bandwidth=link,
        sm_count=int(props.multi_processor_count),
        compute_capability=[int(props.major), int(props.minor)],
        op_efficiency=op_eff,
        **extra,
    )


def _fmt_rate(v: float, unit: str) -> str:
    for scale, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:.2f} {p}{unit}"
    return f"{v:.3g} {unit}"


def run_cli(args) -> int:
    """``graphopt calibrate [--device D] [-o PATH] [--quick]``; with ``--corpus``,
    graphopt.tools.corpus.run_cli."""
    from . import corpus

    if getattr(args, "corpus", False):
        return corpus.run_cli(args)
    corpus.refuse_corpus_options(args)
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    device = _resolve(args.device)
    console = Console() if Console().is_terminal else Console(width=120)
    # no auto-refresh thread: it would compete for the GIL with the timed loops
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, auto_refresh=False) as prog:
        task = prog.add_task("calibrating", total=None)
        prof = calibrate(device, quick=args.quick,
                         progress=lambda d: prog.update(task, description=f"calibrate {device}: {d}", refresh=True))
    out = Path(args.output or f"{prof.name}-calibrated.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(prof.to_dict(), indent=1))
    except OSError as e:
        raise GraphoptError(f"cannot write {out}: {e.strerror or e}") from None
    t = Table("measure", "value", header_style="bold", title=prof.description)
    for k, v in prof.peak_flops.items():
        t.add_row(f"peak {k}", _fmt_rate(v, "FLOP/s"))
    t.add_row("elementwise", _fmt_rate(prof.elementwise_flops, "FLOP/s"))
    t.add_row("device bandwidth", _fmt_rate(prof.bandwidth, "B/s"))
    t.add_row("launch overhead", f"{prof.launch_overhead_s * 1e6:.2f} µs")
    t.add_row("launch in a CUDA graph", f"{prof.launch_overhead_graph_s * 1e6:.2f} µs")
    t.add_row("host time per view node", f"{prof.host_node_s * 1e6:.2f} µs")
    if prof.host_train_op_s:
        t.add_row("host time per op of a training step", f"{prof.host_train_op_s * 1e6:.2f} µs "
                  f"(+ {prof.host_train_call_s * 1e6:.0f} µs per step)")
    if prof.host_op_s:
        ops = sorted(prof.host_op_s.items(), key=lambda kv: -kv[1])
        t.add_row(f"host time per op ({len(ops)} ops)", ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in ops[:6])
                  + (", …" if len(ops) > 6 else ""))
    if prof.kind == "cuda":
        t.add_row("GEMM efficiency", f"{prof.matmul_scale:.0%} of peak + {prof.matmul_fixed_s * 1e6:.1f} µs")
        t.add_row("sustained GEMM rate", f"{prof.matmul_sustained_fraction:.0%} of peak, back to back (power and "
                                         "clock limits; explain's floor at this rate)")
        mem = "" if prof.conv_memory_scale is None else f" + memory at {prof.conv_memory_scale:.0%} of the copy rate"
        t.add_row("conv efficiency", f"{prof.conv_scale:.0%} of peak{mem} + {prof.conv_fixed_s * 1e6:.1f} µs "
                                     f"(aten conv2d {prof.conv_unfused_slowdown:.2f}× slower, its bias add at "
                                     f"{prof.conv_bias_add_scale:.0%} of the copy rate; input channels taken "
                                     f"{prof.conv_channel_chunk or 'n/a'} per tap; not a multiple of 8: "
                                     f"{prof.conv_narrow_input_slowdown:.1f}× slower)")
        t.add_row("pooling bandwidth", f"{prof.efficiency('pool', 'memory_scale', 1.0):.0%} of the copy rate")
        if prof.attention_scale is not None:
            mem = "" if prof.attention_memory_scale is None else f", bytes at {prof.attention_memory_scale:.0%} of the copy rate"
            t.add_row("attention efficiency", f"{prof.attention_scale:.0%} of peak{mem} + "
                                              f"{(prof.attention_fixed_s or 0) * 1e6:.1f} µs")
        if prof.efficiency("short_attention", "scale") is not None:
            t.add_row("short attention (one tile)", f"{prof.efficiency('short_attention', 'scale'):.0%} of peak + "
                                                    f"{prof.efficiency('short_attention', 'fixed_s', 0.0) * 1e6:.1f} µs")
        t.add_row("memory-bound kernel fixed time", f"{prof.kernel_fixed_s * 1e6:.1f} µs")
    for k, v in prof.link_bandwidth.items():
        t.add_row(f"link {k}", _fmt_rate(v, "B/s"))
    console.print(t)
    console.print(f"wrote {out}; use it with --target {out}")
    return 0


def measure_host_train_op_s(device: torch.device, steps: int = 20, reps: int = 3) -> tuple[float, float]:
    """(``host_train_op_s``, ``host_train_call_s``): the wall seconds per ATen op of a host-bound
    training step on ``device``, and the fixed seconds per step beyond its ops. The step is what a
    pipeline stage runs: a captured (ATen-level) GraphModule of a small pre-norm transformer block
    stack (RMSNorm as Hugging Face writes it, linears, a SiLU MLP, attention by matmul and
    softmax) on tiny tensors, forward and autograd's backward with gradient accumulation, at one
    and at four blocks: the line through the two (wall time against ops) gives both. Ops are
    counted as graphopt.partition counts them (the graph's ATen nodes, each node's traced
    backward, one accumulation per parameter), so the planner's host time of these steps is their
    measured wall time. Each point is the best of ``reps`` runs of ``steps`` steps."""
    import torch.nn as nn

    from .. import ir
    from .. import partition as part
    from ..capture import capture

    class Block(nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(2 * d, d, bias=False)

        @staticmethod
        def norm(x, w):
            return w * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm(x, self.w1)).view(b, s, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            a = torch.softmax(q @ k.transpose(-1, -2) * (d // 4) ** -0.5, dim=-1) @ v
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
            g, u = self.up(self.norm(x, self.w2)).chunk(2, dim=-1)
            return x + self.down(nn.functional.silu(g) * u)

    unit = DeviceProfile(name="host-op-count", kind="cuda", peak_flops={"float32": 1e12}, elementwise_flops=1e12,
                         bandwidth=1e12, launch_overhead_s=0.0, memory_bytes=0.0, host_train_op_s=1.0)
    cuda = device.type == "cuda"
    points = []
    for blocks in (1, 4):
        torch.manual_seed(0)
        x = torch.randn(2, 8, 32, device=device)
        gm = capture(nn.Sequential(*[Block() for _ in range(blocks)]).to(device), (x,))
        hints = ir.shape_hints(gm)
        ops = float(part._host_train_prefix(part._Analysis(gm, hints), gm, unit, hints)[-1])

        def step():
            gm(x).sum().backward()

        for _ in range(3):
            step()
        best = float("inf")
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        points.append((ops, best / steps))
    (o1, t1), (o4, t4) = points
    per_op = (t4 - t1) / (o4 - o1) if o4 > o1 and t4 > t1 else t4 / max(o4, 1.0)
    return per_op, max(0.0, t1 - o1 * per_op)
