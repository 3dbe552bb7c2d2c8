"""``graphopt calibrate``: measure a device and write a DeviceProfile JSON the cost model loads.

    graphopt calibrate [--device cuda:0] [-o h200-measured.json] [--quick]
    graphopt explain MODEL --target h200-measured.json

On CUDA: dense matmul rate per dtype (bf16, fp16, fp32 without TF32, fp32 with TF32 as "tf32",
fp64) at 8192^3 (4096^3 with --quick), device copy bandwidth (read + write of a 1 GiB copy,
256 MiB with --quick), launch overhead (many tiny kernels back to back, wall time per kernel; and
the same kernels replayed from a CUDA graph), SDPA rate (bf16 flash attention), host<->device
bandwidth (pinned memory) and device<->device bandwidth when there are two GPUs. The
elementwise rate is the fp32 (no TF32) matmul rate (the SIMT FMA rate). ``conv_nchw_slowdown``
and int8 are kept from the shipped profile of the same GPU when there is one.

On the CPU: ``graphopt.cost.profiles.calibrate_cpu`` plus an SDPA rate, small sizes.

Every rate is the best of a few timed chunks (CUDA events on CUDA, perf_counter on the CPU).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import time
from pathlib import Path

import torch

from .cost.profiles import DeviceProfile, _load_json, calibrate_cpu, shipped
from .errors import GraphoptError

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


def _best_seconds(fn, device: torch.device, iters: int, chunks: int = 3, warmup: int = 1) -> float:
    """Seconds per call of fn: best over ``chunks`` of ``iters`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(chunks):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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


def calibrate(device=None, quick: bool = False, progress=None) -> DeviceProfile:
    """Measure ``device`` (default: cuda if present, else cpu) and return its DeviceProfile.
    ``progress(description)`` is called before each measurement."""
    device = _resolve(device)
    say = progress or (lambda d: None)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    stamp = f"measured by graphopt calibrate on {date}"
    if device.type == "cpu":
        say("cpu: matmul, copy, dispatch overhead")
        prof = calibrate_cpu(quick=quick)
        say("cpu: sdpa")
        prof.peak_flops["sdpa"] = _sdpa_rate(device, quick)
        prof.launch_overhead_graph_s = prof.launch_overhead_s
        prof.description = f"{prof.description.replace(', measured at first use', '')}; {stamp} (torch {torch.__version__})"
        prof.source = {"all": stamp, "sdpa": f"{stamp} (peak_flops['sdpa'], fp32)"}
        return prof

    props = torch.cuda.get_device_properties(device)
    gpu = torch.cuda.get_device_name(device)
    base = _shipped_for(gpu)
    n = 4096 if quick else 8192
    iters = 3 if quick else 5
    peak: dict[str, float] = {}
    source: dict[str, str] = {}
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
            say("launch overhead")
            launch, launch_graph = _launch_overhead(device)
            source["launch"] = f"{stamp} (wall time per tiny kernel, 2000 back to back)"
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
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    source["elementwise"] = "the measured fp32 (no TF32) matmul rate"
    extra = {}
    if launch_graph is not None:
        extra["launch_overhead_graph_s"] = launch_graph
        source["launch_graph"] = f"{stamp} (the same kernels replayed from a CUDA graph)"
    if base is not None:
        extra["conv_nchw_slowdown"] = base.conv_nchw_slowdown
        source["conv_nchw_slowdown"] = f"kept from the shipped {base.name} profile"
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
        **extra,
    )


def _fmt_rate(v: float, unit: str) -> str:
    for scale, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:.2f} {p}{unit}"
    return f"{v:.3g} {unit}"


def run_cli(args) -> int:
    """``graphopt calibrate [--device D] [-o PATH] [--quick]``."""
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
    for k, v in prof.link_bandwidth.items():
        t.add_row(f"link {k}", _fmt_rate(v, "B/s"))
    console.print(t)
    console.print(f"wrote {out}; use it with --target {out}")
    return 0
