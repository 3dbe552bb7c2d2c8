"""Side-by-side benchmark: eager, torch.compile and graphopt on the same model and inputs.

    from graphopt.tools.bench import BenchConfig, run
    result = run([BenchConfig("resnet50", batch=1, vs=("eager", "compile", "compile-ro"))], dtype="bf16")
    result.render()                      # rich table
    result.paths                         # JSON + Markdown written under benchmarks/results/

or ``graphopt bench resnet50 --batch 1 --vs eager,compile,compile-ro --dtype bf16``.

For each config the model is built once (zoo name, ``FILE.py:factory`` or ``module:factory``),
converted to the dtype (CNNs in bf16/fp16 also to channels_last, inputs too: the
"hand-converted" eager baseline), and every variant runs on that same model object and the same
inputs, in this process, under ``torch.inference_mode()``:

* ``eager``: the converted model (always run: it is the accuracy rule's baseline);
* ``compile``: ``torch.compile(model)``; ``compile-ro``: ``mode="reduce-overhead"``;
* ``graphopt``: ``graphopt.optimize(model, inputs)`` (CUDA graphs on where ``lower`` allows);
* ``graphopt-reuse``: the same optimized module with ``reuse_outputs=True`` (no output clone:
  the clone's cost is the difference to ``graphopt``).

Timing: ``warmup`` calls, then ``reps`` calls each timed alone (CUDA events around the call,
the device synchronized before it: single-call latency; ``perf_counter`` on the CPU); the table
shows the median. "setup s" is the time to the first result (``torch.compile`` + first call,
``optimize`` + first call). Peak memory is ``torch.cuda.max_memory_allocated`` over the variant
(reset before it; the model's own weights included); off the GPU graphopt's "setup peak" is its
report's account (the model plus the constants the passes added, ``Report.setup_peak_bytes``). Accuracy is the accuracy rule (docs/design.md) against a
float64 copy of the converted model on the same inputs, the eager output being the yardstick;
outputs with more than ``max_check_elems`` elements are checked on an evenly strided sample of
that many elements (same positions for every variant), which the notes say.

A variant that fails (compile error, OOM) is recorded with its error and the run goes on. With
``budget_s``, variants that would start after the budget is spent are recorded as skipped. The
JSON and Markdown are rewritten after every variant, so an interrupted run leaves what it
measured.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from .. import accuracy
from ..errors import traceback_requested

__all__ = ["VARIANTS", "PEERS", "BenchConfig", "VariantResult", "ConfigResult", "BenchRun", "run",
           "time_call", "environment", "parse_dtype", "parse_vs", "DEFAULT_OUT"]

VARIANTS = ("eager", "compile", "compile-ro", "graphopt", "graphopt-reuse")
PEERS = ("eager", "compile", "compile-ro")  # the speed-up columns
DEFAULT_OUT = Path("benchmarks") / "results"
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}") from None


def parse_vs(text) -> tuple[str, ...]:
    """'eager,compile' -> the variants to run: eager first (always), graphopt always."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    bad = [t for t in items if t not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    want = set(items) | {"eager", "graphopt"}
    return tuple(v for v in VARIANTS if v in want)


# ------------------------------------------------------------------------------------ records


@dataclass
class BenchConfig:
    model: str  # zoo name, FILE.py:factory or package.module:factory
    batch: int | None = None  # zoo models only (None: the zoo default)
    seq_len: int | None = None  # zoo text models only
    vs: tuple = ("eager", "compile")
    optimize_kwargs: dict | None = None  # for graphopt.optimize, over run()'s
    # after the variants, time eager and graphopt again in interleaved rounds (a drift of the machine
    # between the variants' own timings lands on both alike): graphopt's extra["interleaved"]
    interleave: bool = False


@dataclass
class VariantResult:
    variant: str
    label: str
    status: str = "ok"  # "ok" | "error" | "skipped"
    error: str | None = None
    ms: float | None = None  # median
    ms_min: float | None = None
    ms_p90: float | None = None
    reps: int = 0
    setup_s: float | None = None
    setup_peak_bytes: int | None = None  # CUDA: the most allocated while building and in the first call
    peak_mem_bytes: int | None = None  # CUDA: the most allocated during the timed calls
    accuracy: dict | None = None  # {"passed", "how", "max_abs_err", "rmse", "eager_rmse", "reason"}
    extra: dict = field(default_factory=dict)


@dataclass
class ConfigResult:
    model: str
    batch: int | None
    seq_len: int | None
    dtype: str
    device: str
    channels_last: bool = False
    variants: list[VariantResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def title(self) -> str:
        parts = [self.model]
        if self.batch is not None:
            parts.append(f"bs{self.batch}")
        if self.seq_len is not None:
            parts.append(f"seq{self.seq_len}")
        return " ".join(parts)

    def get(self, variant: str) -> VariantResult | None:
        for v in self.variants:
            if v.variant == variant:
                return v
        return None

    def speedup(self, variant: str, peer: str) -> float | None:
        """peer ms / variant ms (> 1: ``variant`` is faster)."""
        a, b = self.get(variant), self.get(peer)
        if not (a and b and a.ms and b.ms):
            return None
        return b.ms / a.ms


@dataclass
class BenchRun:
    header: dict
    results: list[ConfigResult] = field(default_factory=list)
    paths: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"header": self.header,
                "results": [{**asdict(r), "title": r.title,
                             "speedups": {v.variant: {p: r.speedup(v.variant, p) for p in PEERS if r.get(p)}
                                          for v in r.variants}} for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1, default=str)

    def _peers(self) -> list[str]:
        return [p for p in PEERS if any(r.get(p) for r in self.results)]

    def rows(self) -> list[dict]:
        """One row per (config, variant), as strings, for the table and the Markdown."""
        rows = []
        for r in self.results:
            if r.error and not r.variants:
                rows.append({"config": r.title, "variant": "—", "ms": "error", "setup s": "", "setup peak": "",
                             "peak mem": "",
                             "accuracy": _short(r.error, 70), **{f"× {p}": "" for p in self._peers()}})
                continue
            for i, v in enumerate(r.variants):
                row = {"config": r.title if i == 0 else "", "variant": v.label}
                if v.status == "ok":
                    row["ms"] = _fmt_ms(v.ms)
                else:
                    row["ms"] = v.status
                for p in self._peers():
                    s = r.speedup(v.variant, p) if v.status == "ok" else None
                    row[f"× {p}"] = "" if s is None or p == v.variant else f"{s:.2f}×"
                row["setup s"] = "" if v.setup_s is None else f"{v.setup_s:.1f}"
                row["setup peak"] = "" if v.setup_peak_bytes is None else _fmt_bytes(v.setup_peak_bytes)
                row["peak mem"] = "" if v.peak_mem_bytes is None else _fmt_bytes(v.peak_mem_bytes)
                row["accuracy"] = _fmt_acc(v)
                rows.append(row)
        return rows

    def columns(self) -> list[str]:
        return (["config", "variant", "ms"] + [f"× {p}" for p in self._peers()]
                + ["setup s", "setup peak", "peak mem", "accuracy"])

    def header_lines(self) -> list[str]:
        h = self.header
        v = h.get("versions", {})
        lines = [
            f"date: {h.get('date')}",
            f"device: {h.get('device_name')} ({h.get('device')})" + (f", {h['gpu_count']} GPU(s)" if h.get("gpu_count") else ""),
            "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
            f"dtype {h.get('dtype')}; median of {h.get('reps')} timed calls after {h.get('warmup')} warm-up "
            f"({h.get('timing')}); accuracy: the accuracy rule (graphopt/accuracy.py, docs/design.md) vs a float64 copy, eager as the yardstick",
        ]
        if h.get("command"):
            lines.append(f"command: {h['command']}")
        return lines

    def to_markdown(self) -> str:
        cols = self.columns()
        out = [f"# graphopt benchmark: {self.header.get('device_name')}, {self.header.get('date')}", ""]
        out += [f"- {line}" for line in self.header_lines()]
        out += ["", "| " + " | ".join(cols) + " |",
                "| " + " | ".join("---" if c in ("config", "variant", "accuracy") else "---:" for c in cols) + " |"]
        for row in self.rows():
            out.append("| " + " | ".join(str(row.get(c, "")).replace("|", "\\|") for c in cols) + " |")
        notes = [(r.title, n) for r in self.results for n in r.notes]
        notes += [(f"{r.title} · {v.variant}", v.error) for r in self.results for v in r.variants if v.error]
        if notes:
            out += ["", "Notes:", ""] + [f"- **{t}**: {n}" for t, n in notes]
        return "\n".join(out) + "\n"

    def render(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        for line in self.header_lines():
            console.print(line, style="dim", highlight=False)
        table = Table(header_style="bold", show_lines=False)
        for c in self.columns():
            table.add_column(c, justify="left" if c in ("config", "variant", "accuracy") else "right",
                             no_wrap=c != "accuracy")
        for row in self.rows():
            style = "bold" if row["variant"].startswith("graphopt") else None
            table.add_row(*[_rich_cell(c, row.get(c, "")) for c in self.columns()], style=style)
        console.print(table)
        for r in self.results:
            for n in r.notes:
                console.print(f"• {r.title}: {n}", highlight=False)
            for v in r.variants:
                if v.error:
                    console.print(f"• {r.title} · {v.variant}: {v.error}", style="yellow", highlight=False)
        for key in ("json", "markdown"):
            if key in self.paths:
                console.print(f"wrote {self.paths[key]}")


def _rich_cell(col: str, text: str) -> str:
    from rich.markup import escape

    text = escape(str(text))
    if col == "accuracy" and text.startswith("FAIL"):
        return f"[red]{text}[/red]"
    if col == "ms" and text in ("error", "skipped"):
        return f"[yellow]{text}[/yellow]"
    return text


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return ""
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _fmt_acc(v: VariantResult) -> str:
    if v.status == "skipped":
        return _short(v.error or "skipped", 60)
    if v.status == "error":
        return _short(v.error or "error", 60)
    a = v.accuracy
    if not a:
        return "not checked"
    if "reason" in a and a.get("passed") is None:
        return _short(a["reason"], 60)
    mark = "ok" if a["passed"] else "FAIL"
    return f"{mark} {a.get('how', '')} rmse {a.get('rmse', float('nan')):.2g}".strip()


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


# ------------------------------------------------------------------------------------ environment


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        commit = out.stdout.strip() or None
        if commit:  # a tree that differs from its HEAD (a copied working tree) says so
            st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
            if st.stdout.strip():
                commit += "+modified"
        return commit
    except Exception:  # noqa: BLE001
        return None


def _version(module: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(module)
    except Exception:  # noqa: BLE001
        return None


def environment(device: torch.device) -> dict:
    """The header of a result: date, device, versions."""
    from .. import __version__

    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        gpus = torch.cuda.device_count()
    else:
        name = platform.processor() or platform.machine() or "cpu"
        name = f"CPU {name} ({torch.get_num_threads()} threads)"
        gpus = 0
    commit = _git_commit()
    return {
        "date": utc_now(),
        "device": str(dev),
        "device_name": name,
        "gpu_count": gpus,
        "versions": {
            "torch": torch.__version__,
            "CUDA": torch.version.cuda if dev.type == "cuda" else None,
            "cuDNN": str(torch.backends.cudnn.version()) if dev.type == "cuda" and torch.backends.cudnn.is_available() else None,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "torchvision": _version("torchvision"),
            "graphopt": __version__ + (f" ({commit})" if commit else ""),
            "python": platform.python_version(),
        },
        "settings": {"cudnn.benchmark": torch.backends.cudnn.benchmark,
                     "float32_matmul_precision": torch.get_float32_matmul_precision()},
    }


def utc_now() -> str:
    """The time now as result files and profiles record it: ``2026-12-02 05:10 UTC``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def result_stem(header: dict, tag: str | None = None) -> str:
    """``[<tag>_]YYYY-MM-DD_HHMMSS_<device>_torch-<ver>[_cuda-<ver>]``: file names for a run."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    dev = header.get("device_name", "device").lower().replace("nvidia ", "")
    if header.get("device", "").startswith("cpu"):
        dev = "cpu"
    parts = ([tag] if tag else []) + [now, dev, f"torch-{header['versions']['torch']}"]
    if header["versions"].get("CUDA"):
        parts.append(f"cuda-{header['versions']['CUDA']}")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts))


# ------------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, *, reps: int, warmup: int, device) -> list[float]:
    """Seconds per call: ``warmup`` untimed calls, then ``reps`` calls each timed alone (CUDA
    events, the device idle before each; perf_counter on the CPU)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        with torch.cuda.device(device):
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


class DeviceLock:
    """An exclusive lock on the device shared by processes that benchmark at once (a file lock at the
    path in ``$GRAPHOPT_BENCH_LOCK``; no variable: nothing is locked). A config holds it from its fp64
    reference to its last timed call, and lets it go only while torch.compile compiles and makes its
    first call. That compilation is mostly host work, but its first call and its kernel autotuning run
    on the device, so a holder's timing can still share the device with them: times measured so are
    a screen, not the published number (``perf --jobs 1`` is). On a host of
    at least 8 cores the holder's thread also gets RESERVED_CORES to itself: a process without the
    lock runs on the other cores (its compile workers, spawned then, inherit them), so the host
    time of an eager or launch-bound call is not shared with another process's compilation."""

    ENV = "GRAPHOPT_BENCH_LOCK"
    RESERVED_CORES = 2

    def __init__(self, path: str | None = None):
        self.path = path if path is not None else os.environ.get(self.ENV)
        self._fd = None
        self.waited_s = 0.0
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if self.path and len(cores) >= 8:
            self._held_cores, self._free_cores = set(cores[:self.RESERVED_CORES]), set(cores[self.RESERVED_CORES:])
            os.sched_setaffinity(0, self._free_cores)
        else:
            self._held_cores = self._free_cores = None

    def _pin(self, cores) -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    def acquire(self) -> None:
        if not self.path or self._fd is not None:
            return
        import fcntl  # POSIX: imported only where a lock is asked for

        t0 = time.perf_counter()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.waited_s += time.perf_counter() - t0
        self._pin(self._held_cores)

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        self._pin(self._free_cores)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


# ------------------------------------------------------------------------------------ accuracy


@dataclass
class _Sample:
    shapes: list
    leaves: list  # CPU tensors: flat, strided samples of each output leaf
    sampled: list  # (leaf index, stride) for leaves that were sampled


def _sample(out, max_elems: int) -> _Sample:
    leaves = accuracy.flatten_outputs(out)
    shapes, flat, sampled = [], [], []
    for i, t in enumerate(leaves):
        shapes.append(tuple(t.shape))
        f = t.detach().reshape(-1)
        if f.numel() > max_elems:
            stride = math.ceil(f.numel() / max_elems)
            f = f[::stride]
            sampled.append((i, stride))
        flat.append(f.to("cpu", copy=True))
    return _Sample(shapes, flat, sampled)


def _check(sample: _Sample, ref: _Sample | None, eager: _Sample | None) -> dict:
    if ref is None:
        return {"passed": None, "reason": "no fp64 reference"}
    if sample.shapes != ref.shapes:
        return {"passed": False, "how": "fail", "rmse": float("inf"), "max_abs_err": float("inf"),
                "reason": f"output shapes {sample.shapes} differ from the reference's {ref.shapes}"}
    res = accuracy.check(sample.leaves, ref.leaves, eager.leaves if eager is not None else None)
    worst = max(res.leaves, key=lambda leaf: (not leaf.passed, leaf.rmse), default=None)
    return {"passed": res.passed, "how": worst.how if worst else "allclose", "rmse": res.worst_rmse,
            "max_abs_err": res.max_abs_err, "eager_rmse": worst.eager_rmse if worst else None, "reason": res.reason}


# ------------------------------------------------------------------------------------ models


def _is_cnn(name: str, model) -> bool:
    from ..examples import zoo

    if name in zoo.names():
        return zoo.entry(name).family == "cnn"
    return sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) >= 3


def to_channels_last(model: torch.nn.Module) -> torch.nn.Module:
    """The model's 4-D parameters and buffers laid out channels_last, in place (each keeps its
    identity). ``Module.to(memory_format=torch.channels_last)`` converts 5-D tensors too, which the
    4-D format refuses ("required rank 4 tensor"): a Conv3d's weight, a 5-D position table."""
    with torch.no_grad():
        for m in model.modules():
            for table in (m._parameters, m._buffers):
                for t in table.values():
                    if t is not None and t.dim() == 4:
                        t.data = t.data.contiguous(memory_format=torch.channels_last)
    return model


def prepare_model(spec: str, batch, seq_len, dtype, device):
    """(model, args, kwargs, name, channels_last): a model spec (graphopt.tools.modelspec) built at
    ``batch``/``seq_len``, converted to ``dtype`` and ``device`` in eval mode, CNNs in low precision
    laid out channels_last; every driver that times or measures a model prepares it this way."""
    from ..capture import _register_hf_pytrees, split_inputs
    from .modelspec import load_model

    model, inputs, name = load_model(spec, batch=batch, seq_len=seq_len, dtype=dtype, device=str(device))
    _register_hf_pytrees()  # DynamicCache outputs flatten the same way for every variant
    args, kwargs = split_inputs(inputs)

    def conv(x):
        if isinstance(x, torch.Tensor):
            return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
        return x

    model = model.to(device=device, dtype=dtype).eval()
    args, kwargs = pytree.tree_map(conv, (args, kwargs))
    channels_last = dtype in accuracy.LOW_PRECISION and _is_cnn(name, model)
    if channels_last:
        to_channels_last(model)
        args, kwargs = pytree.tree_map(
            lambda x: x.contiguous(memory_format=torch.channels_last)
            if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() else x, (args, kwargs))
    return model, args, kwargs, name, channels_last


def _slice_batch(args, kwargs, built: int | None, want: int | None):
    if want is None or built is None or want == built:
        return args, kwargs
    return pytree.tree_map(lambda x: x[:want] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == built else x,
                           (args, kwargs))


def _label(variant: str, dtype: torch.dtype, channels_last: bool) -> str:
    d = _SHORT.get(dtype, str(dtype))
    if variant == "eager":
        return f"eager {d} (hand-converted, channels_last)" if channels_last else f"eager {d}"
    return {"compile": "torch.compile", "compile-ro": "torch.compile reduce-overhead", "graphopt": "graphopt",
            "graphopt-reuse": "graphopt (reuse outputs)"}[variant]


# ------------------------------------------------------------------------------------ the run


class _Budget:
    def __init__(self, seconds: float | None):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def spent(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.t0 > self.seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _with_defaults(c: BenchConfig) -> BenchConfig:
    """Zoo models: fill in the zoo's default batch / sequence length so the table shows them."""
    from ..examples import zoo

    if c.model not in zoo.names():
        return c
    e = zoo.entry(c.model)
    return BenchConfig(c.model, c.batch if c.batch is not None else e.default_batch,
                       c.seq_len if c.seq_len is not None else e.default_seq_len, c.vs, c.optimize_kwargs)


def _group(configs: list[BenchConfig]) -> list[tuple[tuple, list[BenchConfig]]]:
    groups: dict[tuple, list[BenchConfig]] = {}
    for c in map(_with_defaults, configs):
        groups.setdefault((c.model, c.seq_len), []).append(c)
    return list(groups.items())


def run(configs, *, dtype=None, device=None, reps: int | None = None, warmup: int | None = None,
        budget_s: float | None = None, out_dir: str | Path | None = DEFAULT_OUT, console=None,
        progress: bool = True, optimize_kwargs: dict | None = None, max_check_elems: int = 1 << 24,
        command: str | None = None, tag: str | None = "bench") -> BenchRun:
    """Benchmark every :class:`BenchConfig` (see the module docstring); returns a
    :class:`BenchRun` and, unless ``out_dir`` is None, writes ``<stem>.json`` and ``<stem>.md``
    there (rewritten after every variant).

    dtype: "bf16", "fp32", "fp16" or a torch.dtype (default: bf16 on CUDA, fp32 on the CPU).
    device: default cuda if available, else cpu. reps / warmup: default 50 / 10 on CUDA, 10 / 2
    on the CPU. budget_s: stop starting variants after this many seconds (they are recorded as
    skipped). optimize_kwargs: passed to ``graphopt.optimize`` (e.g. ``{"check_accuracy": False}``).
    tag: the file-name prefix (``bench_2026-11-05_140312_h200_torch-2.14.1_cuda-13.0.json``).
    """
    from rich.console import Console

    configs = [c if isinstance(c, BenchConfig) else BenchConfig(c) for c in configs]
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device} requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = parse_dtype(dtype) if dtype is not None else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    reps = reps if reps is not None else (50 if device.type == "cuda" else 10)
    warmup = warmup if warmup is not None else (10 if device.type == "cuda" else 2)
    console = console or Console()
    header = environment(device)
    header.update(dtype=_SHORT.get(dtype, str(dtype)), reps=reps, warmup=warmup,
                  timing="CUDA events, device synchronized before each call" if device.type == "cuda" else "perf_counter",
                  max_check_elems=max_check_elems, optimize_kwargs=optimize_kwargs or {},
                  command=command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
    result = BenchRun(header)
    stem = result_stem(header, tag)
    out_dir = Path(out_dir) if out_dir is not None else None

    def save():
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        jp, mp = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
        jp.write_text(result.to_json())
        mp.write_text(result.to_markdown())
        result.paths = {"json": str(jp), "markdown": str(mp)}

    budget = _Budget(budget_s)
    total = sum(len(parse_vs(c.vs)) for c in configs)
    prog = _progress(console, progress, total)
    with prog:
        task = prog.add_task("benchmark", total=total)
        try:
            for (spec, seq_len), group in _group(configs):
                _run_group(spec, seq_len, group, result, dtype=dtype, device=device, reps=reps, warmup=warmup,
                           budget=budget, console=prog.console, prog=prog, task=task,
                           optimize_kwargs=optimize_kwargs or {}, max_check_elems=max_check_elems, save=save)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: keep and report what was measured
            header["interrupted"] = f"after {budget.elapsed():.0f} s"
            console.print(f"[yellow]interrupted after {budget.elapsed():.0f} s; reporting what was measured[/yellow]")
    save()
    return result


def _progress(console, enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    # no auto-refresh thread: it competes with the timed calls (on a 2-core CPU it distorted an
    # MLP's timing 100x); the bar is redrawn when a step advances
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True, disable=not enabled, auto_refresh=False)


def _run_group(spec, seq_len, group, result: BenchRun, *, dtype, device, reps, warmup, budget, console, prog,
               task, optimize_kwargs, max_check_elems, save):
    batches = [c.batch for c in group]
    built_batch = None if any(b is None for b in batches) else max(batches)
    prog.update(task, description=f"{spec}: building", refresh=True)
    try:
        if budget.spent():
            raise _Skip("time budget spent")
        model, args0, kwargs0, name, channels_last = prepare_model(spec, built_batch, seq_len, dtype, device)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        why = str(e) if isinstance(e, _Skip) else _first_line(e)
        for c in group:
            r = ConfigResult(spec, c.batch, c.seq_len, _SHORT.get(dtype, str(dtype)), str(device), error=why)
            r.variants = [VariantResult(v, _label(v, dtype, False), "skipped" if isinstance(e, _Skip) else "error", why)
                          for v in parse_vs(c.vs)]
            result.results.append(r)
            prog.advance(task, len(parse_vs(c.vs)))
            prog.refresh()
            console.print(f"[yellow]{r.title}: {why}[/yellow]", highlight=False)
        save()
        return
    try:
        for c in group:
            args, kwargs = _slice_batch(args0, kwargs0, built_batch, c.batch)
            r = ConfigResult(name, c.batch, c.seq_len, _SHORT.get(dtype, str(dtype)), str(device), channels_last)
            if c.batch is not None and c.batch != built_batch:
                r.notes.append(f"inputs: the first {c.batch} rows of the bs{built_batch} inputs")
            result.results.append(r)
            kw = {**optimize_kwargs, **(c.optimize_kwargs or {})}
            if kw.get("check_accuracy") is False:
                r.notes.append("graphopt optimized without its fp64 accuracy guard (check_accuracy=False)")
            _run_config(model, args, kwargs, c, r, dtype=dtype, device=device, reps=reps, warmup=warmup,
                        budget=budget, console=console, prog=prog, task=task, optimize_kwargs=kw,
                        max_check_elems=max_check_elems, save=save)
    finally:
        del model, args0, kwargs0
        _free(device)


class _Skip(Exception):
    pass


def _run_config(model, args, kwargs, c: BenchConfig, r: ConfigResult, *, dtype, device, reps, warmup, budget,
                console, prog, task, optimize_kwargs, max_check_elems, save):
    lock = DeviceLock()
    with lock:
        _run_config_locked(model, args, kwargs, c, r, dtype=dtype, device=device, reps=reps, warmup=warmup,
                           budget=budget, console=console, prog=prog, task=task, optimize_kwargs=optimize_kwargs,
                           max_check_elems=max_check_elems, save=save, lock=lock)
    if lock.path:
        r.notes.append(f"device shared with other benchmark processes: waited {lock.waited_s:.0f} s for it; "
                       "torch.compile compiled while others ran")
        save()


def _run_config_locked(model, args, kwargs, c: BenchConfig, r: ConfigResult, *, dtype, device, reps, warmup, budget,
                       console, prog, task, optimize_kwargs, max_check_elems, save, lock):
    variants = parse_vs(c.vs)
    prog.update(task, description=f"{r.title}: fp64 reference", refresh=True)
    ref = None
    try:
        if budget.spent():
            raise _Skip("time budget spent")
        ref = _sample(accuracy.fp64_reference(model, args, kwargs), max_check_elems)
        if ref.sampled:
            r.notes.append("accuracy on a strided sample of " + ", ".join(
                f"output {i} (every {s}th element)" for i, s in ref.sampled))
    except _Skip:
        r.notes.append("no fp64 reference (time budget spent)")
    except Exception as e:  # noqa: BLE001
        r.notes.append(f"no fp64 reference: {_first_line(e)}")
    _free(device)
    eager_sample = None
    state: dict = {}
    for v in variants:
        vr = VariantResult(v, _label(v, dtype, r.channels_last))
        r.variants.append(vr)
        prog.update(task, description=f"{r.title}: {vr.label}", refresh=True)
        if budget.spent():
            vr.status, vr.error = "skipped", f"time budget spent ({budget.elapsed():.0f} s)"
        else:
            sample = _run_variant(v, vr, model, args, kwargs, state, device=device, reps=reps, warmup=warmup,
                                  optimize_kwargs=optimize_kwargs, max_check_elems=max_check_elems, name=r.model,
                                  lock=lock)
            if v == "eager" and sample is not None:
                eager_sample = sample
            if sample is not None:
                try:
                    vr.accuracy = _check(sample, ref, eager_sample)
                except Exception as e:  # noqa: BLE001
                    vr.accuracy = {"passed": None, "reason": f"accuracy check failed: {_first_line(e)}"}
                guard = vr.extra.get("guard") or {}
                if vr.accuracy.get("passed") is False and guard.get("passed"):
                    tols = sorted({o.get("tol") for o in guard.get("outputs", []) if o.get("tol")})
                    r.notes.append(f"{v}: graphopt's own guard passed (tol {', '.join(map(str, tols)) or '?'}; passes "
                                   f"applied: {', '.join(vr.extra.get('applied', []))}) but the bench judges at "
                                   f"{r.dtype}'s tolerance: a pass lowered precision below the requested dtype")
        prog.advance(task)
        prog.refresh()
        console.print(_line(r, vr), highlight=False)
        save()
    if c.interleave and r.get("eager") is not None and r.get("graphopt") is not None \
            and r.get("eager").status == "ok" and r.get("graphopt").status == "ok" and "graphopt" in state:
        compiled = state.get("compiled")
        if compiled is not None and (r.get(compiled[0]) is None or r.get(compiled[0]).status != "ok"):
            compiled = None
        _interleaved(model, state["graphopt"], args, kwargs, r.get("graphopt"), device=device, reps=reps,
                     warmup=warmup, compiled=compiled)
        save()
    state.clear()
    _free(device)


def _interleaved(model, opt, args, kwargs, vr: VariantResult, *, device, reps, warmup, compiled=None) -> None:
    """Eager and graphopt timed again in alternating calls (graphopt.runtime.measured.Timer.compare),
    with the last torch.compile variant built (``compiled``: (variant, module)) in the same rounds."""
    from ..runtime.measured import Timer

    fns = [lambda: model(*args, **kwargs), lambda: opt(*args, **kwargs)]
    if compiled is not None:
        fns.append(lambda: compiled[1](*args, **kwargs))
    timer = Timer(device, warmup=warmup, min_reps=reps, max_reps=reps)
    try:
        timings = timer.compare(*fns)
    except Exception as e:  # noqa: BLE001 - the variants' own times stand
        vr.extra["interleaved"] = {"error": _first_line(e)}
        return
    eager, ours = timings[:2]
    vr.extra["interleaved"] = {"eager_ms": eager.median_s * 1e3, "graphopt_ms": ours.median_s * 1e3,
                               "eager_min_ms": min(eager.samples) * 1e3, "graphopt_min_ms": min(ours.samples) * 1e3,
                               "reps": len(ours.samples)}
    if compiled is not None:
        vr.extra["interleaved"].update({f"{compiled[0]}_ms": timings[2].median_s * 1e3,
                                        f"{compiled[0]}_min_ms": min(timings[2].samples) * 1e3})


def _line(r: ConfigResult, v: VariantResult) -> str:
    if v.status != "ok":
        return f"  {r.title} · {v.label}: {v.status} ({_short(v.error or '', 120)})"
    vs_eager = r.speedup(v.variant, "eager")
    parts = [f"{_fmt_ms(v.ms)} ms"]
    if vs_eager is not None and v.variant != "eager":
        parts.append(f"{vs_eager:.2f}× eager")
    if v.setup_s is not None:
        parts.append(f"setup {v.setup_s:.1f} s")
    if v.setup_peak_bytes is not None:
        parts.append(f"setup peak {_fmt_bytes(v.setup_peak_bytes)}")
    if v.peak_mem_bytes is not None:
        parts.append(f"peak {_fmt_bytes(v.peak_mem_bytes)}")
    parts.append(f"accuracy {_fmt_acc(v)}")
    return f"  {r.title} · {v.label}: " + ", ".join(parts)


def _build(variant: str, model, args, kwargs, state: dict, optimize_kwargs: dict, name: str):
    if variant == "eager":
        return model
    if variant in ("compile", "compile-ro"):
        torch.compiler.reset()  # (which drops what an earlier compile variant compiled: only the last is kept)
        compiled = torch.compile(model, mode="reduce-overhead" if variant == "compile-ro" else None)
        state["compiled"] = (variant, compiled)
        return compiled
    if variant == "graphopt":
        from ..api import optimize

        opt = optimize(model, (args, kwargs), model_name=name, **optimize_kwargs)
        state["graphopt"] = opt
        return opt
    if variant == "graphopt-reuse":
        opt = state.get("graphopt")
        if opt is None:
            raise RuntimeError("graphopt failed or did not run; nothing to reuse")
        runner = opt.runner
        opt.set_cuda_graphs(runner.decision.mode if runner is not None else "auto",
                            max_graphs=runner.max_graphs if runner is not None else 8, reuse_outputs=True)
        return opt
    raise ValueError(variant)


def _run_variant(variant, vr: VariantResult, model, args, kwargs, state, *, device, reps, warmup,
                 optimize_kwargs, max_check_elems, name, lock: DeviceLock | None = None):
    """Build, first call (setup), accuracy sample, timing. Returns the output sample or None.
    ``lock``: let go while torch.compile compiles (its first call), taken again before timing."""
    _free(device)
    fn = None
    compiling = lock is not None and variant in ("compile", "compile-ro")
    try:
        if compiling:
            lock.release()
        t0 = time.perf_counter()
        fn = _build(variant, model, args, kwargs, state, optimize_kwargs, name)
        with torch.inference_mode():
            out = fn(*args, **kwargs)
            _sync(device)
            if variant != "eager":
                vr.setup_s = time.perf_counter() - t0 if variant != "graphopt-reuse" else None
            if compiling:
                lock.acquire()
            sample = _sample(out, max_check_elems)  # before the next call can overwrite it
            del out
            # building (torch.compile's compilation, graphopt's fp64 accuracy guard) can need far more
            # memory than running: report the two peaks apart
            vr.setup_peak_bytes = _peak(device)
            if vr.setup_peak_bytes is None and variant == "graphopt":  # off the GPU: the report's account
                vr.setup_peak_bytes = getattr(fn.report, "setup_peak_bytes", None)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = time_call(lambda: fn(*args, **kwargs), reps=reps, warmup=warmup, device=device)
        times_ms = sorted(t * 1e3 for t in times)
        vr.ms = statistics.median(times_ms)
        vr.ms_min = times_ms[0]
        vr.ms_p90 = times_ms[min(len(times_ms) - 1, int(round(0.9 * (len(times_ms) - 1))))]
        vr.reps = len(times_ms)
        vr.peak_mem_bytes = _peak(device)
        if variant.startswith("graphopt"):
            vr.extra.update(_graphopt_extra(fn))
        return sample
    except Exception as e:  # noqa: BLE001 - one failing variant is a row, not the end of the run
        vr.status, vr.error = "error", _first_line(e)
        if traceback_requested():
            import traceback

            traceback.print_exc()
        return None
    finally:
        if compiling:
            lock.acquire()
        del fn
        if variant in ("compile", "compile-ro"):
            try:
                torch.compiler.reset()
            except Exception:  # noqa: BLE001
                pass


def _graphopt_extra(opt) -> dict:
    rep = opt.report
    runner = getattr(opt, "runner", None)
    extra = {"predicted_ms": rep.predicted_s_after * 1e3, "predicted_ms_before": rep.predicted_s_before * 1e3,
             "optimize_s": rep.optimize_seconds, "optimize_phases": getattr(rep, "optimize_phases", {}),
             "guard": rep.accuracy, "setup_memory": getattr(rep, "memory", None), "speed": getattr(rep, "speed", None),
             "pass_ms": {p.name: p.details.get("measured_ms") for p in rep.passes
                         if getattr(p, "status", "") == "applied"}}
    extra["applied"] = list(extra["pass_ms"])
    # pass -> the one line of its revert (a measured loss, the accuracy rule, or a broken graph): the
    # revert's own line (the measured guard's verdict on a pass judged alone may follow it)
    extra["reverted"] = {p.name: next((n for n in reversed(p.notes) if n.startswith("reverted:")),
                                      p.notes[-1] if p.notes else "")
                         for p in rep.passes if getattr(p, "status", "") == "reverted"}
    # pass -> the measured guard's verdict on a pass measured slower alone and held while the others ran
    extra["held"] = {p.name: p.details["held_verdict"] for p in rep.passes if "held_verdict" in p.details}
    # pass -> [candidates refused, candidates timed] by timing them on the device before they applied
    extra["timed_candidates"] = {
        p.name: [sum(t["refused"] for t in timed), len(timed)]
        for p in rep.passes if (timed := p.details.get("timed_candidates"))}
    if runner is not None:
        extra["cuda_graph"] = runner.decision.note()
        extra["runner_stats"] = {k: v for k, v in runner.stats.items()}
        if runner._disabled:
            extra["cuda_graph_disabled"] = runner._disabled
    return extra


# ------------------------------------------------------------------------------------ CLI


def run_cli(args) -> int:
    """``graphopt bench`` (see graphopt/tools/cli.py for the flags)."""
    from rich.console import Console

    from ..errors import GraphoptError

    models = args.models or ["resnet50"]
    try:
        vs = parse_vs(args.vs)
        dtype = parse_dtype(args.dtype) if args.dtype else None
    except ValueError as e:
        raise GraphoptError(str(e)) from None
    if args.device:
        try:
            dev = torch.device(args.device)
        except (RuntimeError, TypeError):
            raise GraphoptError(f"unknown device '{args.device}'") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise GraphoptError(f"--device {args.device}: CUDA is not available here")
    for n, v in (("--batch", args.batch), ("--seq-len", args.seq_len), ("--reps", args.reps)):
        if v is not None and v < 1:
            raise GraphoptError(f"{n} must be a positive integer, got {v}")
    console = Console() if Console().is_terminal else Console(width=160)
    result = run([BenchConfig(m, args.batch, args.seq_len, vs) for m in models], dtype=dtype, device=args.device,
                 reps=args.reps, warmup=args.warmup, budget_s=args.budget_s,
                 out_dir=None if args.no_save else (args.out or DEFAULT_OUT), console=console,
                 optimize_kwargs={"check_accuracy": False} if args.no_guard else None)
    result.render(console)
    failed = any(v.status == "error" or (v.accuracy and v.accuracy.get("passed") is False)
                 for r in result.results for v in r.variants if v.variant.startswith("graphopt"))
    return 1 if failed else 0
